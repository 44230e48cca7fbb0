"""gpt2_cupy: GPT-2 trained with CUDA C kernels, run by CuPy on a GPU or by the CPU executor."""

__version__ = "0.1.0"
