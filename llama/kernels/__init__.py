"""Our CPU kernels (C++ in csrc/, compiled once per machine), the one-call eager decode step built on them, and
the int4 pack store that keeps repacked weights on disk."""
