"""kvserve: shared/model."""
