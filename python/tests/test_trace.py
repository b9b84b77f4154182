"""Tracing through the binding (Engine.trace_*, TraceEvent, trace_overlap).

What the events say must follow from how the engine orders its work, whatever the timing (as
in tests/test_trace.c): one GRAD_READY per parameter and micro-batch, one REDUCE per bucket and
micro-batch in bucket order, one STEP per step, one GATHER per bucket and step at W > 1 (ids
nb-1..0), one WAIT per step at its end or, with overlap_param_gather, one per bucket where the
next forward pass calls param_wait, every mark; reductions start after the gradient that
launched them, steps after their reductions ended, gathers after their step started and after
the gather before them, waits end after the gather they waited for.
The Chrome trace file holds exactly the events trace_events returns; SG_TRACE writes one file
per rank at close; misuse raises; a full buffer counts what it dropped. trace_overlap is checked
on hand-built event lists whose answers follow from its definition (no timing assertions).
"""

import ctypes
import json
import os
import random
import subprocess
import sys

import pytest

import shardgrad as sg
from shardgrad import _lib, core

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

NPARAM = 8
NUMEL = 4096  # 16 KiB of fp32 per parameter: several per bucket, several buckets
FAST = dict(timeout_ms=30000, bucket_bytes=32 << 10, strategy="shard_grad_op")
SPANS = (sg.TraceKind.REDUCE, sg.TraceKind.STEP, sg.TraceKind.GATHER, sg.TraceKind.WAIT)
KIND_NAMES = {sg.TraceKind.GRAD_READY: "grad_ready", sg.TraceKind.REDUCE: "reduce",
              sg.TraceKind.STEP: "step", sg.TraceKind.GATHER: "gather",
              sg.TraceKind.MARK: "mark", sg.TraceKind.WAIT: "wait"}

pytestmark = pytest.mark.skipif(not _lib.has("sg_trace_start"),
                                reason="the library predates the tracing API")


def make_engine(comm, nparam=NPARAM, numel=NUMEL, **kw):
    e = sg.Engine(comm, **dict(FAST, **kw))
    for p in range(nparam):
        e.add_param("layer%d.weight" % p, numel)
    e.finalize()
    return e


def train(e, steps, mb, wait=False):
    """Micro-batches of gradients in backward order, each opened by a "backward" mark. wait:
    every step but the first is preceded by a "forward pass" that waits for the parameters in
    registration order (param_wait), then a "forward" mark."""
    for s in range(steps):
        if wait and s > 0:
            for p in range(e.num_params):
                e.param_wait(p)
            e.trace_mark("forward")
        for _ in range(mb):
            e.trace_mark("backward")
            for p in reversed(range(e.num_params)):
                e.grad_ready(p)
        e.step()


def count(events, kind):
    return sum(ev.kind == kind for ev in events)


def buckets_per_microbatch(events):
    """The REDUCE ids of each micro-batch (between MARK/STEP events), as lists."""
    out, cur = [], None
    for ev in events:
        if ev.kind in (sg.TraceKind.MARK, sg.TraceKind.STEP):
            if cur is not None:
                out.append(cur)
            cur = [] if ev.kind == sg.TraceKind.MARK and ev.label != "forward" else None
        elif ev.kind == sg.TraceKind.REDUCE:
            cur.append(ev.id)
    return out


