"""The planner: which layouts fit on a cluster, and how long a step of each takes, before running.

    python -m shardgrad.plan --probe --out hw.json            # under mpirun, on the real nodes
    python -m shardgrad.plan --hardware hw.json --params 29.5e6 --compute-s 0.09 --micro 8
    python -m shardgrad.plan --preset a100-2x2-1g --llama 7b --micro 8

Memory comes from sg_estimate_memory (exact: what the engine allocates), step time from
sg_estimate_step (the engine's collectives costed per link level and played through its queues;
docs/planner.md). The hardware description is what --probe measured through the library's own
communicators and kernels, or a described cluster (presets and flags; every number that is not
measured is printed as an assumption).
"""

import argparse
import ctypes
import json
import os
import socket
import statistics
import struct
import sys
import threading
import time

from . import _lib
from ._structs import ALGO_HOST, ALGO_RING, SgHardware, SgStepEstimate
from .config import Config
from .core import Comm, Engine, _call, estimate_memory
from .errors import InvalidArgumentError, ShardgradError

__all__ = ["Hardware", "StepEstimate", "estimate_step", "llama_numels", "module_numels",
           "safetensors_numels", "layouts", "probe", "main"]

GiB = float(1 << 30)
_ALGOS = {"host": ALGO_HOST, "ring": ALGO_RING}
# per-level fields of sg_hardware: Python name -> (array, level)
_LEVEL_FIELDS = {"%s_%s" % (lv, k): (arr, i)
                 for i, lv in enumerate(("node", "net"))
                 for k, arr in (("bytes_per_s", "link_bytes_per_s"),
                                ("latency_s", "link_latency_s"), ("overlap", "overlap"))}


# ------------------------------------------------------------------------------------------
# the hardware description

class Hardware:
    """sg_hardware as Python attributes. Levels: 'node' (inside a node: the bus bytes per second
    one rank sends) and 'net' (between nodes: what one node's link carries each way), each with
    <level>_bytes_per_s, <level>_latency_s and <level>_overlap."""

    FIELDS = ("ranks_per_node", "algorithm", "compute_s", "backward_fraction",
              "optim_params_per_s", "device_bytes_per_s", "host_optim_params_per_s",
              "pcie_bytes_per_s", "handover_s_per_byte", "replica_bytes_per_s")

    def __init__(self, **kwargs):
        s = SgHardware()
        _call("sg_hardware_init", ctypes.byref(s), ctypes.sizeof(SgHardware))
        self._s = s
        self.nodes = 1
        self.notes = []  # the assumptions behind numbers that were not measured
        for k, v in kwargs.items():
            setattr(self, k, v)

    def __setattr__(self, name, value):
        if name in ("_s", "nodes", "notes"):
            object.__setattr__(self, name, value)
        elif name == "algorithm":
            self._s.algorithm = _ALGOS[value] if isinstance(value, str) else int(value)
        elif name in self.FIELDS:
            setattr(self._s, name, type(getattr(self._s, name))(value))
        elif name in _LEVEL_FIELDS:
            arr, i = _LEVEL_FIELDS[name]
            getattr(self._s, arr)[i] = float(value)
        else:
            raise AttributeError("Hardware has no field %r" % name)

    def __getattr__(self, name):
        s = object.__getattribute__(self, "_s")
        if name in Hardware.FIELDS:
            return getattr(s, name)
        if name in _LEVEL_FIELDS:
            arr, i = _LEVEL_FIELDS[name]
            return getattr(s, arr)[i]
        raise AttributeError("Hardware has no field %r" % name)

    @property
    def struct(self):
        return self._s

    def as_dict(self):
        d = {k: getattr(self, k) for k in self.FIELDS}
        d["algorithm"] = "ring" if self.algorithm == ALGO_RING else "host"
        d["nodes"] = self.nodes
        for k in _LEVEL_FIELDS:
            d[k] = getattr(self, k)
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, d):
        hw = cls()
        for k, v in d.items():
            if k == "notes":
                hw.notes = list(v)
            elif k in cls.FIELDS or k == "nodes" or k in _LEVEL_FIELDS:
                setattr(hw, k, v)
        return hw

    @classmethod
    def load(cls, path):
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


class StepEstimate(dict):
    """sg_step_estimate as a dict: step_s and its parts (compute_s, exposed_node_s,
    exposed_net_s, optim_s, copy_s), all communication per level (comm_node_s, comm_net_s) and
    the bytes and collectives per step the engine's communicators count."""

    @classmethod
    def _from(cls, e):
        d = cls(step_s=e.step_s, compute_s=e.compute_s, exposed_node_s=e.exposed_s[0],
                exposed_net_s=e.exposed_s[1], comm_node_s=e.comm_s[0], comm_net_s=e.comm_s[1],
                optim_s=e.optim_s, copy_s=e.copy_s, handover_s=e.handover_s,
                shard_bytes=e.shard_bytes,
                shard_collectives=e.shard_collectives, replica_bytes=e.replica_bytes,
                replica_collectives=e.replica_collectives, link_node_bytes=e.link_bytes[0],
                link_net_bytes=e.link_bytes[1], optim_bytes=e.optim_bytes,
                copy_bytes=e.copy_bytes)
        return d


