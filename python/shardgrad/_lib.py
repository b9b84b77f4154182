"""Loading libshardgrad and declaring every C function's prototype for ctypes.

The library is found, in this order, through:
  1. the SHARDGRAD_LIBRARY environment variable (a file, or a directory holding libshardgrad.so),
  2. a copy next to this package (shardgrad/libshardgrad.so, shardgrad/lib/libshardgrad.so:
     where `pip install ./python` puts the one it builds),
  3. in a source checkout (this package imported from <checkout>/python), the CMake build
     directory <checkout>/build,
  4. the system search path (LD_LIBRARY_PATH, ldconfig; ctypes.util.find_library).
When none works the error lists every path tried and why it failed.

ctypes.CDLL releases the GIL for the duration of each foreign call, so ranks driven by Python
threads (Comm.local) really run their collectives concurrently.
"""

import ctypes
import ctypes.util
import os
import sys
import threading

from ._structs import (SgConfig, SgHardware, SgHparams, SgLoadOptions, SgMemoryStats,
                       SgStepEstimate, SgStepInfo, SgTraceEvent, SgXport)

__all__ = ["LibraryNotFoundError", "load", "library_path", "PROTOTYPES", "OPTIONAL"]

_c_int = ctypes.c_int
_c_float = ctypes.c_float
_c_size = ctypes.c_size_t
_c_char_p = ctypes.c_char_p
_vp = ctypes.c_void_p
_status = ctypes.c_int  # sg_status is a C enum: int-sized
_dtype = ctypes.c_int  # sg_dtype
_pp = ctypes.POINTER(ctypes.c_void_p)  # sg_comm ** / sg_engine ** / void **
_fp = ctypes.POINTER(ctypes.c_float)

