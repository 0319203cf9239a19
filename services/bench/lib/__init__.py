"""What the benchmarks share: the process harness (also the tests'), HTTP clients, readiness,
the comparison arms, measurements of the machine and the engine, report helpers."""
