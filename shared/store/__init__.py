"""kvserve: shared/store."""
