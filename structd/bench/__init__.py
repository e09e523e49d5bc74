"""`structd bench ...`: the benchmarks (grammar/, e2e/, soak, faults) and the launchers they share (harness)."""
