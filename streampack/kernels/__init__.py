"""Numba kernels: pure functions over arrays. Validation lives in their Python callers."""
