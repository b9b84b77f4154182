"""ShardedAdamW: a torch.optim.Optimizer backed by a shardgrad Engine (the package text,
shardgrad.torch, says what it does)."""

import contextlib
import functools
import json
import os
import tempfile
import uuid
import weakref

import numpy as np
import torch

from .. import _lib
from .._structs import DType, Device
from ..config import Config
from ..core import Comm, Engine
from ..errors import (InvalidArgumentError, InvalidStateError, MismatchError, ShardgradError,
                      UnsupportedError)
from .clip import check_unowned, register_params, unregister_params
from .comm import _dist_initialized
from .dtypes import TO_SG, sg_dtype, torch_dtype
from .grads import GradState, ShardGrad
from .groups import check_one_dtype, check_shared_hparams, select_params
from .hooks import add_grad_hooks, add_order_hooks, add_wait_hooks
from .views import param_tensor

__all__ = ["ShardedAdamW", "default_bucket_bytes", "MIN_BUCKET_BYTES", "MAX_BUCKET_BYTES"]


# ------------------------------------------------------------------------------------------
# the optimizer


MIN_BUCKET_BYTES = 64 << 10
MAX_BUCKET_BYTES = 32 << 20


def default_bucket_bytes(grad_bytes):
    """The bucket size ShardedAdamW picks for a model of grad_bytes gradient bytes: 1/8 of it,
    rounded up to 64 KiB, within 64 KiB..32 MiB (32 MiB, the library's default, from 256 MiB
    of gradients on). Eight buckets: the 2 staging buckets of SHARD_GRAD_OP then hold a quarter
    of the gradient (not all of it, as one bucket would, which is SHARD_OPT's cost), and the
    first bucket's reduction starts after an eighth of the backward pass. A parameter larger
    than a bucket gets a bucket of its own, so a model whose largest parameter exceeds half
    the gradient still stages it whole."""
    b = -(-int(grad_bytes) // 8)
    b = -(-b // MIN_BUCKET_BYTES) * MIN_BUCKET_BYTES
    return max(MIN_BUCKET_BYTES, min(MAX_BUCKET_BYTES, b))


def _f32_short(x):
    """The shortest decimal that rounds to the same float32 (0.1 rather than 0.10000000149)."""
    return float(str(np.float32(x)))


def _check_args(comm, replica_comm, param_order, no_decay):
    if not isinstance(comm, Comm):
        raise TypeError("ShardedAdamW: comm must be a shardgrad.Comm, got %r" % (comm,))
    if replica_comm is not None and not isinstance(replica_comm, Comm):
        raise TypeError("ShardedAdamW: replica_comm must be a shardgrad.Comm or None, got %r"
                        % (replica_comm,))
    if param_order not in ("backward", "registration"):
        raise ValueError("ShardedAdamW: param_order must be 'backward' or 'registration' "
                         "(got %r)" % (param_order,))
    if isinstance(no_decay, str) and no_decay != "1d":
        raise ValueError("ShardedAdamW: no_decay must be None, \"1d\", a set of names or a "
                         "callable (got %r)" % (no_decay,))


def _hparam_defaults(config, lr, betas, eps, weight_decay):
    """torch's defaults dict: the values given, the unset ones from `config`, else from the
    library's defaults (which are torch.optim.AdamW's: 1e-3, (0.9, 0.999), 1e-8, 0.01)."""
    src = config if config is not None else Config(validate=False)
    return dict(lr=_f32_short(src.lr) if lr is None else float(lr),
                betas=((_f32_short(src.beta1), _f32_short(src.beta2)) if betas is None
                       else tuple(float(b) for b in betas)),
                eps=_f32_short(src.eps) if eps is None else float(eps),
                weight_decay=(_f32_short(src.weight_decay) if weight_decay is None
                              else float(weight_decay)))


def _make_config(config, kwargs, named, defaults, model):
    """The engine's Config: `config` (or the defaults) with the keyword fields and the
    hyperparameters; without `config`, the fields the keywords leave out that the parameters
    decide (_fields_from_params)."""
    check_one_dtype(named)
    dev = _one_device(named)
    kw = dict(kwargs)
    kw.update(lr=defaults["lr"], beta1=defaults["betas"][0], beta2=defaults["betas"][1],
              eps=defaults["eps"], weight_decay=defaults["weight_decay"])
    if config is not None:
        cfg = config.copy(**kw).validate()
    else:
        cfg = Config(**{**_fields_from_params(named, dev, kwargs), **kw})
    if cfg.overlap_param_gather and not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError("ShardedAdamW: overlap_param_gather needs an nn.Module "
                                   "(forward pre-hooks on its modules wait for the "
                                   "parameters)", function="python")
    return cfg


def _one_device(named):
    devices = {p.device for _, p in named}
    if len(devices) != 1:
        raise InvalidArgumentError("ShardedAdamW: parameters on several devices %s"
                                   % sorted(map(str, devices)), function="python")
    return devices.pop()


def _fields_from_params(named, dev, kwargs):
    """Config fields that follow the parameters when no config is given: their dtype, a bucket
    size for their gradient bytes (default_bucket_bytes) and, unless `device` is given, their
    CUDA device."""
    p0 = named[0][1]
    out = {"param_dtype": sg_dtype(p0.dtype),
           "bucket_bytes": default_bucket_bytes(sum(p.numel() for _, p in named)
                                                * p0.element_size())}
    if dev.type == "cuda" and "device" not in kwargs:
        out.update(device=Device.CUDA, cuda_device=dev.index if dev.index is not None else -1)
    return out


def _keep_accelerate_off(model, engine):
    """accelerate (transformers.Trainer) would wrap the model in DistributedDataParallel (with
    any process group, even of one rank), which all-reduces .grad itself: this optimizer
    already reduces every gradient."""
    if isinstance(model, torch.nn.Module) and (engine.world_size > 1 or _dist_initialized()):
        model._is_accelerate_prepared = True


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW over shardgrad: sharded gradients, master weights and moments (ZeRO-2 by default).

    model: an nn.Module (names from named_parameters) or an iterable of parameters or
    (name, parameter) pairs; every rank must pass the same names and shapes.
    comm: a shardgrad.Comm (Comm.mpi() or one of Comm.local(n)).
    replica_comm: hybrid sharding across nodes: `comm` is then this rank's node (the shard
    communicator) and replica_comm its counterparts on the other nodes, as from
    `shard, replica = world.split_nodes(ranks_per_node)`; gradients and optimizer state are
    sharded inside the node, and only one all-reduce of the shard per step crosses nodes.
    On CUDA tensors NCCL inside and across nodes (split_nodes of an NCCL Comm) is the fast
    path; a host replica_comm (MPI) beside an NCCL comm goes through pinned host memory.
    lr, betas, eps, weight_decay: as torch.optim.AdamW; unset ones come from `config`, else
    the library defaults (1e-3, (0.9, 0.999), 1e-8, 0.01 as in torch.optim.AdamW).
    no_decay: None (every parameter decays, as in torch.optim.AdamW), "1d" (parameters with
    ndim <= 1 get no weight decay), a set of names, or a callable (name, param) -> bool that
    is True for the parameters that get none.
    broadcast: make every rank start from rank 0's values (sg_broadcast_params); default when
    the world has more than one rank.
    param_order: "registration" (finalize now, named_parameters order) or "backward"
    (finalize at the first gradient, parameters laid out in the reverse of the first forward
    pass's order); see the package text (shardgrad.torch).
    config / **config_kwargs: any other shardgrad.Config field (strategy, max_grad_norm,
    bucket_bytes, param_dtype, timeout_ms, overlap_param_gather, ...). param_dtype defaults to
    the parameters' dtype (one dtype for all of them); bucket_bytes to 1/8 of the gradient
    (see the package text). overlap_param_gather=True: the all-gathers after step() overlap the
    next forward pass, each module's forward pre-hook waiting for its own parameters (see the
    package text; call wait_params() before reading parameters outside a forward pass).
    offload_optimizer=True: on CUDA tensors the fp32 master, the moments and the gradient
    accumulator live in pinned host memory and AdamW runs on the CPU (bitwise the same results;
    memory().host_bytes counts it); on CPU tensors it changes nothing.
    optim_state_dtype="q8": AdamW's m and v in blockwise 8 bits (2 bytes per parameter instead
    of 8; docs/optim-state-8bit.md), tensors below optim_state_min_numel elements (4096) kept
    in fp32; param_state() returns them decoded. With offload_optimizer on CUDA tensors the
    blocks live in pinned host memory and the CPU updates them.
    """

    def __init__(self, model, comm, lr=None, betas=None, eps=None, weight_decay=None,
                 no_decay=None, broadcast=None, param_order="registration", config=None,
                 param_groups=None, replica_comm=None, **config_kwargs):
        _check_args(comm, replica_comm, param_order, no_decay)
        named, group_of, opts = select_params(model, param_groups)
        check_unowned(named)
        self._init_fields(named, group_of, param_order, no_decay, broadcast)
        defaults = _hparam_defaults(config, lr, betas, eps, weight_decay)
        check_shared_hparams(opts, defaults)
        self._init_groups(opts, defaults)
        cfg = _make_config(config, config_kwargs, named, defaults, model)
        self._init_engine(comm, replica_comm, cfg, config_kwargs)
        register_params(self)
        _keep_accelerate_off(model, self._engine)
        self._init_hooks(model)
        if param_order == "registration":
            self._setup(list(range(len(named))))

    # -- construction ---------------------------------------------------------------------
    def _init_fields(self, named, group_of, param_order, no_decay, broadcast):
        """What close() and __del__ need come first: a constructor that fails later still
        closes cleanly."""
        self._named = named
        self._group_of = group_of  # engine group of each entry of _named
        self._engine = None
        self._hooks = []         # per-parameter autograd hooks
        self._wait_hooks = []    # forward pre-hooks (overlap_param_gather)
        self._order_hooks = []   # forward pre-hooks recording the first forward's order
        self._closed = False
        self._param_order = param_order
        self._no_decay = no_decay
        self._broadcast = broadcast
        self._callback_queued = False
        self._handed = False     # gradients went to the library since the last step
        self._ready = False      # engine finalized, parameters adopted
        self._sync = True        # wanted sync state (no_sync may be entered before _ready)
        self._arrival = []       # indices in gradient arrival order, first backward only
        self._pid = [None] * len(named)  # index in _named -> engine parameter id
        self._unwaited = set()   # indices into _named whose all-gather may still be pending
        self._forward_seen = {}  # index into _named -> position of first use
        self._stream = None      # CUDA: the torch stream the engine works on
        self._hand_order = []    # indices into _named, in gradient arrival (= plan) order
        self._clip_once = None   # clip_grad_norm_'s max_norm for the coming step
        self._token = uuid.uuid4().hex  # state_dict() made by this optimizer ...
        self._version = 0        # ... at this state (steps and loads so far)
        self._info = None        # last_step_info, once read ...
        self._info_due = False   # ... or still in the library (read on first access)

    @property
    def last_step_info(self):
        """StepInfo of the latest step() (None before the first, and after load()). Read from
        the library on first access: a step whose result nobody reads waits for nothing on
        the host (the GPU decides clipping and skipping itself)."""
        if self._info_due:
            self._info = self._engine.last_step_info()
            self._info_due = False
        return self._info

    @last_step_info.setter
    def last_step_info(self, info):
        self._info, self._info_due = info, False

    def _init_groups(self, opts, defaults):
        """torch's param_groups, one per engine group, from the groups' own options and the
        constructor's values."""
        groups = [dict(o, params=[p for (_, p), gi in zip(self._named, self._group_of) if gi == g])
                  for g, o in enumerate(opts)]
        self._init_done = False
        super().__init__(groups, defaults)
        self._init_done = True
        self._fixed = self._group_hparams()
        self._sent = [None] * len(self.param_groups)  # (lr, wd) last given to the engine

    def _init_engine(self, comm, replica_comm, cfg, config_kwargs):
        self._engine = Engine(comm, cfg, replica_comm=replica_comm)
        # max_grad_norm as the caller's Python value (exact through sg_set_hparams)
        self._max_norm = (float(config_kwargs["max_grad_norm"]) if "max_grad_norm" in config_kwargs
                          else _f32_short(cfg.max_grad_norm))
        # CUDA engine, several ranks as threads: no library call from torch's autograd thread
        # (see the package text); the gradients wait in .grad for step().
        cuda = self._engine.config.device == Device.CUDA
        self._defer = cuda and comm.kind == "local" and self._engine.world_size > 1
        self._grads = GradState(weakref.ref(self), len(self._named))  # what p.grad stands for

    def _init_hooks(self, model):
        self._hooks = add_grad_hooks(self)
        if self._engine.overlap_param_gather:
            self._wait_hooks = add_wait_hooks(self, model)
        if (self._param_order == "backward" and isinstance(model, torch.nn.Module)
                and not self._defer):
            self._order_hooks = add_order_hooks(self, model)

    def _note_forward(self, indices):
        for i in indices:
            self._forward_seen.setdefault(i, len(self._forward_seen))

    def _wait_for(self, indices):
        """Forward pre-hook: the parameters `indices` (into _named) are gathered before the
        module reads them (CUDA: torch's current stream waits, the host does not)."""
        todo = [i for i in indices if i in self._unwaited]
        if not todo or self._closed:
            return  # nothing pending since the last step (or no step yet)
        e = self._engine
        for i in todo:
            e.param_wait(self._pid[i])
            self._unwaited.discard(i)
        self._torch_waits()

    def wait_params(self):
        """overlap_param_gather: waits for every pending all-gather, for code that reads the
        parameters outside a forward pass of their modules (the hooks cover those). A no-op
        otherwise. close(), save(), state_dict() and the like wait by themselves."""
        if self._ready and not self._closed:
            self._engine.param_wait(-1)
            self._unwaited.clear()
            self._torch_waits()

    def _decays(self, name, p):
        nd = self._no_decay
        if nd is None:
            return True
        if isinstance(nd, str):
            return p.ndim > 1
        if callable(nd):
            return not nd(name, p)
        return name not in nd

    def _setup(self, registration):
        """Collective: registers the parameters in the given order (indices into _named),
        finalizes, loads the values and re-points every parameter to library memory. The plan
        lays parameters out in reverse registration order and reduces buckets in that order."""
        e = self._engine
        try:
            for i in registration:
                name, p = self._named[i]
                self._pid[i] = e.add_param(name, tuple(p.shape),
                                           no_decay=not self._decays(name, p))
                if self._group_of[i]:
                    e.set_param_group(self._pid[i], self._group_of[i])
            try:
                e.finalize()
            except MismatchError as ex:
                if (self._param_order != "backward"
                        or "registered different parameters" not in ex.message):
                    raise  # another rank failed, or configs differ: the order is not the cause
                raise MismatchError(ex.message + " (ShardedAdamW: with param_order='backward' "
                                    "every rank must use its modules in the same order in its "
                                    "first forward pass; otherwise use "
                                    "param_order='registration')",
                                    ex.status, ex.function) from None
            for i, (_, p) in enumerate(self._named):
                e.set_param(self._pid[i], p.detach().to("cpu"))
            broadcast = self._broadcast
            if broadcast is None:
                broadcast = e.world_size > 1
            if broadcast:
                e.broadcast_params(0)
            place = contextlib.nullcontext()
            if e.config.device == Device.CUDA:
                dev = e.config.cuda_device
                cur = torch.cuda.current_stream(dev if dev >= 0 else None)
                # handle 0 (torch's default stream) would mean "an internal stream"
                self._stream = cur if cur.cuda_stream != 0 else torch.cuda.Stream(cur.device)
                e.set_stream(self._stream)
                self._torch_waits()  # for the values set and broadcast above
                # the views are made on torch's current device: make it the engine's
                place = torch.cuda.device(self._stream.device)
            with place, torch.no_grad():
                for i, (_, p) in enumerate(self._named):
                    p.data = param_tensor(e, self._pid[i])
            self._note_versions()
            if not self._sync and not self._defer:
                e.set_sync(False)
        except BaseException:
            self._closed = True
            for h in self._hooks + self._wait_hooks + self._order_hooks:
                h.remove()
            self._hooks = []
            self._wait_hooks = []
            self._order_hooks = []
            e.close()
            raise
        self._hand_order = list(registration[::-1])
        self._ready = True
        for h in self._order_hooks:
            h.remove()
        self._order_hooks = []

    def _learned_order(self):
        """Registration order (the plan reduces in its reverse): the first forward pass's
        order of first use with the parameters it did not see first; else (deferred mode)
        reverse gradient arrival with the parameters that got none first; else
        named_parameters order."""
        n = len(self._named)
        if self._forward_seen:
            seen = sorted(self._forward_seen, key=self._forward_seen.get)
            return [i for i in range(n) if i not in self._forward_seen] + seen
        if not self._arrival:
            return list(range(n))
        seen = set(self._arrival)
        order = self._arrival + [i for i in range(n) if i not in seen]
        return order[::-1]

    def _ensure_ready(self):
        """Finalizes (in the order the gradients came, if any came) when not done yet."""
        if self._closed:
            raise InvalidStateError("ShardedAdamW is closed", function="python")
        if not self._ready:
            self._setup(self._learned_order())
            self._arrival = []

    def add_param_group(self, param_group):
        if getattr(self, "_init_done", True):
            raise UnsupportedError("ShardedAdamW: parameters are fixed at construction",
                                   function="python")
        super().add_param_group(param_group)

    # -- gradients ------------------------------------------------------------------------
    def _take_grad(self, i, p):
        g = p.grad
        if g is None or self._closed or isinstance(g, ShardGrad):
            return
        if self._grads.scaled or any(f != 1.0 for f in self._grads.pending):
            raise RuntimeError("ShardedAdamW: a gradient arrived after the step's gradients "
                               "were scaled in place (p.grad.mul_, clip_grad_norm_): clip "
                               "after the last backward of the step, or call zero_grad()")
        if g.is_sparse:
            raise UnsupportedError("ShardedAdamW: sparse gradients are not supported",
                                   function="python")
        if self._defer:
            # Kept in .grad for step(); the first gradients tell the order.
            if not self._ready and i not in self._arrival:
                self._arrival.append(i)
            return
        if not self._callback_queued:
            # Completes the micro-batch once the whole backward pass has run.
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
            self._callback_queued = True
        if not self._ready:
            # First gradient: build the engine now, before any other gradient exists.
            self._setup(self._learned_order())
        self._hand_over(i, g)
        self._handed = True
        p.grad = None

    def _hand_over(self, i, g):
        if g.dtype not in TO_SG:
            g = g.float()
        if not g.is_contiguous():
            g = g.contiguous()
        if self._engine_waits():
            # g's memory must not be handed out again before the engine's stream has read it
            g.record_stream(self._stream)
        self._engine.grad_add_ptr(self._pid[i], g.data_ptr(), TO_SG[g.dtype])

    def _engine_waits(self):
        """CUDA: the engine's stream waits for the work issued so far to the current stream
        (gradients, reads of the parameters). True when the two streams differ."""
        if self._stream is None:
            return False
        cur = torch.cuda.current_stream(self._stream.device)
        if cur == self._stream:
            return False
        self._stream.wait_stream(cur)
        return True

    def _torch_waits(self):
        """CUDA: the current stream waits for the engine's work so far (parameters written)."""
        if self._stream is None:
            return
        cur = torch.cuda.current_stream(self._stream.device)
        if cur != self._stream:
            cur.wait_stream(self._stream)

    def _hand_over_deferred(self):
        """Deferred mode (CUDA, ranks as threads): the gradients accumulated in .grad since the
        last step go to the library now, on this rank's own thread, as one micro-batch."""
        self._ensure_ready()
        handed = False
        for i in self._hand_order:
            p = self._named[i][1]
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise UnsupportedError("ShardedAdamW: sparse gradients are not supported",
                                           function="python")
                self._hand_over(i, p.grad)
                p.grad = None
                handed = True
        if handed:
            self._engine.backward_end()

    def _backward_end(self):
        self._callback_queued = False
        if not self._closed:
            self._engine.backward_end()
            self._show_grads()

    def _show_grads(self):
        """Every parameter's p.grad becomes a ShardGrad of the gradients the library now holds
        (docs/torch-grads.md); those of an earlier backward go stale."""
        st = self._grads
        st.gen += 1
        st.usable = None if self._sync else (
            "inside no_sync() the micro-batches are accumulated locally, not reduced yet: "
            "the step's gradients can be read after its last backward, outside no_sync()")
        for i, (name, p) in enumerate(self._named):
            p.grad = ShardGrad(p, st, i, name)

    def _drop_grads(self):
        """The gradients the ShardGrads stood for are gone (step, zero_grad, load, close)."""
        st = getattr(self, "_grads", None)
        if st is None:  # the constructor failed before
            return
        st.gen += 1
        st.pending = [1.0] * st.n
        st.scaled = False

    def _scale_grads(self, factor):
        """Every parameter's p.grad was scaled in place by `factor`: the library's gradients
        are (sg_grad_scale; a factor of 0 drops them, as sg_grad_zero does)."""
        self._live()
        if factor == 0.0:
            if self._handed:
                if not _lib.has("sg_grad_zero"):
                    raise UnsupportedError("ShardedAdamW: this libshardgrad has no "
                                           "sg_grad_zero, so p.grad cannot be zeroed; use "
                                           "opt.zero_grad()", function="python")
                self._engine.grad_zero()
                self._clip_once = None  # it was for the gradients just dropped
            self._handed = False
            self._grads.pending = [1.0] * self._grads.n
            return
        if not _lib.has("sg_grad_scale"):
            raise UnsupportedError("ShardedAdamW: this libshardgrad has no sg_grad_scale, so "
                                   "p.grad cannot be scaled; use opt.clip_grad_norm_(max_norm)",
                                   function="python")
        self._engine.grad_scale(factor)
        self._grads.scaled = True

    def grad_norm(self):
        """Collective, after the last backward of a step and before step(): the global L2 norm
        of the reduced gradient (after any in-place scaling of p.grad, before the step's own
        clipping), as a float; NaN or inf when it is not finite."""
        self._live()
        if self._defer:
            self._hand_over_deferred()
        self._ensure_ready()
        if not _lib.has("sg_grad_norm"):
            raise UnsupportedError("ShardedAdamW.grad_norm: this libshardgrad has no "
                                   "sg_grad_norm", function="python")
        self._engine_waits()
        return self._engine.grad_norm()

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches inside accumulate locally, without communication; the first backward
        after the block (with sync on) reduces everything. Enter and leave between
        micro-batches, on every rank alike."""
        if self._ready and not self._defer:  # deferred: torch accumulates in .grad
            self._live().set_sync(False)
        self._sync = False  # an engine built inside the block starts without sync
        try:
            yield
        finally:
            self._sync = True
            if self._ready and not self._defer and not self._closed:
                self._engine.set_sync(True)

    def zero_grad(self, set_to_none=True):
        """Drops the gradients since the last step, as torch's zero_grad does: any .grad left on
        the parameters, and those already handed to the library (Engine.grad_zero: a micro-batch
        cut short by an exception in backward is completed and thrown away with the rest), so a
        loop can catch the exception, call zero_grad() and carry on. Collective when gradients
        were handed over since the last step: then every rank calls it at the same point."""
        if self._handed and self._ready and not self._closed and _lib.has("sg_grad_zero"):
            self._engine.grad_zero()
            self._clip_once = None  # it was for the gradients just dropped
        self._drop_grads()
        self._handed = False
        # a backward that raised never ran its queued _backward_end
        self._callback_queued = False
        for _, p in self._named:
            p.grad = None

    def _note_versions(self):
        """torch's version counter of every parameter now that the library wrote it: the
        library's own writes (steps, loads) do not count, torch's in-place writes do."""
        self._pver = [p._version for _, p in self._named]

    def _sync_written(self):
        """bf16/f16 parameters written in place by torch since the library last wrote them
        (model.load_state_dict, p.copy_, p.fill_, clamping under no_grad: anything that bumps
        p._version) would be put back from the fp32 master at the next step: their written
        values become the master (sg_set_param, this rank's fragments). f32 parameters are
        their own master. Writes through p.data (a tensor with a version counter of its own)
        are not seen: call opt.params_written() after them."""
        e = self._engine
        if e is None or not self._ready or e.param_dtype == DType.F32:
            return
        for i, (_, p) in enumerate(self._named):
            if p._version != self._pver[i]:
                self._set_from_torch(i)

    def _set_from_torch(self, i):
        p = self._named[i][1]
        self._engine_waits()
        self._engine.set_param(self._pid[i], p.detach().to("cpu", copy=True))
        self._pver[i] = p._version

    def params_written(self):
        """After writing parameters in a way their version counter does not show (p.data.copy_,
        writes through a NumPy view): every parameter's current value becomes its master
        weight (sg_set_param; give every rank the same values). Writes through the parameter
        itself (load_state_dict, p.copy_ under no_grad) are noticed without it."""
        self._ensure_ready()
        for i in range(len(self._named)):
            self._set_from_torch(i)

    def _readopt(self):
        """Parameters whose storage was replaced since they were re-pointed to the library (a
        model.to("cpu:0"), as transformers.Trainer does, copies them; so does load_state_dict
        with assign=True) would no longer see the step's updates: their current values go to
        the library and they view its memory again."""
        e = self._engine
        for i, (name, p) in enumerate(self._named):
            if p.data_ptr() == e.param_ptr(self._pid[i]):
                continue
            if p.dtype != torch_dtype(e.param_dtype):
                raise InvalidStateError("ShardedAdamW: parameter '%s' became %s (the library "
                                        "holds %s); change dtypes before building the optimizer"
                                        % (name, p.dtype, torch_dtype(e.param_dtype)),
                                        function="python")
            self._engine_waits()
            e.set_param(self._pid[i], p.detach().to("cpu"))
            with torch.no_grad():
                p.data = param_tensor(e, self._pid[i])
            self._pver[i] = p._version

    # -- step -----------------------------------------------------------------------------
    def _group_hparams(self):
        groups = self.param_groups
        if not _lib.has("sg_set_group"):  # weight decay fixed too
            return [(tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in groups]
        return [(tuple(g["betas"]), g["eps"]) for g in groups]

    def _apply_hparams(self):
        """Gives the engine each group's lr and weight decay where they changed: exactly, as the
        Python floats they are, with betas, eps and the step's max_grad_norm (sg_set_hparams),
        so that the step's scalars are formed as torch.optim.AdamW forms them."""
        e = self._engine
        if _lib.has("sg_set_hparams"):
            max_norm = self._max_norm if self._clip_once is None else self._clip_once
            for g, grp in enumerate(self.param_groups):
                b1, b2 = (float(b) for b in grp["betas"])
                v = (float(grp["lr"]), float(grp["weight_decay"]), b1, b2, float(grp["eps"]),
                     max_norm)
                if v != self._sent[g]:
                    e.set_hparams(g, lr=v[0], weight_decay=v[1], beta1=b1, beta2=b2, eps=v[4],
                                  max_grad_norm=max_norm)
                    self._sent[g] = v
            return
        for g, grp in enumerate(self.param_groups):
            v = (float(grp["lr"]), float(grp["weight_decay"]))
            if v == self._sent[g]:
                continue
            if _lib.has("sg_set_group"):
                e.set_group(g, v[0], v[1])
            elif v[0] != e.lr:
                e.set_lr(v[0])
            self._sent[g] = v

    @torch.no_grad()
    def step(self, closure=None):
        """Collective: reduction, clipping, AdamW on this rank's shard, all-gather of the
        updated parameters. Returns the closure's loss (if any); step info in last_step_info."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if len(self.param_groups) != len(self._sent):
            raise UnsupportedError("ShardedAdamW: parameter groups are fixed at construction",
                                   function="python")
        if self._group_hparams() != self._fixed:
            raise UnsupportedError("ShardedAdamW: only 'lr' and 'weight_decay' may change after "
                                   "construction (betas and eps are fixed)", function="python")
        if self._defer:
            self._hand_over_deferred()
        self._ensure_ready()
        self._readopt()
        self._sync_written()
        self._apply_hparams()
        self._grads.check_uniform("step()")
        self._engine_waits()  # the backward pass still reads the parameters AdamW overwrites
        if _lib.has("sg_last_step_info"):  # its info read when wanted (last_step_info)
            self._engine.step(info=False)
            self._info, self._info_due = None, True
        else:
            self.last_step_info = self._engine.step()
        self._drop_grads()
        self._handed = False
        self._callback_queued = False  # the step completed any micro-batch left open
        self._version += 1
        self._clip_once = None
        if self._wait_hooks:  # overlap_param_gather: the gathers run on; the hooks wait
            self._unwaited = set(range(len(self._named)))
        self._torch_waits()
        return loss

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        """Collective, after the last backward of a step and before step(): torch's
        clip_grad_norm_ for the gradients the library holds. Returns the global L2 norm of the
        reduced gradient before clipping (a 0-d float32 tensor, as torch does), and makes the
        coming step() clip to max_norm (coefficient min(1, max_norm / (norm + 1e-6)), torch's);
        max_norm = inf only reads the norm (the step then clips by the constructor's
        max_grad_norm, if any). torch.nn.utils.clip_grad_norm_ on this optimizer's parameters
        comes here. Only the L2 norm (norm_type 2)."""
        if float(norm_type) != 2.0:
            raise UnsupportedError("ShardedAdamW.clip_grad_norm_: only norm_type=2 (got %r)"
                                   % (norm_type,), function="python")
        max_norm = float(max_norm)
        if not max_norm >= 0.0:
            raise InvalidArgumentError("ShardedAdamW.clip_grad_norm_: max_norm must be >= 0 "
                                       "(got %r)" % (max_norm,), function="python")
        if not _lib.has("sg_grad_norm"):
            raise UnsupportedError("ShardedAdamW.clip_grad_norm_: this libshardgrad has no "
                                   "sg_grad_norm; pass max_grad_norm= to ShardedAdamW instead",
                                   function="python")
        self._live()
        if self._defer:
            self._hand_over_deferred()
        self._ensure_ready()
        self._grads.check_uniform("clip_grad_norm_")
        if max_norm != float("inf"):
            self._clip_once = max_norm
        self._apply_hparams()
        norm = self.grad_norm()
        if error_if_nonfinite and not np.isfinite(norm):
            raise RuntimeError("The total norm of order 2.0 for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and "
                               "scale the gradients by the non-finite norm anyway, set "
                               "`error_if_nonfinite=False`")
        return torch.tensor(norm, dtype=torch.float32)

    # -- state ----------------------------------------------------------------------------
    @property
    def engine(self):
        return self._engine

    @property
    def lr(self):
        return float(self.param_groups[0]["lr"])

    @lr.setter
    def lr(self, value):
        for g in self.param_groups:
            g["lr"] = float(value)

    def _live(self):
        if self._closed:
            raise InvalidStateError("ShardedAdamW is closed", function="python")
        return self._engine

    @property
    def loss_scale(self):
        return self._live().loss_scale

    @property
    def step_count(self):
        """Optimizer steps taken (restored by load())."""
        self._ensure_ready()
        return self._engine.step_count

    def scale_loss(self, loss):
        """loss * current loss scale (only differs from loss for fp16 dynamic scaling)."""
        s = self._live().loss_scale
        return loss if s == 1.0 else loss * s

    def memory(self):
        self._ensure_ready()
        return self._engine.memory()

    def param_id(self, p):
        """Engine id of parameter p (after the first backward or step)."""
        self._ensure_ready()
        for i, (_, q) in enumerate(self._named):
            if q is p:
                return self._pid[i]
        raise KeyError("not a parameter of this optimizer")

    def master_weights(self):
        """Collective: {name: fp32 tensor} of the full master weights."""
        self._ensure_ready()
        self._sync_written()
        e = self._engine
        return {n: torch.from_numpy(e.get_master(self._pid[i]))
                for i, (n, _) in enumerate(self._named)}

    def param_state(self, p):
        """Collective: {'step', 'exp_avg', 'exp_avg_sq', 'master'} of parameter p (fp32)."""
        e, pid = self._engine, self.param_id(p)
        self._sync_written()
        if _lib.has("sg_get_param_step"):
            step = e.param_step(pid)  # skipped steps (no gradient) do not count, as in torch
        elif _lib.has("sg_get_step"):
            step = e.step_count
        else:
            step = self.last_step_info.step if self.last_step_info else 0
        return {"step": torch.tensor(float(step)),
                "exp_avg": torch.from_numpy(e.get_optim_state(pid, 0)),
                "exp_avg_sq": torch.from_numpy(e.get_optim_state(pid, 1)),
                "master": torch.from_numpy(e.get_master(pid))}

    def state_dict(self):
        """Collective: torch.optim-style dict; 'state' holds full (gathered) fp32 tensors."""
        state = {i: self.param_state(p) for i, (_, p) in enumerate(self._named)}
        groups = []
        for gi, g in enumerate(self.param_groups):
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = [i for i, x in enumerate(self._group_of) if x == gi]
            groups.append(d)
        return {"state": state, "param_groups": groups,
                "names": [n for n, _ in self._named],
                "shardgrad": {"token": self._token, "version": self._version}}

    def load_state_dict(self, state_dict):
        """Takes back a state_dict() of this optimizer made since its last step (as
        accelerate, and so transformers.Trainer, does when it wraps an optimizer: state_dict,
        moved to the device, load_state_dict): the moments are those the library holds, and
        the param groups' hyperparameters are taken. Any other state (another optimizer's, an
        older one) needs setters the C API lacks: use save()/load()."""
        mark = state_dict.get("shardgrad") if isinstance(state_dict, dict) else None
        if (mark != {"token": self._token, "version": self._version}
                or state_dict.get("names") != [n for n, _ in self._named]
                or len(state_dict.get("param_groups", ())) != len(self.param_groups)):
            raise UnsupportedError("ShardedAdamW.load_state_dict: only this optimizer's own "
                                   "current state_dict() can be loaded (the C API has no setter "
                                   "for AdamW moments); use save()/load() (sharded checkpoints)",
                                   function="python")
        for mine, theirs in zip(self.param_groups, state_dict["param_groups"]):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = v

    def save(self, directory):
        """Collective: sharded checkpoint of parameters, masters, moments, step, lr and loss
        scale (sg_save); crash-safe. Call between steps."""
        self._ensure_ready()
        self._sync_written()
        self._engine.save(directory)
        if self._engine.rank == 0:
            self._write_shapes(directory)

    _SHAPES = "torch_shapes.json"  # beside sg_save's files: the shapes the library lacks

    def _write_shapes(self, directory):
        """The parameters' torch shapes, by name, for load() to check (the library's manifest
        has numels only). A new file in the directory (O_EXCL), renamed into place."""
        shapes = {n: list(p.shape) for n, p in self._named}
        fd, tmp = tempfile.mkstemp(prefix=".torch_shapes.", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(shapes, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(directory, self._SHAPES))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _check_shapes(self, directory):
        """load() refuses a checkpoint whose parameter of the same name has another shape (the
        same numel would load silently reshaped), as torch's load_state_dict does. Checkpoints
        without the shapes (made by C callers) are checked by the library for numels only."""
        path = os.path.join(directory, self._SHAPES)
        if not os.path.isfile(path):
            return
        with open(path) as f:
            saved = json.load(f)
        bad = ["'%s': %s in the checkpoint, %s here" % (n, saved[n], list(p.shape))
               for n, p in self._named if n in saved and list(saved[n]) != list(p.shape)]
        if bad:
            raise MismatchError("ShardedAdamW.load(%r): parameter shapes differ: %s (torch's "
                                "load_state_dict refuses this too)"
                                % (directory, "; ".join(bad[:5]) + (" ..." if len(bad) > 5
                                                                    else "")),
                                function="python")

    def load(self, directory, convert_optim_state=False):
        """Collective: restores a save() made at any world size, bucket size or strategy; the
        model's parameters change in place. The learning rate stays param_groups' (the
        scheduler's): it is applied again at the next step. convert_optim_state=True loads a
        checkpoint whose optimizer state is in the other format (optim_state_dtype "fp32" or
        "q8"), converting it (docs/optim-state-8bit.md); without it that is a MismatchError."""
        self._ensure_ready()
        self._check_shapes(directory)
        self._engine_waits()
        self._engine.load(directory, convert_optim_state=convert_optim_state)
        self._note_versions()  # the library's write: the loaded masters stand
        self._drop_grads()
        self._version += 1
        self._torch_waits()
        self._sent = [None] * len(self.param_groups)  # lr and weight decay apply again
        self.last_step_info = None

    def export(self, path):
        """Collective (rank 0 writes): fp32 master weights by parameter name, safetensors."""
        self._ensure_ready()
        self._sync_written()
        self._engine.export(path)

    def import_(self, path):
        """Collective: sets the parameters from a safetensors file by name (optimizer state
        unchanged)."""
        self._ensure_ready()
        self._engine_waits()
        self._engine.import_(path)
        self._note_versions()  # the library's write: the loaded masters stand
        self._torch_waits()

    # -- teardown -------------------------------------------------------------------------
    def close(self):
        """Copies the parameters back into torch-owned memory, removes the hooks and lets the
        engine go: at once, or when the last tensor that still views the library's memory (a
        p.detach() made earlier, autograd's saved tensors) is gone. The model stays usable;
        the optimizer does not. After a communication failure it still closes (the parameters
        keep whatever the failed step left in them)."""
        if self._closed:
            return
        self._closed = True
        unregister_params(self)
        self._drop_grads()
        for _, p in self._named:
            if isinstance(p.grad, ShardGrad):
                p.grad = None
        for h in (self._hooks + getattr(self, "_wait_hooks", [])
                  + getattr(self, "_order_hooks", [])):
            h.remove()
        self._hooks = []
        self._wait_hooks = []
        self._order_hooks = []
        e, self._engine = self._engine, None
        if e is None or e.closed:
            return
        if not self._ready:
            e.close()  # no view of its memory was ever made
            return
        try:
            e.param_wait(-1)  # overlap_param_gather: the copies need every bucket
        except ShardgradError:
            pass  # a broken engine (a peer failed): copy the parameters as they are
        self._torch_waits()  # the copies read what the engine's stream last wrote
        with torch.no_grad():
            for _, p in self._named:
                p.data = p.data.clone()
        # Views made before (they hold the Engine object) keep it alive; without any, this
        # was the last reference and the engine is destroyed here.
        e.release()

    def __reduce_ex__(self, protocol):
        # The default would copy the Python fields without the engine behind them (an object
        # that fails at step()): refused, for pickle, copy.copy and copy.deepcopy alike.
        raise TypeError("ShardedAdamW cannot be pickled or copied (its state lives in the "
                        "library, sharded over the ranks): use opt.state_dict() for a "
                        "gathered copy of the state, or opt.save(dir) / opt.load(dir) for "
                        "checkpoints")

    def __deepcopy__(self, memo):
        self.__reduce_ex__(2)

    def __copy__(self):
        self.__reduce_ex__(2)

    def __del__(self):
        if "_named" not in self.__dict__:
            return  # a wrapper sharing this class (see _on_real): the optimizer is not its own
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        if self._engine is None or self._engine.closed or self._closed:
            return "ShardedAdamW(closed)"
        c = self._engine.config
        return ("ShardedAdamW(%d params, rank %d of %d, %s, lr=%g)"
                % (len(self._named), self._engine.rank, self._engine.world_size,
                   c.strategy.name, self.lr))


def _on_real(fn):
    """Lightning's LightningOptimizer wraps an optimizer in an object whose class derives from
    the optimizer's own (so isinstance holds) and whose attributes come from it through
    __getattr__: ShardedAdamW's methods, called on that wrapper, would set their state on the
    wrapper instead (and its __del__ would close the optimizer). They run on the wrapped
    ShardedAdamW instead."""
    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        d = self.__dict__
        if "_named" not in d and isinstance(d.get("_optimizer"), ShardedAdamW):
            self = d["_optimizer"]
        return fn(self, *args, **kwargs)
    return method


for _name in ("step", "zero_grad", "close", "clip_grad_norm_", "grad_norm", "no_sync", "load",
              "save", "state_dict", "load_state_dict", "export", "import_", "wait_params",
              "params_written",
              "param_state", "master_weights", "memory", "param_id", "scale_loss"):
    setattr(ShardedAdamW, _name, _on_real(getattr(ShardedAdamW, _name)))
del _name
