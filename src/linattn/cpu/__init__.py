"""Numba CPU kernels. They know no Python objects and do no validation: callers pass checked arrays."""
