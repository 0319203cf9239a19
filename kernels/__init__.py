"""Attention and KV-cache kernels: torch references (the spec) and Triton implementations."""
