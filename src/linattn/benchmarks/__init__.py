"""Benchmarks that ship with linattn: a small transformer language model in NumPy (and, when torch is
installed, the same model in PyTorch), timed by ``python -m linattn bench --model`` and the asv suite."""
