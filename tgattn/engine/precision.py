"""The dtype the engine's kernels compute in (the lowest module of the engine: everything may import it)."""
from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels run in: half precision is computed (and accumulated) in float32.

    Example:
        >>> compute_dtype(torch.bfloat16), compute_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
