"""Zero-copy torch tensors of an Engine's memory: Engine.param_tensor and Engine.grad_tensor
(the package puts them on Engine, whose own module knows no tensor framework)."""

import math
import warnings

import torch

from .._structs import DType, Device
from ..core import _ITEMSIZE, _host_buffer
from .dtypes import torch_dtype

__all__ = ["param_tensor", "grad_tensor", "tensor_view"]


class _CudaArray:
    """Just enough __cuda_array_interface__ for torch.as_tensor."""

    def __init__(self, ptr, shape, typestr, owner):
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr, "data": (ptr, False), "version": 2,
            "strides": None, "stream": None}


def tensor_view(ptr, dtype, shape, device, owner):
    """A tensor of `shape` and `dtype` over library memory at ptr on `device` (CPU or CUDA),
    which keeps `owner` (the Engine) alive."""
    numel = math.prod(shape)
    if device == Device.CUDA:
        # CUDA array interface has no bf16 type string: view the bits as int16.
        typestr = {DType.F32: "<f4", DType.BF16: "<i2", DType.F16: "<f2"}[dtype]
        t = torch.as_tensor(_CudaArray(ptr, (numel,), typestr, owner), device="cuda")
        if dtype == DType.BF16:
            t = t.view(torch.bfloat16)
        return t.view(shape)
    buf = _host_buffer(ptr, numel * _ITEMSIZE[dtype], owner)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns that the buffer is not read-only
        t = torch.frombuffer(buf, dtype=torch_dtype(dtype), count=numel)
    return t.view(shape)


def param_tensor(engine, pid):
    """Zero-copy torch tensor of working parameter `pid` (CPU, or CUDA for CUDA engines).
    After a step with overlap_param_gather, param_wait(pid) before reading it."""
    return tensor_view(engine.param_ptr(pid), engine.param_dtype, engine.param_shape(pid),
                       engine.config.device, engine)


def grad_tensor(engine, pid):
    """Zero-copy torch view of the gradient slot of `pid`, valid until grad_ready(pid)."""
    return tensor_view(engine.grad_ptr(pid), engine.grad_dtype, engine.param_shape(pid),
                       engine.config.device, engine)