def _config(config, kwargs):
    if config is None:
        return Config(validate=False, **kwargs)  # the library checks it with the world
    return config.copy(**kwargs) if kwargs else config


def estimate_step(numels, world, microbatches, hardware, config=None, **kwargs):
    """sg_estimate_step: the predicted time of one optimizer step (a StepEstimate)."""
    cfg = _config(config, kwargs)
    numels = [int(n) for n in numels]
    if not numels:
        raise InvalidArgumentError("estimate_step: no parameters", function="python")
    arr = (ctypes.c_size_t * len(numels))(*numels)
    out = SgStepEstimate(struct_size=ctypes.sizeof(SgStepEstimate))
    _call("sg_estimate_step", ctypes.byref(cfg.struct), arr, len(numels), int(world),
          int(microbatches), ctypes.byref(hardware.struct), ctypes.byref(out))
    return StepEstimate._from(out)


# ------------------------------------------------------------------------------------------
# models

LLAMA = {  # hidden, layers, intermediate, vocab (Llama 1/2: no grouped-query attention)
    "7b": (4096, 32, 11008, 32000),
    "13b": (5120, 40, 13824, 32000),
}


def llama_numels(hidden, layers, intermediate, vocab):
    """The parameter tensors of a Llama decoder in registration order: embedding, per layer
    the four attention projections, the three MLP matrices and two RMSNorm weights, the final
    norm and an untied output head."""
    out = [vocab * hidden]
    for _ in range(layers):
        out += [hidden * hidden] * 4 + [hidden * intermediate] * 3 + [hidden, hidden]
    return out + [hidden, vocab * hidden]


def module_numels(module):
    """The sizes of a torch module's parameters, in registration order (zero-size skipped)."""
    return [p.numel() for p in module.parameters() if p.numel() > 0]


