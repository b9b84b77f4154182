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
