"""The benchmarks, run by hand: `python -m benchmarks --help` lists every measurement (docs/performance.md)."""