def safetensors_numels(path):
    """The tensor sizes in a safetensors file's header (the data is not read)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        if n > 100 << 20:
            raise ValueError("%s: header of %d bytes: not a safetensors file" % (path, n))
        header = json.loads(f.read(n))
    out = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        k = 1
        for d in t["shape"]:
            k *= int(d)
        if k > 0:
            out.append(k)
    return out


def mlp_numels(hidden, layers, inputs=32, outputs=8):
    """sg_bench_cluster's MLP (examples/mlp, MLP_IN -> hidden x (layers - 1) -> MLP_OUT): per
    layer a weight and a bias, in registration order."""
    dims = [inputs] + [hidden] * (layers - 1) + [outputs]
    out = []
    for a, b in zip(dims, dims[1:]):
        out += [a * b, b]
    return out


# ------------------------------------------------------------------------------------------
# layouts

def _dtype_kwargs(dtype):
    return {"param_dtype": dtype, "grad_dtype": dtype}


# The replica modes a hybrid layout can take: (label, config kwargs, what it costs in quality).
# The quality column is what docs/slow-links.md measured, not something the model predicts.
_REPLICA_MODES = (
    ("hybrid f32", {"replica_reduce_dtype": "f32"}, "exact"),
    ("hybrid bf16", {"replica_reduce_dtype": "bf16"}, "exact (bf16 wire)"),
    ("hybrid int8", {"replica_codec": "int8"}, "int8 + error feedback"),
    ("hybrid int4", {"replica_codec": "int4"}, "4-bit + error feedback"),
    ("DiLoCo H=8", {"outer_every": 8, "replica_reduce_dtype": "bf16"}, "outer steps, H=8"),
    ("DiLoCo H=32", {"outer_every": 32, "replica_reduce_dtype": "bf16"}, "outer steps, H=32"),
    ("DiLoCo8 int8", {"outer_every": 8, "replica_codec": "int8"}, "outer steps, H=8, int8 + EF"),
)


STRATEGIES = ("no_shard", "shard_opt", "shard_grad_op")


def _candidates(hw, world, dtype, device, buckets, states=("f32",), strategies=STRATEGIES):
    """(label, config kwargs, quality) of every layout the engine offers on this cluster."""
    L = max(1, hw.ranks_per_node)
    hybrid = hw.nodes > 1 and L > 1 and world % L == 0
    for strategy in strategies:
        layouts = [("flat", {}, "exact")]
        if hybrid and strategy != "no_shard":
            layouts += [(name, dict(kw, shard_ranks=L), q) for name, kw, q in _REPLICA_MODES]
        offloads = [0, 1] if device == "cuda" and strategy != "no_shard" else [0]
        for name, lk, quality in layouts:
            for state in states:
                for off in offloads:
                    for b in buckets:
                        kw = dict(strategy=strategy, device=device,
                                  bucket_bytes=int(b * (1 << 20)), offload_optimizer=off,
                                  overlap_param_gather=1, optim_state_dtype=state, **lk)
                        kw.update(_dtype_kwargs(dtype))
                        yield name, kw, quality


def _unsupported(kw):
    """Why the engine would refuse this layout at create today, or "" (the planner still
    predicts it). Every layout listed runs: on CUDA the codecs and outer steps run with an
    offloaded optimizer too (sg_replica_select.c)."""
    del kw
    return ""


def layouts(numels, hw, world, microbatches, dtype="f32", device="cpu", buckets=(8, 32, 128),
            device_gib=None, host_gib=None, reserve_gib=0.0, states=("f32",),
            strategies=STRATEGIES):
    """Every layout with its memory per rank and predicted step, fastest first: first those that
    fit and run, then those that fit but the engine does not run yet (`runs` says why), then
    those that do not fit in device_gib (minus reserve_gib for activations) or host_gib per
    rank (`why` says why). Layouts the library's config check refuses are left out.
    states: the optimizer-state formats to try ("f32", "q8"); strategies: of STRATEGIES."""
    rows = []
    for name, kw, quality in _candidates(hw, world, dtype, device, buckets, states, strategies):
        cfg = Config(validate=False, **kw)
        try:
            mem = estimate_memory(numels, world, cfg)
        except ShardgradError:
            continue  # the library's config check refuses it: nothing to predict
        est = estimate_step(numels, world, microbatches, hw, cfg)
        dev = mem.total_bytes / GiB
        host = getattr(mem, "host_bytes", 0) / GiB
        why = []
        if device_gib is not None and dev + reserve_gib > device_gib:
            why.append("device %.1f + %.1f GiB > %.1f" % (dev, reserve_gib, device_gib))
        if host_gib is not None and host > host_gib:
            why.append("host %.1f GiB > %.1f" % (host, host_gib))
        rows.append({"layout": name, "config": kw, "quality": quality, "device_gib": dev,
                     "host_gib": host, "fits": not why, "why": "; ".join(why),
                     "runs": _unsupported(kw), "estimate": est})
    rows.sort(key=lambda r: (not r["fits"], bool(r["runs"]), r["estimate"]["step_s"]))
    return rows


def best_per_layout(rows):
    """The first (best) row of each layout, strategy and offload setting: its best bucket."""
    seen, out = set(), []
    for r in rows:
        k = (r["layout"], r["config"]["strategy"], r["config"]["offload_optimizer"],
             r["config"].get("optim_state_dtype", "f32"))
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out


def _strategy_label(kw):
    s = {"no_shard": "NO_SHARD", "shard_opt": "SHARD_OPT", "shard_grad_op": "ZeRO-2"}
    return (s[kw["strategy"]] + (" +offload" if kw.get("offload_optimizer") else "")
            + (" +q8" if kw.get("optim_state_dtype", "f32") == "q8" else ""))


def _fits_label(r):
    if not r["fits"]:
        return "no: " + r["why"]
    return "yes" + (" (%s)" % r["runs"] if r["runs"] else "")


def format_rows(rows, top):
    head = ("%-12s %-23s %6s %9s %8s %9s %9s %9s %9s %8s %8s  %s"
            % ("layout", "strategy", "bucket", "dev GiB", "host GiB", "step s", "compute",
               "x-node", "in-node", "optim", "copies", "fits"))
    lines = [head]
    for r in rows[:top]:
        e, kw = r["estimate"], r["config"]
        lines.append("%-12s %-23s %5dM %9.2f %8.2f %9.3f %9.3f %9.3f %9.3f %8.3f %8.3f  %s"
                     % (r["layout"], _strategy_label(kw), kw["bucket_bytes"] >> 20,
                        r["device_gib"], r["host_gib"], e["step_s"], e["compute_s"],
                        e["exposed_net_s"], e["exposed_node_s"], e["optim_s"], e["copy_s"],
                        _fits_label(r)))
    return "\n".join(lines)


def markdown_rows(rows, top):
    """The rows as a Markdown table (docs/planner.md's tables are this output)."""
    lines = ["| layout | strategy | bucket | device GiB/rank | host GiB/rank | fits | step s | "
             "compute | x-node exposed | in-node exposed | optimizer | copies | quality |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows[:top]:
        e, kw = r["estimate"], r["config"]
        fits = ("yes" + (" (%s)" % r["runs"] if r["runs"] else "")) if r["fits"] else "**no**"
        lines.append("| %s | %s | %d MiB | %.1f | %.1f | %s | %.1f | %.1f | %.1f | %.2f | %.2f "
                     "| %.2f | %s |" % (r["layout"], _strategy_label(kw), kw["bucket_bytes"] >> 20,
                                       r["device_gib"], r["host_gib"], fits, e["step_s"],
                                       e["compute_s"], e["exposed_net_s"], e["exposed_node_s"],
                                       e["optim_s"], e["copy_s"], r["quality"]))
    return "\n".join(lines)


def config_snippet(row):
    kw = dict(row["config"])
    shard = kw.pop("shard_ranks", 0)
    args = ", ".join("%s=%r" % (k, v) for k, v in kw.items() if k != "replica_reduce_dtype" or shard)
    text = "sg.Config(%s)" % args
    if shard:
        text += ("\n# hybrid: shard, replica = comm.split_nodes(%d); "
                 "sg.Engine(shard, config, replica_comm=replica)" % shard)
    return text


# ------------------------------------------------------------------------------------------
# the probe

def _say(rank, msg):
    if rank == 0:
        sys.stderr.write("probe: %s\n" % msg)
        sys.stderr.flush()


class _Barrier:
    """A tiny engine over the world whose micro-batch reduction (every rank receives a piece
    from every other) and norm every rank waits for: all ranks meet there. (grad_norm alone
    would not do: without new gradients it returns the norm it computed before.)"""

    def __init__(self, comm):
        self.rank, self.size = comm.rank, comm.size
        self.e = Engine(comm, bucket_bytes=256)
        self.e.add_param("barrier", (64 * comm.size,))
        self.e.finalize()

    def wait(self):
        self.e.grad_ptr(0)
        self.e.grad_ready(0)
        self.e.backward_end()
        self.e.grad_norm()

    def agree(self, values):
        """Rank 0's values (at most 64 floats) on every rank: each measured its own, and the
        sizes of the next collectives must match."""
        v = [float(x) for x in values] + [0.0] * (self.e.param_shape(0)[0] - len(values))
        self.e.set_param(0, v)
        self.e.broadcast_params(0)
        return [float(x) for x in self.e.get_param(0)[:len(values)]]

    def slowest(self, t):
        """The largest of the ranks' t on every rank: a level's flows share its link, so the
        link has carried their bytes only when the last of them is done (one flow finishing
        early, and then running alone, must not count as the link's rate)."""
        worst = t
        for r in range(self.size):
            v = [float(t) if r == self.rank else 0.0] + [0.0] * (self.e.param_shape(0)[0] - 1)
            self.e.set_param(0, v)
            self.e.broadcast_params(r)
            worst = max(worst, float(self.e.get_param(0)[0]))
        return worst

    def close(self):
        self.e.close()


class _Reduce:
    """Bucket reductions of nbytes (f32, one bucket) over comm: micro-batches whose zeroed slots
    are handed over untouched, waited for by grad_norm. Made and warmed up before the timing."""

    def __init__(self, comm, nbytes):
        self.e = Engine(comm, bucket_bytes=nbytes, strategy="shard_grad_op")
        try:
            self.e.add_param("probe", (nbytes // 4,))
            self.e.finalize()
            self.run(1)
        except BaseException:
            self.e.close()
            raise

    def run(self, reps):
        """Seconds per reduction."""
        e = self.e
        t0 = time.perf_counter()
        for _ in range(reps):
            e.grad_ptr(0)
            e.grad_ready(0)
            e.backward_end()
        e.grad_norm()
        return (time.perf_counter() - t0) / reps

    def close(self):
        self.e.close()


def _reductions(comm, nbytes, reps, barrier):
    """Seconds per reduction of nbytes over comm, every rank starting at once."""
    r = _Reduce(comm, nbytes)
    try:
        barrier.wait()
        return r.run(reps)
    finally:
        r.close()


class _Workload:
    """CPU work of the library's own kernels (norm + AdamW steps of a one-rank engine), the
    stand-in for the caller's compute when measuring how communication slows it."""

    def __init__(self, numel=1 << 20):
        self.comm = Comm.local(1)[0]
        self.e = Engine(self.comm, bucket_bytes=numel * 4)
        self.e.add_param("work", (numel,))
        self.e.finalize()

    def run(self, k):
        t0 = time.perf_counter()
        for _ in range(k):
            self.e.grad_ptr(0), self.e.grad_ready(0), self.e.backward_end()
            self.e.step()
        return time.perf_counter() - t0

    def close(self):
        self.e.close()
        self.comm.close()


def _on_thread(w, k, barrier, beside=None):
    """Seconds of k workload steps on a thread of their own, started on every rank right after
    a barrier, with beside() (the level's reductions) on this thread meanwhile, or nothing."""
    res = []
    th = threading.Thread(target=lambda: res.append(w.run(k)))
    barrier.wait()
    th.start()
    try:
        if beside:
            beside()
    finally:
        th.join()
    return res[0]


def _beside(w, k, comm, nbytes, reps, barrier):
    """Seconds of k workload steps that start, on every rank, with reductions of the level."""
    r = _Reduce(comm, nbytes)
    try:
        return _on_thread(w, k, barrier, lambda: r.run(reps))
    finally:
        r.close()


def _overlap(comm, nbytes, barrier, rank, label, rounds=5):
    """How much of a level's communication hides beside compute: 1 - (the workload's slowdown
    while reductions of the level run beside it) / (the reductions' own time), in [0, 1]. Both
    runs of the workload start on every rank at once (the ranks' workloads share the cores the
    same way). Each beside run sits between two alone runs and is compared with their mean; the
    median over the rounds, so that other load on the machine, which comes and goes, moves the
    result as little as it can."""
    w = _Workload()
    try:
        reps = 2
        t_c = statistics.median(_reductions(comm, nbytes, reps, barrier)
                                for _ in range(3)) * reps
        one = min(w.run(1) for _ in range(3))
        k = max(2, int(1.5 * t_c / max(one, 1e-6)))  # the workload outlasts the reductions
        k = int(barrier.agree([k])[0])
        before, slow, alone = _on_thread(w, k, barrier), [], []
        for _ in range(rounds):
            beside = _beside(w, k, comm, nbytes, reps, barrier)
            after = _on_thread(w, k, barrier)
            slow.append(beside - (before + after) / 2)
            alone.append(before)
            before = after
        ov = min(1.0, max(0.0, 1.0 - statistics.median(slow) / t_c))
        _say(rank, "%s: overlap %.2f (compute %.0f ms alone, %+.0f ms beside %.0f ms of "
                   "reductions; medians of %d)" % (label, ov, statistics.median(alone) * 1e3,
                                                   statistics.median(slow) * 1e3, t_c * 1e3,
                                                   rounds))
        return ov
    finally:
        w.close()


def _fit_level(comm, bytes_of, barrier, rank, label, budget_s):
    """(bytes per second, latency) of a level from reductions of two sizes over comm.
    bytes_of(S): the bytes the level carries for one reduction of S bytes."""
    small = 64 << 10
    slowest = barrier.slowest
    t_small = min(slowest(_reductions(comm, small, 8, barrier)) for _ in range(2))
    probe_bytes = 4 << 20
    t = slowest(_reductions(comm, probe_bytes, 2, barrier))
    rate = bytes_of(probe_bytes) / max(t - t_small, 1e-9)
    big = int(min(256 << 20, max(probe_bytes, rate * budget_s / max(bytes_of(1.0), 1e-12))))
    big = int(barrier.agree([max(2, big >> 20)])[0]) << 20
    t_big = min(slowest(_reductions(comm, big, 2, barrier)) for _ in range(2))
    rate = (bytes_of(big) - bytes_of(small)) / max(t_big - t_small, 1e-9)
    lat = max(0.0, t_small - bytes_of(small) / rate)
    _say(rank, "%s: %.1f MB/s, %.0f us per collective (reductions of %d KiB: %.2f ms, %d MiB: "
               "%.1f ms)" % (label, rate / 1e6, lat * 1e6, small >> 10, t_small * 1e3,
                             big >> 20, t_big * 1e3))
    return rate, lat, big


def _hybrid_sums(shard, replica, barrier, hw, rank, nbytes=8 << 20, buckets=3, rounds=3):
    """What one node's link carries each way while a hybrid engine sums its buckets across nodes
    as it does in a step: an engine over (shard, replica) with `buckets` buckets of nbytes, every
    rank's slice summed with its counterparts by an all-reduce of its own (the node's ranks each
    a flow of their own on the link), the node's ranks meeting in every bucket's in-node
    reduce-scatter. The time from the first bucket handed over to grad_norm (median of the
    rounds), less what the model charges besides the sums (the in-node reduce-scatters and the
    hand-over at the rates measured before, the sums' message latency), gives the rate; never
    more than the link's (the sums cannot outrun it). Returns (bytes per second, seconds)."""
    L, N = shard.size, replica.size
    e = Engine(shard, replica_comm=replica, bucket_bytes=nbytes, strategy="shard_grad_op")
    try:
        for i in range(buckets):
            e.add_param("probe%d" % i, (nbytes // 4,))
        e.finalize()

        def sums():
            for i in reversed(range(buckets)):  # backward order: each bucket reduces at once
                e.grad_ptr(i)
                e.grad_ready(i)
            e.backward_end()
            e.grad_norm()

        sums()
        e.step()
        times = []
        for _ in range(rounds):
            barrier.wait()
            times.append(barrier.slowest(_timed(sums)))
            e.step()
        t = statistics.median(times)
    finally:
        e.close()
    inner = buckets * (hw.node_latency_s + (L - 1) / L * nbytes / hw.node_bytes_per_s +
                       nbytes * hw.handover_s_per_byte + 2 * hw.net_latency_s)
    moved = buckets * 2 * (N - 1) / N * nbytes  # an all-reduce of S/L by each of the L ranks
    rate = min(hw.net_bytes_per_s, moved / max(t - inner, 1e-9))
    _say(rank, "      %.1f MB/s (%d buckets of %d MiB: %.0f ms, %.0f ms of it in-node and "
               "hand-over; the link alone: %.1f MB/s)" % (rate / 1e6, buckets, nbytes >> 20,
                                                        t * 1e3, inner * 1e3,
                                                        hw.net_bytes_per_s / 1e6))
    return rate, t


def _optim_rate(numel=1 << 22, reps=3):
    """Norm + AdamW elements per second of a one-rank engine step (f32)."""
    comm = Comm.local(1)[0]
    e = Engine(comm, bucket_bytes=numel * 4)
    try:
        e.add_param("probe", (numel,))
        e.finalize()
        best = None
        for _ in range(reps + 1):
            e.grad_ptr(0), e.grad_ready(0), e.backward_end()
            t0 = time.perf_counter()
            e.step()
            t = time.perf_counter() - t0
            best = t if best is None or t < best else best
        return numel / best
    finally:
        e.close()
        comm.close()


def _handover(numel=1 << 22, reps=5):
    """Seconds per gradient byte the caller's thread spends handing a micro-batch to an engine
    (grad_ptr, writing the whole slot, grad_ready, backward_end) beyond writing as many bytes
    into a buffer of its own that stays resident. A one-rank engine, one bucket."""
    nbytes = numel * 4
    own = ctypes.create_string_buffer(nbytes)
    ctypes.memset(own, 1, nbytes)
    t_own = statistics.median(_timed(lambda: ctypes.memset(own, 0, nbytes)) for _ in range(reps))
    comm = Comm.local(1)[0]
    e = Engine(comm, bucket_bytes=nbytes)
    try:
        e.add_param("probe", (numel,))
        e.finalize()
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            ctypes.memset(e.grad_ptr(0), 0, nbytes)
            e.grad_ready(0)
            e.backward_end()
            times.append(time.perf_counter() - t0)
        e.grad_norm()
        return max(0.0, (statistics.median(times[1:]) - t_own) / nbytes)
    finally:
        e.close()
        comm.close()


def _memcpy_rate(nbytes=64 << 20, reps=3):
    a = ctypes.create_string_buffer(nbytes)
    b = ctypes.create_string_buffer(nbytes)
    ctypes.memmove(b, a, nbytes)
    best = min(_timed(lambda: ctypes.memmove(b, a, nbytes)) for _ in range(reps))
    return 2 * nbytes / best


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def probe(comm=None, budget_s=0.3, ranks_per_node=0):
    """Measures this cluster (every rank calls it; MPI: one rank per process): the link rate and
    latency inside a node (reductions over the node's ranks) and between nodes (over one rank
    per node, every node rank at once, as a hybrid engine's replicas share the node's link),
    a hybrid engine's sums across nodes as it runs them, the norm + AdamW rate of a step and the
    memory copy rate. ranks_per_node: the nodes (0: the ranks sharing a host, as
    Comm.split_nodes). Returns a Hardware."""
    world = comm if comm is not None else Comm.mpi()
    rank, W = world.rank, world.size
    shard, replica = world.split_nodes(ranks_per_node)
    L, N = shard.size, replica.size
    hw = Hardware(ranks_per_node=L)
    hw.nodes = N
    barrier = _Barrier(world)
    try:
        _say(rank, "%d ranks: %d node(s) x %d (by host name)" % (W, N, L))
        if L > 1:
            _say(rank, "[1/6] inside a node: reduce-scatter over the node's %d ranks" % L)
            hw.node_bytes_per_s, hw.node_latency_s, big = _fit_level(
                shard, lambda S: (L - 1) / L * S, barrier, rank, "in-node", budget_s)
            hw.node_overlap = _overlap(shard, big, barrier, rank, "in-node")
        else:
            hw.notes.append("one rank per node: the in-node level is not measured")
        if N > 1:
            _say(rank, "[2/6] between nodes: reduce-scatter over one rank per node, all %d "
                       "at once" % L)
            hw.net_bytes_per_s, hw.net_latency_s, big = _fit_level(
                replica, lambda S: L * (N - 1) / N * S, barrier, rank, "between nodes", budget_s)
            hw.net_overlap = _overlap(replica, big, barrier, rank, "between nodes")
        else:
            hw.notes.append("one node: the between-nodes level is not measured")
        _say(rank, "[3/6] hand-over: a micro-batch's gradients written into the engine's slots")
        barrier.wait()
        hw.handover_s_per_byte = _handover()
        _say(rank, "      %.2f ns per byte beyond writing a resident buffer"
                   % (hw.handover_s_per_byte * 1e9))
        if L > 1 and N > 1:
            _say(rank, "[4/6] between nodes: a hybrid engine's sums, the node's %d ranks each "
                       "its own all-reduce, meeting per bucket" % L)
            hw.replica_bytes_per_s = _hybrid_sums(shard, replica, barrier, hw, rank)[0]
        else:
            hw.notes.append("replica_bytes_per_s not measured (needs 2 nodes of 2 ranks or "
                            "more): hybrid sums at the link's rate")
        _say(rank, "[5/6] norm + AdamW of a 4M-element step (f32), every rank at once")
        barrier.wait()
        rate = _optim_rate()
        hw.optim_params_per_s = rate
        hw.device_bytes_per_s = rate * 32  # an f32 step moves 32 bytes per element
        _say(rank, "      %.1f M elements/s" % (rate / 1e6))
        _say(rank, "[6/6] memory copy")
        barrier.wait()
        hw.notes.append("memcpy %.2f GB/s (read + write)" % (_memcpy_rate() / 1e9))
        hw.notes.append("probed on %s, %d ranks, %s" % (socket.gethostname(), W,
                                                         time.strftime("%Y-%m-%d %H:%M:%S")))
        hw.notes.append("optim_params_per_s measured with f32 parameters")
        barrier.wait()
    finally:
        barrier.close()
        shard.close()
        replica.close()
        if comm is None:
            world.close()
    return hw


# ------------------------------------------------------------------------------------------
# described clusters

PRESETS = {
    # the seed's case: 2 servers x 2 A100-40GB, 1 Gbit/s between them
    "a100-2x2-1g": dict(nodes=2, ranks_per_node=2, net_gbit=1.0, node_gbyte=100.0,
                        device_gib=40.0, device_gbyte=1555.0, tflops=312.0, host_gib=256.0,
                        pcie_gbyte=12.0, host_optim=1e9),
    # 16 nodes x 8 H100 (SXM) on 100 Gbit/s
    "h100-16x8-100g": dict(nodes=16, ranks_per_node=8, net_gbit=100.0, node_gbyte=150.0,
                           device_gib=80.0, device_gbyte=3350.0, tflops=989.0, host_gib=256.0,
                           pcie_gbyte=25.0, host_optim=1e9),
}


def described(nodes, ranks_per_node, net_gbit, node_gbyte, device_gbyte, link_fraction=0.7,
              net_latency_us=50.0, node_latency_us=10.0, algorithm="ring", pcie_gbyte=0.0,
              host_optim=0.0, **_):
    """A Hardware from datasheet numbers; the achievable fraction of the nominal link rate and
    the latencies are assumptions, recorded in .notes."""
    hw = Hardware(ranks_per_node=ranks_per_node, algorithm=algorithm)
    hw.nodes = nodes
    hw.net_bytes_per_s = net_gbit * 1e9 / 8 * link_fraction
    hw.node_bytes_per_s = node_gbyte * 1e9 * link_fraction
    hw.net_latency_s = net_latency_us * 1e-6
    hw.node_latency_s = node_latency_us * 1e-6
    hw.device_bytes_per_s = device_gbyte * 1e9 * 0.8
    hw.optim_params_per_s = 0
    if pcie_gbyte:
        hw.pcie_bytes_per_s = pcie_gbyte * 1e9
    if host_optim:
        hw.host_optim_params_per_s = host_optim
    hw.notes += [
        "links: %g Gbit/s between nodes, %g GB/s inside a node, x %.2f achievable (assumed)"
        % (net_gbit, node_gbyte, link_fraction),
        "latency per message step: %g us between nodes, %g us inside (assumed)"
        % (net_latency_us, node_latency_us),
        "AdamW at 80%% of %g GB/s device memory bandwidth (assumed)" % device_gbyte,
        "collectives: %s algorithm" % algorithm]
    if pcie_gbyte:
        hw.notes.append("offload: PCIe %g GB/s each way, host AdamW %.2g elements/s per rank "
                        "(assumed)" % (pcie_gbyte, host_optim))
    return hw


def compute_time(params, tokens, tflops, mfu):
    """Forward + backward seconds of one micro-batch: 6 FLOPs per parameter and token at `mfu`
    of the peak (an assumption the caller states)."""
    return 6.0 * params * tokens / (tflops * 1e12 * mfu)


# ------------------------------------------------------------------------------------------
# command line

def _parser():
    p = argparse.ArgumentParser(prog="python -m shardgrad.plan", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--probe", action="store_true", help="measure this cluster (under mpirun)")
    p.add_argument("--out", help="--probe: the JSON file to write (rank 0)")
    p.add_argument("--budget-s", type=float, default=0.3,
                   help="--probe: about how long the largest timed reduction runs")
    p.add_argument("--hardware", help="a probe's JSON file")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a described cluster")
    p.add_argument("--nodes", type=int)
    p.add_argument("--ranks-per-node", type=int)
    p.add_argument("--net-gbit", type=float, help="link rate between nodes, Gbit/s (nominal)")
    p.add_argument("--link-fraction", type=float, default=0.7,
                   help="achievable fraction of a described link's nominal rate (assumption)")
    p.add_argument("--device-gib", type=float, help="device memory per rank")
    p.add_argument("--host-gib", type=float, help="host memory per rank (offload)")
    p.add_argument("--reserve-gib", type=float, default=0.0,
                   help="device memory per rank kept for activations and the framework")
    m = p.add_argument_group("model")
    m.add_argument("--params", type=float, help="a parameter count (one tensor per 4M)")
    m.add_argument("--llama", choices=sorted(LLAMA), help="Llama shapes")
    m.add_argument("--mlp", nargs=2, type=int, metavar=("HIDDEN", "LAYERS"),
                   help="sg_bench_cluster's MLP")
    m.add_argument("--safetensors", help="a safetensors file: its header's tensor shapes")
    m.add_argument("--dtype", default="f32", choices=("f32", "bf16"))
    m.add_argument("--device", default=None, choices=("cpu", "cuda"))
    t = p.add_argument_group("the step")
    t.add_argument("--micro", type=int, default=1, help="micro-batches per optimizer step")
    t.add_argument("--compute-s", type=float, help="forward + backward seconds per micro-batch")
    t.add_argument("--tokens", type=float, help="tokens per micro-batch per rank (with --mfu)")
    t.add_argument("--mfu", type=float, default=0.4, help="achieved fraction of peak FLOPs")
    t.add_argument("--buckets", default="8,32,128", help="bucket sizes to try, MiB")
    t.add_argument("--all-buckets", action="store_true",
                   help="a row per bucket size (default: the best bucket size of each layout)")
    t.add_argument("--states", default="f32,q8",
                   help="optimizer-state formats to try: f32, q8 (8-bit AdamW moments)")
    t.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="strategies to try: no_shard, shard_opt, shard_grad_op")
    t.add_argument("--top", type=int, default=20)
    t.add_argument("--json", action="store_true", help="print the rows as JSON")
    t.add_argument("--markdown", action="store_true", help="print the rows as a Markdown table")
    return p


def _numels(a):
    if a.llama:
        return llama_numels(*LLAMA[a.llama])
    if a.mlp:
        return mlp_numels(*a.mlp)
    if a.safetensors:
        return safetensors_numels(a.safetensors)
    if a.params:
        n, chunk = int(a.params), 1 << 22
        return [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    raise SystemExit("plan: give a model: --params, --llama, --mlp or --safetensors")


def _hardware(a, preset, device):
    if a.hardware:
        hw = Hardware.load(a.hardware)
    else:
        d = dict(preset)
        for k in ("nodes", "ranks_per_node", "net_gbit"):
            if getattr(a, k) is not None:
                d[k] = getattr(a, k)
        if "nodes" not in d:
            raise SystemExit("plan: give --hardware, --preset or --nodes/--ranks-per-node/"
                             "--net-gbit")
        d.setdefault("node_gbyte", 10.0)
        d.setdefault("device_gbyte", 10.0)
        d.setdefault("net_gbit", 1.0)
        d.setdefault("ranks_per_node", 1)
        d.setdefault("algorithm", "ring" if device == "cuda" else "host")
        hw = described(link_fraction=a.link_fraction, **d)
    if a.nodes and a.hardware:
        hw.nodes = a.nodes
    return hw


def _compute_s(a, preset, params, hw):
    if a.compute_s is not None:
        return a.compute_s
    if a.tokens and preset.get("tflops"):
        hw.notes.append("compute: 6 x %.3g params x %g tokens at %.0f%% of %g TFLOPS (assumed)"
                        % (params, a.tokens, a.mfu * 100, preset["tflops"]))
        return compute_time(params, a.tokens, preset["tflops"], a.mfu)
    hw.notes.append("compute: 0 (give --compute-s or --tokens): communication and optimizer only")
    return 0.0


def _run_probe(a):
    hw = probe(budget_s=a.budget_s)
    if a.out and _rank0():
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(hw.as_dict(), f, indent=1)
        sys.stderr.write("probe: wrote %s\n" % a.out)
    if _rank0():
        print(json.dumps(hw.as_dict(), indent=1))


def _rank0():
    for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"):
        if k in os.environ:
            return os.environ[k] == "0"
    return True


def main(argv=None):
    a = _parser().parse_args(argv)
    if a.probe:
        return _run_probe(a)
    preset = PRESETS.get(a.preset, {})
    numels = _numels(a)
    params = float(sum(numels))
    device = a.device or ("cuda" if preset else "cpu")
    hw = _hardware(a, preset, device)
    hw.compute_s = _compute_s(a, preset, params, hw)
    world = hw.nodes * max(1, hw.ranks_per_node)
    buckets = [float(x) for x in a.buckets.split(",")]
    rows = layouts(numels, hw, world, a.micro, a.dtype, device, buckets,
                   a.device_gib or preset.get("device_gib"),
                   a.host_gib or preset.get("host_gib"), a.reserve_gib,
                   tuple(x for x in a.states.split(",") if x),
                   tuple(x for x in a.strategies.split(",") if x))
    if not a.all_buckets:
        rows = best_per_layout(rows)
    if a.json:
        print(json.dumps([dict(r, estimate=dict(r["estimate"])) for r in rows], indent=1))
        return 0
    if a.markdown:
        print(markdown_rows(rows, a.top))
        return 0
    print("model: %.3g parameters in %d tensors, %s; %d node(s) x %d ranks, %d micro-batch(es)"
          % (params, len(numels), a.dtype, hw.nodes, hw.ranks_per_node, a.micro))
    print("hardware: in-node %.3g GB/s (%.0f us), between nodes %.3g GB/s per node link (%.0f us),"
          " compute %.3f s per micro-batch" % (hw.node_bytes_per_s / 1e9, hw.node_latency_s * 1e6,
                                               hw.net_bytes_per_s / 1e9, hw.net_latency_s * 1e6,
                                               hw.compute_s))
    if hw.replica_bytes_per_s > 0:
        print("  hybrid sums across nodes (probed as the engine runs them): %.3g GB/s per node "
              "link" % (hw.replica_bytes_per_s / 1e9))
    for n in hw.notes:
        print("  - " + n)
    print(format_rows(rows, a.top))
    print("times in seconds per optimizer step; x-node / in-node: communication not hidden "
          "behind compute; dev GiB: sg_estimate_memory per rank (model state only)")
    best = next((r for r in rows if r["fits"] and not r["runs"]), None)
    print("best that fits:\n" + (config_snippet(best) if best else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
