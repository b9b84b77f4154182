"""ctypes mirrors of the structs and enums of include/shardgrad.h.

Field order and types follow the header exactly; the tests compare sizes and offsets with a C
program compiled against the header. C enums are int-sized (all values fit in an int).
"""

import ctypes
import enum

__all__ = ["Status", "DType", "Device", "Strategy", "TraceKind", "PARAM_NO_DECAY",
           "MAX_GROUPS", "SgConfig",
           "SgStepInfo", "SgMemoryStats", "SgTraceEvent", "SgHparams", "SgXport",
           "XPORT_SEND", "XPORT_RECV", "XPORT_CANCEL", "XPORT_RELEASE"]


class Status(enum.IntEnum):
    OK = 0
    ERR_INVALID_ARGUMENT = 1
    ERR_INVALID_STATE = 2
    ERR_OUT_OF_MEMORY = 3
    ERR_UNSUPPORTED = 4
    ERR_MISMATCH = 5
    ERR_COMM = 6
    ERR_TIMEOUT = 7
    ERR_IO = 8
    ERR_CORRUPT = 9
    ERR_CUDA = 10
    ERR_INTERNAL = 11


class DType(enum.IntEnum):
    AUTO = -1  # config only: grad_dtype = param_dtype, reduce_dtype = grad_dtype
    F32 = 0
    BF16 = 1
    F16 = 2
    Q8 = 3  # optim_state_dtype only: blockwise 8-bit optimizer state


class Device(enum.IntEnum):
    CPU = 0
    CUDA = 1


class Strategy(enum.IntEnum):
    NO_SHARD = 0
    SHARD_OPT = 1
    SHARD_GRAD_OP = 2


class Codec(enum.IntEnum):
    NONE = 0
    INT8 = 1
    INT4 = 2


class TraceKind(enum.IntEnum):
    GRAD_READY = 0  # instant on the caller's queue: a gradient became ready (id = parameter)
    REDUCE = 1      # span on the comm queue: one bucket's reduction (id = bucket index)
    STEP = 2        # span on the caller's queue: gradient norm and AdamW on the shard
    GATHER = 3      # span on the comm queue: one bucket's all-gather after the step (id = bucket)
    MARK = 4        # instant on the caller's queue: Engine.trace_mark(label)
    WAIT = 5        # span on the caller's queue: it waited for all-gathers (Engine.param_wait,
                    # or the end of step() without overlap_param_gather); id = the last bucket
                    # waited for. Its length is all-gather time that was not hidden.


PARAM_NO_DECAY = 1
MAX_GROUPS = 16  # SG_MAX_GROUPS: parameter groups 0..15


class SgConfig(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("strategy", ctypes.c_int),
        ("device", ctypes.c_int),
        ("cuda_device", ctypes.c_int),
        ("param_dtype", ctypes.c_int),
        ("grad_dtype", ctypes.c_int),
        ("reduce_dtype", ctypes.c_int),
        ("accum_dtype", ctypes.c_int),
        ("bucket_bytes", ctypes.c_size_t),
        ("staging_buckets", ctypes.c_int),
        ("lr", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("max_grad_norm", ctypes.c_float),
        ("grad_average", ctypes.c_int),
        ("loss_scale", ctypes.c_float),
        ("init_loss_scale", ctypes.c_float),
        ("scale_window", ctypes.c_int),
        ("min_loss_scale", ctypes.c_float),
        ("skip_nonfinite", ctypes.c_int),
        ("stochastic_rounding", ctypes.c_int),
        ("seed", ctypes.c_uint64),
        ("timeout_ms", ctypes.c_int),
        # appended in 0.2, in what was the tail padding after timeout_ms
        ("overlap_param_gather", ctypes.c_int),
        # 0; ends the 0.2 block on 8 bytes so that 0.2's sizeof differs from 0.1's. Each later
        # block ends on 8 bytes too (include/shardgrad.h, "Appending").
        ("reserved_0_2", ctypes.c_uint64),
        # --- 0.3 ---
        ("offload_optimizer", ctypes.c_int),
        ("replica_reduce_dtype", ctypes.c_int),
        ("shard_ranks", ctypes.c_int),
        ("reserved_0_3", ctypes.c_int),
        # --- 0.4 ---
        ("replica_codec", ctypes.c_int),
        ("outer_every", ctypes.c_int),
        ("outer_lr", ctypes.c_double),
        ("outer_momentum", ctypes.c_double),
        ("optim_state_dtype", ctypes.c_int),
        ("optim_state_min_numel", ctypes.c_int),
        # written by sg_config_init, never by hand: a config of this layout whose magic is not
        # the library's was never initialised and every call refuses it (Config always starts
        # from sg_config_init, and copy() copies the whole struct)
        ("magic", ctypes.c_uint64),
        # --- 0.5 ---
        ("outer_streaming", ctypes.c_int),
        ("reserved_0_5", ctypes.c_int),
    ]


class SgStepInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("step", ctypes.c_uint64),
        ("grad_norm", ctypes.c_float),
        ("clip_coef", ctypes.c_float),
        ("loss_scale", ctypes.c_float),
        ("skipped", ctypes.c_int),
    ]


