"""Config: the sg_config struct with keyword arguments, filled by sg_config_init."""

import ctypes
import math

from . import _lib
from ._structs import Codec, DType, Device, SgConfig, SgMemoryStats, Strategy
from .errors import ShardgradError, UnsupportedError, check

__all__ = ["Config", "to_dtype", "to_strategy", "to_device"]

_DTYPE_NAMES = {
    "f32": DType.F32, "fp32": DType.F32, "float32": DType.F32, "float": DType.F32,
    "bf16": DType.BF16, "bfloat16": DType.BF16,
    "f16": DType.F16, "fp16": DType.F16, "float16": DType.F16, "half": DType.F16,
    "auto": DType.AUTO,
    "q8": DType.Q8, "int8": DType.Q8, "8bit": DType.Q8,  # optim_state_dtype only
}
_STRATEGY_NAMES = {
    "no_shard": Strategy.NO_SHARD, "ddp": Strategy.NO_SHARD,
    "shard_opt": Strategy.SHARD_OPT, "zero1": Strategy.SHARD_OPT,
    "shard_grad_op": Strategy.SHARD_GRAD_OP, "zero2": Strategy.SHARD_GRAD_OP,
}
_DEVICE_NAMES = {"cpu": Device.CPU, "cuda": Device.CUDA, "gpu": Device.CUDA}
_CODEC_NAMES = {"none": Codec.NONE, "int8": Codec.INT8, "int4": Codec.INT4}


def _enum(value, enum_cls, names, what):
    if isinstance(value, bool):
        raise TypeError("%s: expected %s or one of %s, got a bool" % (what, enum_cls.__name__,
                                                                      sorted(names)))
    if isinstance(value, int):
        try:
            return enum_cls(value)
        except ValueError:
            raise ValueError("%s: %d is not a valid %s (%s)" % (
                what, value, enum_cls.__name__, ", ".join("%s=%d" % (m.name, m) for m in enum_cls)))
    if isinstance(value, str):
        key = value.strip().lower()
        if key.startswith("sg_"):
            key = key[3:]
        if key in names:
            return names[key]
        for m in enum_cls:
            if m.name.lower() == key:
                return m
        raise ValueError("%s: unknown %s %r (one of %s)" % (what, enum_cls.__name__, value,
                                                            ", ".join(sorted(names))))
    # torch.dtype ("torch.bfloat16") or anything numpy understands as a dtype
    name = str(value).replace("torch.", "")
    if name not in names:
        try:
            import numpy
            name = numpy.dtype(value).name
        except Exception:
            pass
    if name in names:
        return names[name]
    raise TypeError("%s: cannot convert %r to %s" % (what, value, enum_cls.__name__))


def to_dtype(value, what="dtype"):
    """DType from a DType, int, name ('bf16', 'float32', ...), torch.dtype or numpy dtype."""
    return _enum(value, DType, _DTYPE_NAMES, what)


def to_strategy(value, what="strategy"):
    return _enum(value, Strategy, _STRATEGY_NAMES, what)


def to_device(value, what="device"):
    return _enum(value, Device, _DEVICE_NAMES, what)


def to_codec(value, what="replica_codec"):
    return _enum(value, Codec, _CODEC_NAMES, what)


_ENUM_FIELDS = {
    "strategy": to_strategy, "device": to_device, "param_dtype": to_dtype, "grad_dtype": to_dtype,
    "reduce_dtype": to_dtype, "accum_dtype": to_dtype, "replica_reduce_dtype": to_dtype,
    "replica_codec": to_codec,
    "optim_state_dtype": to_dtype,
}
_INT_TYPES = {ctypes.c_int: (-2**31, 2**31 - 1), ctypes.c_size_t: (0, 2**64 - 1),
              ctypes.c_uint64: (0, 2**64 - 1)}
FIELDS = tuple(name for name, _ in SgConfig._fields_
               if name not in ("struct_size", "magic") and not name.startswith("reserved"))
_FIELD_TYPES = dict(SgConfig._fields_)
_BOOL_FIELDS = ("grad_average", "skip_nonfinite", "stochastic_rounding", "overlap_param_gather",
                "outer_streaming",
                "offload_optimizer")
# Fields appended after 0.1, with the C function that tells whether the loaded library knows
# them. An older library takes an older struct_size (_SIZES) and would ignore the value, so a
# non-default value is refused there instead.
_NEWER_FIELDS = {"overlap_param_gather": "sg_param_wait"}
# Published sizes of sg_config, newest first (include/shardgrad.h, "Appending"): 0.2's, then
# 0.1's (0.1 ended at timeout_ms plus tail padding, where 0.2's overlap_param_gather went).
# 0.3 appended a block after reserved_0_2, so its fields lie past 0.2's struct_size; 0.4 one
# after reserved_0_3 (replica_codec .. optim_state_min_numel, then the magic that
# sg_config_init writes, which the older layouts do not have); 0.5 one after the magic
# (outer_streaming, reserved_0_5).
_SIZES = (ctypes.sizeof(SgConfig), SgConfig.outer_streaming.offset, SgConfig.replica_codec.offset, SgConfig.offload_optimizer.offset,
          SgConfig.reserved_0_2.offset)


