"""Replica codecs and outer steps from Python: ShardedAdamW(..., replica_comm=replica, replica_codec="int8" or
"int4") on a small transformer LM, W = 4 as 2 nodes x 2 ranks, 12 steps of 2 micro-batches,
against the exact hybrid engine (f32 wire) on the same batches:
 - every rank holds the same model, bit for bit, whatever its node and codec;
 - the losses follow the exact run's, which falls from 4.04 to 2.89: int8 within 2e-3, int4
   within 5e-2 per step (measured 4.5e-4 and 2.9e-2: a code's rounding is at most half a step
   of 1/127 (int8) or 1/7 (int4) of its block's largest value, and error feedback adds the
   rest on the next step, so the run lags rather than drifts);
 - the codec's buffers show in memory_stats().comm_bytes;
 - outer steps (outer_every=4): after 12 steps (an outer step) every rank holds the same model,
   after 10 (mid-period) the nodes differ; the loss falls; with replica_codec="int8" too (the
   pseudo-gradient as int8 codes) the same, its residuals in comm_bytes;
 - streaming outer steps (outer_streaming=1: each step begins one group's sum across the nodes,
   the next step merges it before its update): at H = 1 and 2 the loss falls, a node's ranks
   hold the same model and the nodes their own, and H = 1 is not the outer steps of H = 1 (the
   merge lands a step later); bad settings refused;
 - a codec on a flat engine is refused at create, an unknown codec name is a ValueError.
"""

import copy

import numpy as np
import pytest

import shardgrad as sg

torch = pytest.importorskip("torch")

from shardgrad.torch import ShardedAdamW  # noqa: E402
from sg_models import make_batches, make_model, max_param_diff, train_sharded  # noqa: E402

STEPS, MICRO, W = 12, 2, 4
FAST = dict(timeout_ms=60000)


def body(comm, codec, batches, base, **kw):
    model = copy.deepcopy(base)
    shard, replica = comm.split_nodes(2)
    opt = ShardedAdamW(model, shard, replica_comm=replica, lr=3e-3, weight_decay=0.1,
                       replica_codec=codec, **kw, **FAST)
    try:
        losses, _ = train_sharded(model, opt, batches, comm.rank)
        comm_bytes = opt.engine.memory().comm_bytes
    finally:
        opt.close()
        shard.close()
        replica.close()
    return losses, model, comm_bytes


def test_sharded_adamw_replica_codecs():
    batches = make_batches(1, STEPS, MICRO, W, 4)
    base = make_model(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = {c: sg.run_threads(W, body, c, batches, base) for c in ("none", "int8", "int4")}
    finally:
        torch.set_num_threads(threads)
    exact = runs["none"]
    for codec, tol in (("int8", 2e-3), ("int4", 5e-2)):
        run = runs[codec]
        for r in range(W):
            assert max_param_diff(run[r][1], run[0][1])[0] == 0.0, (codec, r)
            np.testing.assert_allclose(run[r][0], exact[r][0], rtol=0, atol=tol)
            assert run[r][2] > exact[r][2], codec  # residuals and exchange buffers
    assert exact[0][0][-1] < exact[0][0][0]


def test_sharded_adamw_outer_steps():
    base = make_model(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = {(c, n): sg.run_threads(W, body, c, make_batches(1, n, MICRO, W, 4), base,
                                       outer_every=4)
                for c, n in (("none", 12), ("none", 10), ("int8", 12))}
    finally:
        torch.set_num_threads(threads)
    coded = runs["int8", 12]
    runs = {n: runs["none", n] for n in (12, 10)}
    for r in range(W):
        assert max_param_diff(runs[12][r][1], runs[12][0][1])[0] == 0.0, r
        assert max_param_diff(coded[r][1], coded[0][1])[0] == 0.0, r
        assert coded[r][2] > runs[12][r][2], r  # the codec's residuals and exchange buffers
    assert np.mean(coded[0][0][-3:]) < np.mean(coded[0][0][:3])
    assert max_param_diff(runs[10][0][1], runs[10][1][1])[0] == 0.0  # one node's two ranks
    assert max_param_diff(runs[10][2][1], runs[10][0][1])[0] > 0.0  # the nodes apart
    losses = runs[12][0][0]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])


def test_sharded_adamw_streaming_outer_steps():
    """outer_streaming=1: each step begins the sum of one group of buckets across the nodes and
    the next step merges it before its update (docs/slow-links.md). With H = 1 (every bucket
    every step) and H = 2 over small buckets the run trains, the two ranks of a node hold the
    same model and the nodes their own (each node's last update lies on top of the merge); H = 1
    differs from the non-streaming H = 1, whose outer step lands at the step itself."""
    base = make_model(0)
    batches = make_batches(1, 6, MICRO, W, 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        h1 = {s: sg.run_threads(W, body, "none", batches, base, outer_every=1, outer_streaming=s)
              for s in (0, 1)}
        h2 = sg.run_threads(W, body, "none", batches, base, outer_every=2, outer_streaming=True,
                            bucket_bytes=4096)
    finally:
        torch.set_num_threads(threads)
    for run in (h1[1], h2):
        assert max_param_diff(run[1][1], run[0][1])[0] == 0.0  # one node's two ranks
        assert max_param_diff(run[3][1], run[2][1])[0] == 0.0
        assert max_param_diff(run[2][1], run[0][1])[0] > 0.0  # the nodes apart
        assert np.mean(run[0][0][-2:]) < np.mean(run[0][0][:2])
    assert max_param_diff(h1[1][0][1], h1[0][0][1])[0] > 0.0


def test_replica_codec_refused():
    comms = sg.Comm.local(1)
    try:
        with pytest.raises(sg.InvalidArgumentError, match="replica_codec"):
            ShardedAdamW(make_model(0), comms[0], replica_codec="int8")
        with pytest.raises(ValueError, match="Codec"):
            sg.Config(replica_codec="int2")
        with pytest.raises(sg.InvalidArgumentError, match="outer_every"):
            ShardedAdamW(make_model(0), comms[0], outer_every=8)
        with pytest.raises(sg.InvalidArgumentError, match="outer_streaming needs outer steps"):
            sg.Config(outer_streaming=1)
        with pytest.raises(sg.InvalidArgumentError, match="outer_streaming must be 0 or 1"):
            sg.Config(outer_every=2, outer_streaming=2)
    finally:
        comms[0].close()