def gather_steps(events, nb):
    """Checks that the GATHER ids of each step run nb-1..0; returns the number of such steps."""
    ids = [ev.id for ev in events if ev.kind == sg.TraceKind.GATHER]
    assert len(ids) % nb == 0, ids
    assert ids == list(range(nb - 1, -1, -1)) * (len(ids) // nb), ids
    return len(ids) // nb


def check_causality(events):
    last_ready = last_reduce_end = step_start = last_step_end = gather_end = -1.0
    gather_end_of = {}
    step = 0
    for ev in events:
        assert ev.start_us >= 0 and ev.end_us >= ev.start_us, ev
        assert ev.duration_us == ev.end_us - ev.start_us
        assert ev.step == step, ev  # steps taken before it was issued
        if ev.kind in (sg.TraceKind.GRAD_READY, sg.TraceKind.MARK):
            assert ev.end_us == ev.start_us, ev
        if ev.kind == sg.TraceKind.GRAD_READY:
            last_ready = ev.start_us
        elif ev.kind == sg.TraceKind.REDUCE:
            assert ev.start_us >= last_ready, ev  # launched by the GRAD_READY before it
            last_reduce_end = max(last_reduce_end, ev.end_us)
        elif ev.kind == sg.TraceKind.STEP:
            assert ev.start_us >= last_reduce_end, ev  # after every reduction of the step
            step_start, last_step_end = ev.start_us, ev.end_us
            step += 1
        elif ev.kind == sg.TraceKind.GATHER:
            # after its bucket's AdamW (within the step) and the gather before it; bucket 0,
            # the last, after the whole step
            assert ev.start_us >= step_start and ev.start_us >= gather_end, ev
            if ev.id == 0:
                assert ev.start_us >= last_step_end, ev
            gather_end = ev.end_us
            gather_end_of[ev.id] = ev.end_us
        elif ev.kind == sg.TraceKind.WAIT:
            assert ev.id in gather_end_of and ev.end_us >= gather_end_of[ev.id], ev
        elif ev.kind == sg.TraceKind.MARK and ev.label == "forward":
            assert ev.start_us >= gather_end, ev  # after param_wait of every parameter


def check_json(path, events, rank):
    with open(path) as f:
        doc = json.load(f)
    entries = doc["traceEvents"]
    assert len(entries) == len(events) + 3  # process name, two thread names
    meta = [x for x in entries if x["ph"] == "M"]
    assert len(meta) == 3 and all(x["pid"] == rank for x in meta)
    body = [x for x in entries if x["ph"] != "M"]
    for x, ev in zip(body, events):  # in issue order, the same events
        assert x["pid"] == rank
        assert x["cat"] == KIND_NAMES[ev.kind]
        assert x["name"] == (ev.label or KIND_NAMES[ev.kind])
        assert x["ph"] == ("X" if ev.kind in SPANS else "i")
        assert x["ts"] == pytest.approx(ev.start_us, abs=1e-3)
        if ev.kind in SPANS:
            assert x["dur"] == pytest.approx(ev.duration_us, abs=2e-3)
        assert x["args"] == {"id": ev.id, "step": ev.step}
    assert doc["otherData"]["rank"] == rank
    return doc


# ------------------------------------------------------------------------------------------
# real runs


def _rank_body(comm, steps, mb, tmp, overlap):
    with make_engine(comm, overlap_param_gather=overlap) as e:
        e.trace_start(4096)
        train(e, steps, mb, wait=overlap)
        e.trace_stop()
        events, dropped = e.trace_events()
        e.trace_write(os.path.join(tmp, "run-%r.json"))
        return events, dropped


@pytest.mark.parametrize("world,mb,overlap", [(1, 1, False), (2, 2, False), (2, 1, True),
                                              (1, 1, True)])
def test_counts_causality_and_file(world, mb, overlap, tmp_path):
    steps = 3
    results = sg.run_threads(world, _rank_body, steps, mb, str(tmp_path), overlap)
    for rank, (events, dropped) in enumerate(results):
        assert dropped == 0
        assert all(isinstance(ev, sg.TraceEvent) for ev in events)
        doc = check_json(str(tmp_path / ("run-%d.json" % rank)), events, rank)
        nb = doc["otherData"]["buckets"]
        assert nb >= 2, nb
        assert doc["otherData"]["world"] == world
        assert doc["otherData"]["strategy"] == "SHARD_GRAD_OP"
        per_mb = buckets_per_microbatch(events)
        assert per_mb == [list(range(nb))] * (mb * steps)
        assert count(events, sg.TraceKind.REDUCE) == nb * mb * steps
        assert count(events, sg.TraceKind.GRAD_READY) == NPARAM * mb * steps
        assert count(events, sg.TraceKind.MARK) == mb * steps + (steps - 1 if overlap else 0)
        assert count(events, sg.TraceKind.STEP) == steps
        gsteps = steps if world > 1 else 0
        assert count(events, sg.TraceKind.GATHER) == nb * gsteps
        assert gather_steps(events, nb) == gsteps
        # without overlap one WAIT at the end of each step (for bucket 0, gathered last); with
        # it, one per bucket where the "forward pass" waits, in gather order
        waits = [ev.id for ev in events if ev.kind == sg.TraceKind.WAIT]
        if not gsteps:
            assert waits == []
        elif overlap:
            assert waits == list(range(nb - 1, -1, -1)) * (steps - 1)
        else:
            assert waits == [0] * steps
        for ev in events:
            if ev.kind == sg.TraceKind.GRAD_READY:
                assert ev.label == "layer%d.weight" % ev.id
            elif ev.kind == sg.TraceKind.MARK:
                assert ev.label in (("backward", "forward") if overlap else ("backward",))
                assert ev.id == -1
        check_causality(events)
        ov = sg.trace_overlap(events)
        assert ov["steps"] == steps
        assert ov["reduce_us"] == pytest.approx(sum(ev.duration_us for ev in events
                                                    if ev.kind == sg.TraceKind.REDUCE))
        assert 0.0 <= ov["hidden_us"] <= ov["reduce_us"]
        assert ov["exposed_us"] == pytest.approx(ov["reduce_us"] - ov["hidden_us"])
        gather = sum(ev.duration_us for ev in events if ev.kind == sg.TraceKind.GATHER)
        waited = sum(ev.duration_us for ev in events if ev.kind == sg.TraceKind.WAIT)
        assert ov["gather_us"] == pytest.approx(gather)
        assert ov["gather_exposed_us"] == pytest.approx(waited)
        assert ov["gather_hidden_us"] == pytest.approx(max(0.0, gather - waited))
        assert 0.0 <= ov["gather_hidden_fraction"] <= 1.0
        if not gsteps:
            assert ov["gather_us"] == 0.0 and ov["gather_hidden_fraction"] == 0.0
        if rank == 0:
            print("W=%d mb=%d overlap=%d: %d events, %d buckets, reductions %.1f us, %.0f%% "
                  "hidden; all-gathers %.1f us, %.0f%% hidden"
                  % (world, mb, overlap, len(events), nb, ov["reduce_us"],
                     100 * ov["hidden_fraction"], ov["gather_us"],
                     100 * ov["gather_hidden_fraction"]))


def test_sg_trace_env_writes_a_file_per_rank_at_close(tmp_path, monkeypatch):
    monkeypatch.setenv("SG_TRACE", str(tmp_path / "env-%r.json"))  # read at finalize

    def body(comm):
        with make_engine(comm) as e:
            with pytest.raises(sg.InvalidStateError, match="already recording"):
                e.trace_start()
            train(e, 2, 1)
            events, dropped = e.trace_events()  # readable while recording
            assert dropped == 0
            return events

    results = sg.run_threads(2, body)
    monkeypatch.delenv("SG_TRACE")
    for rank, events in enumerate(results):
        assert count(events, sg.TraceKind.STEP) == 2
        path = str(tmp_path / ("env-%d.json" % rank))
        check_json(path, events, rank)  # nothing was issued after trace_events


def test_misuse_raises_and_null_handles():
    comm = sg.Comm.local(1)[0]
    e = sg.Engine(comm, **FAST)
    e.add_param("w", 100)
    with pytest.raises(sg.InvalidStateError, match="sg_finalize"):
        e.trace_start()
    e.finalize()
    with pytest.raises(sg.InvalidStateError, match="sg_trace_events"):
        e.trace_events()  # before any start
    with pytest.raises(sg.InvalidStateError, match="sg_trace_write"):
        e.trace_write("/tmp/never.json")
    with pytest.raises(sg.InvalidStateError, match="not recording"):
        e.trace_stop()
    with pytest.raises(sg.InvalidStateError, match="not recording"):
        e.trace_mark("x")
    with pytest.raises(sg.InvalidArgumentError, match="max_events"):
        e.trace_start(4194305)
    with pytest.raises(sg.InvalidArgumentError, match=">= 0"):
        e.trace_start(-1)
    with pytest.raises(TypeError):
        e.trace_start(2.5)
    e.trace_start(16)
    with pytest.raises(sg.InvalidStateError, match="already recording"):
        e.trace_start(16)
    with pytest.raises(TypeError):
        e.trace_mark(b"bytes")
    with pytest.raises(sg.ShardgradIOError):
        e.trace_write("/nonexistent-dir/t.json")
    e.trace_mark("é" * 30)  # 60 bytes of UTF-8: truncated to 47, a split character replaced
    events, _ = e.trace_events()
    assert len(events) == 1 and events[0].kind == sg.TraceKind.MARK
    assert events[0].label.startswith("é" * 23) and len(events[0].label) == 24
    e.trace_stop()
    e.close()
    comm.close()
    with pytest.raises(sg.InvalidStateError, match="closed"):
        e.trace_start()
    L = _lib.load()
    n = ctypes.c_size_t()
    calls = {"sg_trace_start": (None, 0), "sg_trace_stop": (None,),
             "sg_trace_mark": (None, b"x"), "sg_trace_events": (None, None, 0, ctypes.byref(n),
                                                                 None),
             "sg_trace_write": (None, b"/tmp/x.json")}
    for name, args in calls.items():
        assert getattr(L, name)(*args) == sg.Status.ERR_INVALID_ARGUMENT, name
        assert L.sg_last_error().decode().startswith(name)


def test_dropped_counted_past_max_events():
    comm = sg.Comm.local(1)[0]
    with make_engine(comm, nparam=1, numel=1000) as e:
        e.trace_start(3)
        train(e, 3, 1)  # 3 marks + 3 x (GRAD_READY, REDUCE, STEP): 12 events
        events, dropped = e.trace_events()
        assert [ev.kind for ev in events] == [sg.TraceKind.MARK, sg.TraceKind.GRAD_READY,
                                              sg.TraceKind.REDUCE]
        assert dropped == 9
        e.trace_stop()
        e.trace_start()  # a restart clears
        assert e.trace_events() == ([], 0)
        e.trace_stop()
    comm.close()


def test_trace_context_manager_stops_also_on_error():
    comm = sg.Comm.local(1)[0]
    with make_engine(comm, nparam=2, numel=1000) as e:
        with e.trace(64) as same:
            assert same is e
            train(e, 1, 1)
        with pytest.raises(sg.InvalidStateError, match="not recording"):
            e.trace_mark("after")  # stopped by the block's end
        events, dropped = e.trace_events()  # still readable
        assert count(events, sg.TraceKind.STEP) == 1 and dropped == 0
        with pytest.raises(KeyError):
            with e.trace():
                raise KeyError("in the block")
        with pytest.raises(sg.InvalidStateError, match="not recording"):
            e.trace_stop()  # the block's exception stopped it too
        with pytest.raises(KeyError):  # a failing stop does not hide the block's exception
            with e.trace():
                e.trace_stop()
                raise KeyError("in the block")
        with e.trace():
            e.close()  # closed in the block: nothing to stop, no error
    comm.close()


def test_trace_events_retries_when_events_arrive_between_calls(monkeypatch):
    """The first call sizes the buffer; an event recorded before the copy must not be lost."""
    comm = sg.Comm.local(1)[0]
    real_call = core._call
    sized = []

    def racing_call(name, *args):
        real_call(name, *args)
        if name == "sg_trace_events" and args[2] == 0 and not sized:
            sized.append(args[3]._obj.value)
            real_call("sg_trace_mark", args[0], b"late")  # arrives after the sizing call

    with make_engine(comm, nparam=2, numel=1000) as e:
        e.trace_start()
        train(e, 1, 1)
        monkeypatch.setattr(core, "_call", racing_call)
        events, dropped = e.trace_events()
        monkeypatch.setattr(core, "_call", real_call)
        assert sized and len(events) == sized[0] + 1 and dropped == 0
        assert events[-1].kind == sg.TraceKind.MARK and events[-1].label == "late"
    comm.close()


# ------------------------------------------------------------------------------------------
# trace_overlap on hand-built events


def ev(kind, start, end=None, id=-1, step=0, label=""):
    return sg.TraceEvent(kind, id, step, float(start), float(start if end is None else end),
                         label)


GR, RED, STEP, MARK = (sg.TraceKind.GRAD_READY, sg.TraceKind.REDUCE, sg.TraceKind.STEP,
                       sg.TraceKind.MARK)
GATH, WAIT = sg.TraceKind.GATHER, sg.TraceKind.WAIT
NO_GATHER = {"gather_us": 0.0, "gather_exposed_us": 0.0, "gather_hidden_us": 0.0,
             "gather_hidden_fraction": 0.0}


def test_overlap_two_steps_known_answer():
    events = [
        ev(MARK, 0),
        ev(GR, 10),
        ev(RED, 12, 30),    # last GRAD_READY of its micro-batch at 40: 18 of 18 hidden
        ev(GR, 20),
        ev(GR, 40),
        ev(RED, 42, 50),    # starts after it: 0 of 8
        ev(STEP, 55, 60),
        ev(MARK, 100),
        ev(GR, 110),
        ev(RED, 115, 150),  # last GRAD_READY at 130: 15 of 35
        ev(GR, 130),
        ev(STEP, 160, 170),
    ]
    ov = sg.trace_overlap(events)
    assert ov == {"reduce_us": 61.0, "hidden_us": 33.0, "hidden_fraction": 33.0 / 61.0,
                  "exposed_us": 28.0, "steps": 2, **NO_GATHER}


def test_overlap_microbatch_boundaries():
    # forward, the micro-batch ends at a STEP: the next step's gradient does not count
    events = [ev(GR, 0), ev(GR, 5), ev(RED, 6, 20), ev(STEP, 21, 22), ev(GR, 30)]
    assert sg.trace_overlap(events)["hidden_us"] == 0.0
    # ... and at a MARK
    events = [ev(GR, 0), ev(RED, 1, 10), ev(MARK, 11), ev(GR, 12)]
    assert sg.trace_overlap(events)["hidden_us"] == 0.0
    # without the boundary the later gradient counts: 20 - 6 (capped at the reduction's end)
    events = [ev(GR, 0), ev(GR, 5), ev(RED, 6, 20), ev(GR, 30)]
    assert sg.trace_overlap(events)["hidden_us"] == 14.0
    # backward, the micro-batch begins after the last MARK
    events = [ev(GR, 100), ev(MARK, 0), ev(GR, 5), ev(RED, 6, 50)]
    assert sg.trace_overlap(events)["hidden_us"] == 0.0
    events = [ev(GR, 100), ev(GR, 5), ev(RED, 6, 50)]
    assert sg.trace_overlap(events)["hidden_us"] == 44.0
    # ... or after the last STEP
    events = [ev(GR, 100), ev(STEP, 0, 1), ev(GR, 5), ev(RED, 6, 50)]
    assert sg.trace_overlap(events)["hidden_us"] == 0.0


def test_overlap_without_reductions():
    assert sg.trace_overlap([]) == {"reduce_us": 0.0, "hidden_us": 0.0, "hidden_fraction": 0.0,
                                    "exposed_us": 0.0, "steps": 0, **NO_GATHER}
    ov = sg.trace_overlap([ev(MARK, 0), ev(GR, 1), ev(STEP, 2, 3)])
    assert ov["reduce_us"] == 0.0 and ov["hidden_fraction"] == 0.0 and ov["steps"] == 1
    # a REDUCE with no GRAD_READY in its micro-batch hides nothing
    ov = sg.trace_overlap([ev(MARK, 0), ev(RED, 1, 4), ev(STEP, 5, 6)])
    assert ov["reduce_us"] == 3.0 and ov["hidden_us"] == 0.0 and ov["exposed_us"] == 3.0


def test_gather_summary_known_answers():
    # two steps of two buckets (ids 1, 0); without overlap the step's end waits for the last
    # gather, with overlap the next forward pass waits bucket by bucket
    events = [
        ev(STEP, 0, 20),
        ev(GATH, 10, 18, id=1),   # 8
        ev(GATH, 20, 32, id=0),   # 12
        ev(WAIT, 20, 32, id=0),   # 12 exposed: the end of step() waited for bucket 0
        ev(MARK, 40, label="backward"),
        ev(RED, 41, 45, id=0),
        ev(STEP, 50, 70),
        ev(GATH, 60, 70, id=1),   # 10
        ev(GATH, 70, 90, id=0),   # 20
        ev(WAIT, 71, 71, id=1),   # 0: already gathered
        ev(WAIT, 75, 90, id=0),   # 15
    ]
    ov = sg.trace_overlap(events)
    assert ov["gather_us"] == 50.0 and ov["gather_exposed_us"] == 27.0
    assert ov["gather_hidden_us"] == 23.0 and ov["gather_hidden_fraction"] == 23.0 / 50.0
    assert ov["reduce_us"] == 4.0 and ov["steps"] == 2  # the old keys are unaffected
    # waits longer than the gathers (e.g. a wait that also covered queued work): clamped at 0
    ov = sg.trace_overlap([ev(GATH, 0, 10, id=0), ev(WAIT, 0, 15, id=0)])
    assert ov["gather_hidden_us"] == 0.0 and ov["gather_hidden_fraction"] == 0.0
    assert ov["gather_exposed_us"] == 15.0
    # fully hidden, and waits without gathers (W = 1 has none)
    ov = sg.trace_overlap([ev(GATH, 0, 10, id=3), ev(WAIT, 12, 12, id=3)])
    assert ov["gather_hidden_us"] == 10.0 and ov["gather_hidden_fraction"] == 1.0
    ov = sg.trace_overlap([ev(WAIT, 0, 5, id=0)])
    assert ov["gather_us"] == 0.0 and ov["gather_hidden_fraction"] == 0.0
    assert ov["gather_exposed_us"] == 5.0 and ov["gather_hidden_us"] == 0.0


def _gather_as_in_c(events):
    """The all-gather part of mlp_trace_sum and mlp_cli_trace_finish."""
    gather = sum(x.end_us - x.start_us for x in events if x.kind == GATH)
    wait = sum(x.end_us - x.start_us for x in events if x.kind == WAIT)
    hid = gather - wait if gather > wait else 0.0
    return gather, wait, hid, (hid / gather if gather > 0 else 0.0)


def _overlap_as_in_c(events):
    """mlp_trace_sum of examples/mlp/mlp_cli.h, loop for loop (quadratic)."""
    total = hidden = 0.0
    for i, x in enumerate(events):
        if x.kind != RED:
            continue
        end_bwd = -1.0
        j = i - 1
        while j >= 0 and events[j].kind not in (MARK, STEP):
            if events[j].kind == GR and events[j].start_us > end_bwd:
                end_bwd = events[j].start_us
            j -= 1
        j = i + 1
        while j < len(events) and events[j].kind not in (MARK, STEP):
            if events[j].kind == GR and events[j].start_us > end_bwd:
                end_bwd = events[j].start_us
            j += 1
        total += x.end_us - x.start_us
        if end_bwd > x.start_us:
            hidden += min(end_bwd, x.end_us) - x.start_us
    return total, hidden


def test_overlap_matches_the_c_test_definition_on_random_lists():
    rnd = random.Random(7)
    kinds = [GR, GR, GR, RED, RED, STEP, MARK, GATH, GATH, WAIT]
    for _ in range(300):
        events = []
        for _ in range(rnd.randrange(0, 40)):
            start = rnd.uniform(0, 100)
            events.append(ev(rnd.choice(kinds), start, start + rnd.uniform(0, 20)))
        total, hidden = _overlap_as_in_c(events)
        ov = sg.trace_overlap(events)
        assert ov["reduce_us"] == pytest.approx(total) and ov["hidden_us"] == pytest.approx(hidden)
        assert ov["steps"] == count(events, STEP)
        gather, wait, hid, frac = _gather_as_in_c(events)
        assert ov["gather_us"] == pytest.approx(gather)
        assert ov["gather_exposed_us"] == pytest.approx(wait)
        assert ov["gather_hidden_us"] == pytest.approx(hid)
        assert ov["gather_hidden_fraction"] == pytest.approx(frac)


# ------------------------------------------------------------------------------------------
# the example


@pytest.mark.parametrize("overlap", [False, True])
def test_train_lm_example_trace(tmp_path, overlap):
    pytest.importorskip("torch")
    out = str(tmp_path / "lm-%r.json")
    cmd = [sys.executable, os.path.join(REPO, "examples", "python", "train_lm.py"), "--ranks",
           "2", "--steps", "40", "--d", "64", "--layers", "2", "--batch", "4", "--seq", "32",
           "--micro", "2", "--log-every", "10", "--threads", "1", "--bucket-kib", "64",
           "--trace", out] + (["--overlap-gather"] if overlap else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "of the reduction time hidden behind the backward pass" in r.stdout
    line = [x for x in r.stdout.splitlines() if x.startswith("trace: all-gather ")]
    assert len(line) == 1, r.stdout
    assert "ms/step exposed" in line[0]
    assert ("hidden behind AdamW and the forward pass" in line[0]) == overlap
    for rank in (0, 1):
        with open(str(tmp_path / ("lm-%d.json" % rank))) as f:
            doc = json.load(f)
        kinds = [x["cat"] for x in doc["traceEvents"] if x["ph"] != "M"]
        nb = doc["otherData"]["buckets"]
        assert nb >= 2, nb
        # traced from after the first step: 39 steps of 2 micro-batches (marks), the first
        # under no_sync (no reductions)
        assert kinds.count("step") == 39 and kinds.count("mark") == 78
        assert kinds.count("reduce") == 39 * nb and kinds.count("gather") == 39 * nb
        if overlap:
            # the forward pass of steps 2..40 waits for the buckets of the step before it (each
            # bucket at most once; one wait may cover several)
            assert 39 <= kinds.count("wait") <= 39 * nb
        else:
            assert kinds.count("wait") == 39  # the end of each step
