"""kvserve: shared/engine."""