class SgMemoryStats(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t)] + [
        (n, ctypes.c_size_t) for n in (
            "params_bytes", "grads_bytes", "master_bytes", "optim_bytes", "comm_bytes",
            "total_bytes", "peak_bytes", "numel", "shard_numel", "host_bytes")
    ]


class SgCommTraffic(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("bytes_sent", ctypes.c_uint64),
        ("bytes_received", ctypes.c_uint64),
        ("collectives", ctypes.c_uint64),
    ]


class SgTraceEvent(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("id", ctypes.c_int32),
        ("step", ctypes.c_uint64),
        ("start_us", ctypes.c_double),
        ("end_us", ctypes.c_double),
        ("label", ctypes.c_char * 48),
    ]


class SgHparams(ctypes.Structure):
    """sg_hparams: exact (double) AdamW hyperparameters (sg_get_hparams / sg_set_hparams)."""
    _fields_ = [("struct_size", ctypes.c_size_t)] + [
        (n, ctypes.c_double) for n in ("lr", "weight_decay", "beta1", "beta2", "eps",
                                       "max_grad_norm")]


# sg_xport's callbacks (a communicator over the caller's point-to-point transport)
XPORT_SEND = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                              ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_size_t)
XPORT_RECV = XPORT_SEND
XPORT_CANCEL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
XPORT_RELEASE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class SgXport(ctypes.Structure):
    """sg_xport: the transport of sg_comm_create_xport."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("name", ctypes.c_char_p),
                ("user", ctypes.c_void_p), ("threaded", ctypes.c_int),
                ("isend", XPORT_SEND), ("irecv", XPORT_RECV), ("cancel", XPORT_CANCEL),
                ("release", XPORT_RELEASE)]


class SgLoadOptions(ctypes.Structure):
    """sg_load_options (sg_load_ex): filled by sg_load_options_init."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("convert_optim_state", ctypes.c_int),
        ("reserved", ctypes.c_int),
    ]


# the step-time model (sg_hardware, sg_step_estimate; docs/planner.md)
LEVELS = 2  # SG_LEVEL_NODE, SG_LEVEL_NET
ALGO_HOST, ALGO_RING = 0, 1


class SgHardware(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("ranks_per_node", ctypes.c_int),
        ("algorithm", ctypes.c_int),
        ("link_bytes_per_s", ctypes.c_double * LEVELS),
        ("link_latency_s", ctypes.c_double * LEVELS),
        ("compute_s", ctypes.c_double),
        ("backward_fraction", ctypes.c_double),
        ("optim_params_per_s", ctypes.c_double),
        ("device_bytes_per_s", ctypes.c_double),
        ("host_optim_params_per_s", ctypes.c_double),
        ("pcie_bytes_per_s", ctypes.c_double),
        ("overlap", ctypes.c_double * LEVELS),
        ("handover_s_per_byte", ctypes.c_double),
        ("replica_bytes_per_s", ctypes.c_double),
        ("magic", ctypes.c_uint64),  # written by sg_hardware_init, never by hand
    ]


class SgStepEstimate(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("step_s", ctypes.c_double),
        ("compute_s", ctypes.c_double),
        ("exposed_s", ctypes.c_double * LEVELS),
        ("comm_s", ctypes.c_double * LEVELS),
        ("optim_s", ctypes.c_double),
        ("copy_s", ctypes.c_double),
        ("handover_s", ctypes.c_double),
        ("shard_bytes", ctypes.c_uint64),
        ("shard_collectives", ctypes.c_uint64),
        ("replica_bytes", ctypes.c_uint64),
        ("replica_collectives", ctypes.c_uint64),
        ("link_bytes", ctypes.c_uint64 * LEVELS),
        ("optim_bytes", ctypes.c_uint64),
        ("copy_bytes", ctypes.c_uint64),
    ]
