"""kvserve: services/bench."""
