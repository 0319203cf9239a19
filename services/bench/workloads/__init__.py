"""The benchmarks' workloads: prompts as token ids, deterministic under a seed."""
