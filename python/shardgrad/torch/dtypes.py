"""torch dtypes and shardgrad's DType, both ways."""

import torch

from .._structs import DType
from ..errors import InvalidArgumentError

__all__ = ["sg_dtype", "torch_dtype"]

TO_SG = {torch.float32: DType.F32, torch.bfloat16: DType.BF16, torch.float16: DType.F16}
TO_TORCH = {v: k for k, v in TO_SG.items()}


def sg_dtype(dt):
    """DType of a torch dtype (float32, bfloat16, float16)."""
    if dt not in TO_SG:
        raise InvalidArgumentError("no shardgrad dtype for %s" % dt, function="python")
    return TO_SG[dt]


def torch_dtype(dt):
    return TO_TORCH[DType(dt)]
