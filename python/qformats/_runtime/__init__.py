"""Build and machine facts from the native runtime module."""
from ._native import cuda_built, cuda_device_count, num_threads, set_num_threads

__all__ = ["cuda_built", "cuda_device_count", "num_threads", "set_num_threads"]
