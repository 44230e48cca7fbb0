"""torch.utils: data (Dataset, DataLoader, samplers)."""

from gpt2_cupy.utils import data

__all__ = ["data"]