# name: (restype, argtypes). Every SG_API function of include/shardgrad.h is listed here; the
# tests parse the header and fail when one is missing.
PROTOTYPES = {
    # status, version, backends
    "sg_status_string": (_c_char_p, [_status]),
    "sg_last_error": (_c_char_p, []),
    "sg_version": (_c_int, []),
    "sg_has_backend": (_c_int, [_c_char_p]),
    # communicators
    "sg_comm_create_local": (_status, [_c_int, _pp]),
    "sg_comm_create_mpi": (_status, [_vp, _pp]),
    "sg_comm_split": (_status, [_vp, _c_int, _c_int, _pp]),
    "sg_comm_split_nodes": (_status, [_vp, _c_int, _pp, _pp]),
    "sg_comm_stats": (_status, [_vp, _vp]),
    "sg_comm_rank": (_c_int, [_vp]),
    "sg_comm_size": (_c_int, [_vp]),
    "sg_comm_destroy": (None, [_vp]),
    # configuration
    "sg_config_init": (_status, [ctypes.POINTER(SgConfig), _c_size]),
    # engine
    "sg_engine_create": (_status, [_vp, ctypes.POINTER(SgConfig), _pp]),
    "sg_engine_create_hybrid": (_status, [_vp, _vp, ctypes.POINTER(SgConfig), _pp]),
    "sg_add_param": (_status, [_vp, _c_char_p, _c_size, ctypes.c_uint32,
                               ctypes.POINTER(_c_int)]),
    "sg_finalize": (_status, [_vp]),
    "sg_param_ptr": (_status, [_vp, _c_int, _pp]),
    "sg_set_param": (_status, [_vp, _c_int, _vp, _dtype]),
    "sg_get_param": (_status, [_vp, _c_int, _vp, _dtype]),
    "sg_broadcast_params": (_status, [_vp, _c_int]),
    "sg_get_master": (_status, [_vp, _c_int, _fp]),
    "sg_get_optim_state": (_status, [_vp, _c_int, _c_int, _fp]),
    "sg_grad_ptr": (_status, [_vp, _c_int, _pp]),
    "sg_grad_ready": (_status, [_vp, _c_int]),
    "sg_grad_add": (_status, [_vp, _c_int, _vp, _dtype]),
    "sg_backward_end": (_status, [_vp]),
    "sg_set_sync": (_status, [_vp, _c_int]),
    "sg_set_microbatches": (_status, [_vp, _c_int]),
    "sg_grad_zero": (_status, [_vp]),
    "sg_step": (_status, [_vp, ctypes.POINTER(SgStepInfo)]),
    "sg_set_lr": (_status, [_vp, _c_float]),
    "sg_get_lr": (_status, [_vp, ctypes.POINTER(_c_float)]),
    "sg_get_loss_scale": (_status, [_vp, _fp]),
    "sg_memory": (_status, [_vp, ctypes.POINTER(SgMemoryStats)]),
    "sg_estimate_memory": (_status, [ctypes.POINTER(SgConfig), ctypes.POINTER(_c_size), _c_int,
                                     _c_int, ctypes.POINTER(SgMemoryStats)]),
    # the step-time model (shardgrad.plan)
    "sg_hardware_init": (_status, [ctypes.POINTER(SgHardware), _c_size]),
    "sg_estimate_step": (_status, [ctypes.POINTER(SgConfig), ctypes.POINTER(_c_size), _c_int,
                                   _c_int, _c_int, ctypes.POINTER(SgHardware),
                                   ctypes.POINTER(SgStepEstimate)]),
    "sg_engine_destroy": (None, [_vp]),
    # Added after version 0.1.0's first builds: bound when the library exports them, otherwise
    # the Python method raises UnsupportedError.
    "sg_comm_create_nccl_mpi": (_status, [_vp, _pp]),
    "sg_nccl_unique_id": (_status, [_vp]),
    "sg_comm_create_nccl": (_status, [_c_int, _c_int, _vp, _c_int, _pp]),
    "sg_set_stream": (_status, [_vp, _vp]),
    "sg_save": (_status, [_vp, _c_char_p]),
    "sg_load": (_status, [_vp, _c_char_p]),
    "sg_export": (_status, [_vp, _c_char_p]),
    "sg_import": (_status, [_vp, _c_char_p]),
    "sg_get_step": (_status, [_vp, ctypes.POINTER(ctypes.c_uint64)]),
    "sg_get_param_step": (_status, [_vp, _c_int, ctypes.POINTER(ctypes.c_uint64)]),
    "sg_trace_start": (_status, [_vp, _c_size]),
    "sg_trace_stop": (_status, [_vp]),
    "sg_trace_mark": (_status, [_vp, _c_char_p]),
    "sg_trace_events": (_status, [_vp, ctypes.POINTER(SgTraceEvent), _c_size,
                                  ctypes.POINTER(_c_size), ctypes.POINTER(ctypes.c_uint64)]),
    "sg_trace_write": (_status, [_vp, _c_char_p]),
    # 0.2: overlapped parameter all-gather (sg_config.overlap_param_gather)
    "sg_param_wait": (_status, [_vp, _c_int]),
    # parameter groups (per-group lr and weight decay)
    "sg_set_param_group": (_status, [_vp, _c_int, _c_int]),
    "sg_set_group": (_status, [_vp, _c_int, _c_float, _c_float]),
    "sg_get_group": (_status, [_vp, _c_int, ctypes.POINTER(_c_float), ctypes.POINTER(_c_float)]),
    # exact (double) hyperparameters, the gradient norm before sg_step
    "sg_get_hparams": (_status, [_vp, _c_int, ctypes.POINTER(SgHparams)]),
    "sg_set_hparams": (_status, [_vp, _c_int, ctypes.POINTER(SgHparams)]),
    "sg_grad_norm": (_status, [_vp, _fp]),
    "sg_grad_scale": (_status, [_vp, ctypes.c_double]),
    # a communicator over the caller's transport (torch.distributed: Comm.from_torch)
    "sg_comm_create_xport": (_status, [ctypes.POINTER(SgXport), _c_int, _c_int, _pp]),
    "sg_xport_done": (_status, [_vp, _c_int, _c_size, _c_char_p]),
    # sg_load_ex: a checkpoint's optimizer state converted between fp32 and 8 bits
    "sg_load_options_init": (_status, [ctypes.POINTER(SgLoadOptions), _c_size]),
    "sg_load_ex": (_status, [_vp, _c_char_p, ctypes.POINTER(SgLoadOptions)]),
    # the latest step's info, read when wanted (sg_step without info needs no host sync)
    "sg_last_step_info": (_status, [_vp, ctypes.POINTER(SgStepInfo)]),
}