class Config:
    """Engine configuration: every sg_config field as a keyword argument or attribute.

    Defaults come from sg_config_init (the C library), so they never drift from the header;
    grad_dtype and reduce_dtype default to DType.AUTO (= param_dtype, resolved by the library;
    see effective_grad_dtype).
    Unknown names raise TypeError, wrong types TypeError, bad enum names ValueError; ranges are
    checked by the library itself (validate(), also run by the constructor), raising
    InvalidArgumentError with the library's message.

        cfg = Config(strategy="shard_grad_op", param_dtype="bf16", lr=3e-4, max_grad_norm=1.0)

    overlap_param_gather=1 (or True) lets step() return with the per-bucket all-gathers still
    running; call Engine.param_wait(pid) before reading a parameter (ShardedAdamW does it in
    forward pre-hooks). 0/False, the default: step() returns with every parameter gathered.
    """

    __slots__ = ("_c",)

    def __init__(self, validate=True, **kwargs):
        lib = _lib.load()
        c = SgConfig()
        # the newest layout the loaded library knows (an older one rejects larger sizes)
        for size in _SIZES[:-1]:
            if lib.sg_config_init(ctypes.byref(c), size) == 0:
                break
        else:
            check(lib, lib.sg_config_init(ctypes.byref(c), _SIZES[-1]), "sg_config_init")
        object.__setattr__(self, "_c", c)
        unknown = sorted(set(kwargs) - set(FIELDS))
        if unknown:
            raise TypeError("Config: unknown field(s) %s; fields are: %s"
                            % (", ".join(unknown), ", ".join(FIELDS)))
        for k, v in kwargs.items():
            setattr(self, k, v)
        if validate:
            self.validate()

    # -- field access ---------------------------------------------------------------------
    def __getattr__(self, name):
        if name in _FIELD_TYPES:
            v = getattr(object.__getattribute__(self, "_c"), name)
            if name in _ENUM_FIELDS:
                return _ENUM_FIELDS[name](v, name)
            return v
        raise AttributeError("Config has no field %r" % name)

    def __setattr__(self, name, value):
        if name not in FIELDS:
            raise TypeError("Config: unknown field %r; fields are: %s" % (name, ", ".join(FIELDS)))
        v = self._convert(name, value)
        fn = _NEWER_FIELDS.get(name)
        too_new = (fn is not None and not _lib.has(fn)) or \
            getattr(SgConfig, name).offset >= self._c.struct_size
        if too_new and v != getattr(self._c, name):
            raise UnsupportedError("Config.%s: the loaded library (%s) predates this field"
                                   % (name, _lib.library_path()), function="python")
        setattr(self._c, name, v)

    @staticmethod
    def _convert(name, value):
        if name in _ENUM_FIELDS:
            return int(_ENUM_FIELDS[name](value, name))
        ctype = _FIELD_TYPES[name]
        if ctype in (ctypes.c_float, ctypes.c_double):
            if isinstance(value, (bool, str, bytes)) or not hasattr(value, "__float__"):
                raise TypeError("Config.%s: expected a number, got %r" % (name, value))
            f = float(value)
            if math.isnan(f):
                raise ValueError("Config.%s: NaN" % name)
            return f
        # integer fields
        if name in _BOOL_FIELDS and isinstance(value, bool):
            return int(value)
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise TypeError("Config.%s: expected an int, got %r" % (name, value))
        v = value.__index__()
        lo, hi = _INT_TYPES[ctype]
        if not lo <= v <= hi:
            raise ValueError("Config.%s: %d outside [%d, %d]" % (name, v, lo, hi))
        return v

    @property
    def effective_grad_dtype(self):
        """grad_dtype with AUTO resolved (= param_dtype): the dtype of gradient slots."""
        g = self.grad_dtype
        return self.param_dtype if g == DType.AUTO else g

    # -- whole-struct helpers -------------------------------------------------------------
    def validate(self):
        """Has the library check every field (through sg_estimate_memory on a tiny model);
        raises InvalidArgumentError with the library's text. Returns self."""
        lib = _lib.load()
        numels = (ctypes.c_size_t * 1)(64)
        st = SgMemoryStats(struct_size=ctypes.sizeof(SgMemoryStats))
        try:
            check(lib, lib.sg_estimate_memory(ctypes.byref(self._c), numels, 1, 1,
                                              ctypes.byref(st)), "sg_estimate_memory")
        except ShardgradError as ex:
            msg = ex.message.replace("sg_estimate_memory:", "Config:", 1)
            raise type(ex)(msg, ex.status, "Config.validate") from None
        return self

    def copy(self, **changes):
        out = Config(validate=False)
        ctypes.memmove(ctypes.byref(out._c), ctypes.byref(self._c), ctypes.sizeof(SgConfig))
        for k, v in changes.items():
            setattr(out, k, v)
        return out

    def as_dict(self):
        return {k: getattr(self, k) for k in FIELDS}

    @property
    def struct(self):
        """The underlying ctypes SgConfig (pass ctypes.byref(cfg.struct) to C)."""
        return self._c

    def __eq__(self, other):
        return isinstance(other, Config) and self.as_dict() == other.as_dict()

    def __repr__(self):
        parts = []
        for k, v in self.as_dict().items():
            parts.append("%s=%s" % (k, v.name if hasattr(v, "name") and hasattr(v, "value")
                                    else repr(v)))
        return "Config(%s)" % ", ".join(parts)
