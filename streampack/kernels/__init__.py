"""Numba kernels: pure functions over arrays. Validation lives in their Python callers."""

from .attention import range_attention, range_attention_backward

__all__ = ["range_attention", "range_attention_backward"]