# Functions the library may lack (see above); every other entry must be exported.
OPTIONAL = frozenset({
    "sg_comm_create_nccl_mpi", "sg_nccl_unique_id", "sg_comm_create_nccl", "sg_set_stream",
    "sg_save", "sg_load", "sg_export", "sg_import", "sg_get_step", "sg_get_lr",
    "sg_trace_start", "sg_trace_stop", "sg_trace_mark", "sg_trace_events", "sg_trace_write",
    "sg_param_wait", "sg_set_param_group", "sg_set_group", "sg_get_group", "sg_comm_split",
    "sg_comm_stats", "sg_comm_split_nodes", "sg_get_hparams", "sg_set_hparams", "sg_grad_norm",
    "sg_comm_create_xport", "sg_xport_done",
    "sg_engine_create_hybrid", "sg_set_microbatches", "sg_grad_scale", "sg_get_param_step",
    "sg_load_options_init", "sg_load_ex", "sg_last_step_info",
})


class LibraryNotFoundError(ImportError):
    """libshardgrad could not be loaded; .tried lists (path, reason) for every attempt."""

    def __init__(self, tried):
        self.tried = list(tried)
        lines = ["cannot load libshardgrad; tried:"]
        lines += ["  %s: %s" % (p, why) for p, why in self.tried]
        lines.append("install the package with its library (pip install ./python), or build it "
                     "(cmake -S . -B build && cmake --build build) and set "
                     "SHARDGRAD_LIBRARY=/path/to/libshardgrad.so")
        super().__init__("\n".join(lines))


def _lib_filenames():
    if sys.platform == "darwin":
        return ["libshardgrad.dylib"]
    if sys.platform.startswith("win"):
        return ["shardgrad.dll", "libshardgrad.dll"]
    return ["libshardgrad.so", "libshardgrad.so.0"]


def _checkout_root(here):
    """The source checkout this package lies in (<root>/python/shardgrad), or None."""
    root = os.path.dirname(os.path.dirname(here))
    try:
        with open(os.path.join(root, "CMakeLists.txt"), encoding="utf-8") as f:
            head = f.read(4096)
    except OSError:
        return None
    return root if "project(shardgrad" in head and os.path.basename(os.path.dirname(here)) == \
        "python" else None


def _candidates():
    """(path, where) in search order."""
    out = []
    env = os.environ.get("SHARDGRAD_LIBRARY")
    if env:
        if os.path.isdir(env):
            out += [(os.path.join(env, n), "SHARDGRAD_LIBRARY") for n in _lib_filenames()]
        else:
            out.append((env, "SHARDGRAD_LIBRARY"))
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (here, os.path.join(here, "lib")):
        out += [(os.path.join(d, n), "next to the package") for n in _lib_filenames()]
    checkout = _checkout_root(here)
    if checkout:
        out += [(os.path.join(checkout, "build", n), "source checkout's build/")
                for n in _lib_filenames()]
    found = ctypes.util.find_library("shardgrad")
    if found:
        out.append((found, "ctypes.util.find_library"))
    out += [(n, "system search path") for n in _lib_filenames()]
    return out


# Open MPI loads its components with dlopen and they need libmpi's symbols in the global
# namespace, so the library (and libmpi with it) is loaded RTLD_GLOBAL.
_MODE = getattr(os, "RTLD_GLOBAL", 0) | getattr(os, "RTLD_NOW", 0)

_lock = threading.Lock()
_lib = None
_path = None


def _declare(lib):
    for name, (restype, argtypes) in PROTOTYPES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            if name in OPTIONAL:
                continue
            raise OSError("libshardgrad at %s does not export %s: it is older than this binding"
                          % (_path, name))
        fn.restype = restype
        fn.argtypes = argtypes


def _open(path):
    is_file_path = os.sep in path
    if is_file_path and not os.path.exists(path):
        raise OSError("no such file")
    return ctypes.CDLL(path, mode=_MODE)


def load():
    """The loaded library (ctypes.CDLL), loading it on first use."""
    global _lib, _path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path, where in _candidates():
            try:
                lib = _open(path)
            except OSError as ex:
                tried.append(("%s (%s)" % (path, where), str(ex) or type(ex).__name__))
                continue
            if not hasattr(lib, "sg_version"):
                tried.append(("%s (%s)" % (path, where), "loaded, but it has no sg_version"))
                continue
            _path = path
            _declare(lib)
            _lib = lib
            return _lib
        raise LibraryNotFoundError(tried)


def library_path():
    """Path (or name) the library was loaded from."""
    load()
    return _path


def has(name):
    """True when the loaded library exports C function `name`."""
    return hasattr(load(), name)
