"""The kvserve processes: the command line, the gateway, the workers, the benchmarks."""
