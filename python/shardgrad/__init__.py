"""shardgrad: sharded data-parallel training (ZeRO-2 / FSDP SHARD_GRAD_OP) through ctypes.

    import shardgrad as sg
    comm = sg.Comm.mpi()                      # or sg.Comm.local(n) for n threads
    with sg.Engine(comm, lr=1e-3, max_grad_norm=1.0) as e:
        ...

PyTorch integration: shardgrad.torch.ShardedAdamW (imported on demand; needs torch).
The C library is found through SHARDGRAD_LIBRARY, next to this package, or the system path.
"""

from ._lib import LibraryNotFoundError, library_path
from ._structs import MAX_GROUPS, PARAM_NO_DECAY, Codec, DType, Device, Status, Strategy, TraceKind
from .config import Config
from .core import (Comm, Engine, MemoryStats, StepInfo, TraceEvent, estimate_memory,
                   has_backend, last_error, run_threads, status_string, version)
from .errors import (CommError, CorruptError, CudaError, InternalError, InvalidArgumentError,
                     InvalidStateError, MismatchError, OutOfMemoryError, ShardgradError,
                     ShardgradIOError, ShardgradTimeoutError, UnsupportedError)
from .tracing import trace_overlap


# Comm.from_torch, Engine.param_tensor and Engine.grad_tensor come from the torch package
# (shardgrad.torch.comm, shardgrad.torch.views): core.py and the ctypes layer under it import
# no tensor framework. Attached here, the package's front door, they import shardgrad.torch on
# their first call, so that `sg.Comm.from_torch()` works without `import shardgrad.torch` and
# `import shardgrad` never imports torch.
def _from_torch(cls, group=None):
    """Collective: a communicator with the ranks of an initialized torch.distributed group
    (default: the world); NCCL, MPI (under mpirun) or a transport over the group itself.
    See shardgrad.torch.comm.comm_from_torch."""
    from .torch.comm import comm_from_torch
    return comm_from_torch(group)


def _param_tensor(self, pid):
    """Zero-copy torch tensor of working parameter `pid` (CPU, or CUDA for CUDA engines).
    After a step with overlap_param_gather, param_wait(pid) before reading it."""
    from .torch.views import param_tensor
    return param_tensor(self, pid)


def _grad_tensor(self, pid):
    """Zero-copy torch view of the gradient slot of `pid`, valid until grad_ready(pid)."""
    from .torch.views import grad_tensor
    return grad_tensor(self, pid)


Comm.from_torch = classmethod(_from_torch)
Engine.param_tensor = _param_tensor
Engine.grad_tensor = _grad_tensor


def __getattr__(name):
    # __version__ is the loaded library's (sg_version(): include/shardgrad.h, the one place the
    # version is written), read on first use so that importing the package needs no library.
    if name == "__version__":
        return "%d.%d.%d" % version()
    raise AttributeError("module 'shardgrad' has no attribute %r" % name)


__all__ = [
    "LibraryNotFoundError", "library_path", "MAX_GROUPS",
    "PARAM_NO_DECAY", "DType", "Device", "Status",
    "Strategy", "Codec", "TraceKind", "Config", "Comm", "Engine", "MemoryStats", "StepInfo", "TraceEvent",
    "trace_overlap", "estimate_memory", "has_backend", "last_error", "run_threads",
    "status_string", "version", "ShardgradError",
    "InvalidArgumentError", "InvalidStateError", "OutOfMemoryError", "UnsupportedError",
    "MismatchError", "CommError", "ShardgradTimeoutError", "ShardgradIOError", "CorruptError",
    "CudaError", "InternalError",
]
