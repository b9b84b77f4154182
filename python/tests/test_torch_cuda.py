"""shardgrad on a CUDA GPU through torch: ShardedAdamW on CUDA parameters, the engine's zero-copy
CUDA tensors, and tracing on the CUDA device. Skipped unless torch sees a GPU and the library
was built with CUDA (sg.has_backend("cuda")); tests/gpu/run.sh runs it on a GPU machine, with
SG_TEST_REQUIRE_CUDA=1, which turns the skip into an error.

Ranks as threads all share cuda:0 (local communicator), each thread with its own CUDA stream,
as a real program would have one stream per rank. ShardedAdamW is checked against
torch.optim.AdamW (single-tensor path) on the same CUDA model and data: the reference is
computed on the GPU too, since GPU matmul and attention kernels round differently from the CPU
ones (comparing with a CPU run would measure the kernels, not the optimizer). The reference
takes each rank's slice separately, sums and divides by W (DDP's gradients, as TOL_DDP in
test_torch.py), so the two runs execute the same kernels on the same shapes; attention uses
the math backend, which has no atomics. What still differs is the order of a few float32
sums (rank and micro-batch accumulation, the gradient norm) and the fused AdamW kernel against
torch's: on the CPU these give ~3e-7 after 20 steps (test_torch.py). TOL = 5e-5 is
test_torch.py's bound for its looser reference; it leaves room for Adam amplifying the
rounding of near-zero gradients (1.1e-5 seen once on the CPU), and is still 60x below one
step's change of a parameter (lr = 3e-3), so a missed, stale or doubled gradient fails.
Rank replicas must agree bitwise.
"""

import copy
import functools
import os

import pytest

torch = pytest.importorskip("torch")

import shardgrad as sg  # noqa: E402
from shardgrad.torch import ShardedAdamW  # noqa: E402
from sg_models import (lm_loss, make_batches, make_model, max_param_diff,  # noqa: E402
                       torch_reference, train_sharded)


def _why_skip():
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    if not sg.has_backend("cuda"):  # checked only with a GPU: loading errors show there
        return "libshardgrad (%s) was built without CUDA" % sg.library_path()
    return None


WHY = _why_skip()
if WHY is not None and os.environ.get("SG_TEST_REQUIRE_CUDA") == "1":
    # tests/gpu/run.sh: all tests skipped would read as a pass
    raise RuntimeError("SG_TEST_REQUIRE_CUDA=1, but " + WHY)
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")

HERE = os.path.dirname(os.path.abspath(__file__))
DEV = torch.device("cuda", 0)
TOL = 5e-5
STEPS = 10
CLIP = 0.5
HP = dict(lr=3e-3, weight_decay=0.1)
FAST = dict(timeout_ms=60000)


@pytest.fixture(autouse=True, scope="module")
def _math_attention():
    # scaled_dot_product_attention through the math backend on every thread (a global flag):
    # deterministic, so that the reference and the ranks run bitwise the same attention.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        yield


def on_rank_stream(fn, *args):
    """fn(stream, *args) on cuda:0 inside a stream of this thread's own; waits for it."""
    torch.cuda.set_device(DEV)
    s = torch.cuda.Stream(DEV)
    with torch.cuda.stream(s):
        out = fn(s, *args)
    s.synchronize()
    return out


def to_dev(batches):
    return [[[t.to(DEV) for t in micro] for micro in step] for step in batches]


@functools.lru_cache(maxsize=None)
def reference(world, micro):
    base = make_model(0).to(DEV)
    batches = to_dev(make_batches(1, STEPS, micro, world, 4))
    ref, losses, norms, _ = torch_reference(base, batches, max_grad_norm=CLIP, per_rank=True,
                                            **HP)
    torch.cuda.synchronize()
    return base, batches, ref, losses, norms


# ------------------------------------------------------------------------------------------
# (a) ShardedAdamW on CUDA parameters against torch.optim.AdamW on the GPU

CASES = [
    # world, micro-batches, no_sync for all but the last, stream the ranks run on
    (1, 2, True, "rank"),     # gradients handed over from torch's autograd hooks
    (1, 1, False, "default"),  # torch's default stream: the engine gets a stream of its own
    (2, 1, False, "rank"),    # ranks as threads: gradients handed over at step()
    (2, 2, True, "rank"),
    (2, 1, False, "default"),
]


@pytest.mark.parametrize("world,micro,no_sync,stream", CASES)
def test_sharded_adamw_matches_torch_adamw_on_cuda(world, micro, no_sync, stream):
    base, batches, ref, ref_losses, ref_norms = reference(world, micro)
    models = [copy.deepcopy(base) for _ in range(world)]
    torch.cuda.synchronize()  # the copies are complete before the rank streams read them

    def work(s, comm):
        m = models[comm.rank]
        opt = ShardedAdamW(m, comm, strategy="shard_grad_op", max_grad_norm=CLIP,
                           bucket_bytes=8192, **HP, **FAST)
        losses, infos = train_sharded(m, opt, batches, comm.rank, use_no_sync=no_sync)
        e = opt.engine
        facts = dict(
            device=(e.config.device, e.config.cuda_device),
            defer=opt._defer,
            stream_ok=(opt._stream == s if stream == "rank"
                       else opt._stream.cuda_stream != 0),
            on_gpu=all(p.device == DEV for p in m.parameters()),
            zero_copy=all(p.data_ptr() == e.param_ptr(opt.param_id(p))
                          for p in m.parameters() if p.requires_grad),
            mem=opt.memory())
        opt.close()
        return losses, infos, facts

    def body(comm):
        if stream == "rank":
            return on_rank_stream(work, comm)
        torch.cuda.set_device(DEV)
        out = work(None, comm)
        torch.cuda.synchronize()
        return out

    results = sg.run_threads(world, body)
    torch.cuda.synchronize()
    diff, scale = max_param_diff(models[0], ref)
    for m in models[1:]:
        for a, b in zip(models[0].parameters(), m.parameters()):
            assert torch.equal(a, b), "rank replicas differ"
    infos = results[0][1]
    norm_err = max(abs(i.grad_norm - n) / n for i, n in zip(infos, ref_norms))
    losses = [sum(r[0][k] for r in results) / world for k in range(STEPS)]
    loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
    facts = results[0][2]
    print("W=%d micro=%d no_sync=%s stream=%s (gradients %s): max |param - torch| = %.3g "
          "(|param| <= %.2f), grad-norm rel err %.2g, loss err %.2g, loss %.3f -> %.3f; "
          "shard %d of %d" % (world, micro, no_sync, stream,
                              "at step()" if facts["defer"] else "from the hooks", diff, scale,
                              norm_err, loss_err, ref_losses[0], ref_losses[-1],
                              facts["mem"].shard_numel, facts["mem"].numel))
    for r in results:
        f = r[2]
        assert f["device"] == (sg.Device.CUDA, 0)
        assert f["defer"] == (world > 1)
        assert f["stream_ok"] and f["on_gpu"] and f["zero_copy"]
    assert all(p.device == DEV for p in models[0].parameters())  # still, after close()
    assert [i.step for i in infos] == list(range(1, STEPS + 1))
    assert min(i.clip_coef for i in infos) < 1.0  # clipping was active
    assert diff <= TOL
    assert norm_err <= 1e-4
    assert loss_err <= 1e-4
    assert ref_losses[-1] < ref_losses[0] - 0.3  # it learns
    assert facts["mem"].shard_numel * world == facts["mem"].numel


def test_overlap_param_gather_on_cuda_bitwise():
    """overlap_param_gather on CUDA, W = 2 on rank streams: the forward pre-hooks make the
    rank's stream (not the host) wait for each module's bucket; losses and parameters are
    bitwise those of the run without overlap."""
    base, batches = reference(2, 1)[:2]
    out = {}
    for overlap in (False, True):
        models = [copy.deepcopy(base) for _ in range(2)]
        torch.cuda.synchronize()

        def work(s, comm):
            m = models[comm.rank]
            opt = ShardedAdamW(m, comm, max_grad_norm=CLIP, bucket_bytes=8192,
                               overlap_param_gather=overlap, **HP, **FAST)
            hooked = sum(len(mod._forward_pre_hooks) for mod in m.modules())
            losses, _ = train_sharded(m, opt, batches, comm.rank)
            opt.close()
            return losses, hooked, sum(len(mod._forward_pre_hooks) for mod in m.modules())

        res = sg.run_threads(2, lambda c: on_rank_stream(work, c))
        torch.cuda.synchronize()
        out[overlap] = (res, [p.detach().cpu() for p in models[0].parameters()])
    (off, p_off), (on, p_on) = out[False], out[True]
    for r in range(2):
        assert off[r][0] == on[r][0]  # losses
        assert off[r][1] == 0 and on[r][1] > 0 and on[r][2] == 0  # hooks only with overlap
    for a, b in zip(p_off, p_on):
        assert torch.equal(a, b)
    print("CUDA W=2 overlap_param_gather: %d steps bitwise equal to no overlap, loss %.3f -> "
          "%.3f" % (len(on[0][0]), on[0][0][0], on[0][0][-1]))


def test_gradients_leave_grad_as_documented():
    """W = 1: each gradient goes to the library during backward (.grad then holds no plain
    tensor: a ShardGrad standing for the library's gradient, docs/torch-grads.md); W = 2 as
    threads: the plain gradients stay in .grad until step() takes them."""
    base, batches = reference(2, 1)[:2]

    def work(s, comm):
        m = copy.deepcopy(base)
        opt = ShardedAdamW(m, comm, **HP, **FAST)
        seen = []
        for step in batches[:2]:
            lm_loss(m, step[0][comm.rank]).backward()
            seen.append(sum(type(p.grad) is torch.Tensor for p in m.parameters()))
            opt.step()
            seen.append(sum(type(p.grad) is torch.Tensor for p in m.parameters()))
        opt.close()
        return seen, sum(p.requires_grad for p in m.parameters())

    (seen1, n), = sg.run_threads(1, lambda c: on_rank_stream(work, c))
    # the first backward keeps .grad until its end (it decides the parameter order)
    assert seen1 == [0, 0, 0, 0], seen1
    for seen2, n in sg.run_threads(2, lambda c: on_rank_stream(work, c)):
        assert seen2 == [n, 0, n, 0], seen2


# ------------------------------------------------------------------------------------------
# (b) the engine's zero-copy CUDA tensors

SHAPES = [(3, 5), (7,), (64, 33)]


def _engine_views(s):
    comm = sg.Comm.local(1)[0]
    e = sg.Engine(comm, device="cuda", cuda_device=0, lr=0.1, weight_decay=0.0,
                  max_grad_norm=0.0, bucket_bytes=4096, **FAST)
    try:
        ids = [e.add_param("w%d" % k, shape) for k, shape in enumerate(SHAPES)]
        e.finalize()
        e.set_stream(s)
        g = torch.Generator().manual_seed(3)
        vals = [torch.randn(shape, generator=g) for shape in SHAPES]
        for pid, v in zip(ids, vals):
            e.set_param(pid, v)
        for pid, v, shape in zip(ids, vals, SHAPES):
            t = e.param_tensor(pid)
            assert t.device == DEV and t.dtype == torch.float32 and tuple(t.shape) == shape
            assert t.data_ptr() == e.param_ptr(pid)
            assert torch.equal(t.cpu(), v)
        # a write through the view is the engine's parameter
        t = e.param_tensor(ids[0])
        t.fill_(0.25)
        s.synchronize()
        assert (e.get_param(ids[0]) == 0.25).all()
        e.set_param(ids[0], vals[0])
        # gradient slots: zeroed CUDA views of this micro-batch; what is written there is the
        # gradient the step uses (Adam's first step moves each element by lr * sign(g))
        grads = [torch.randn(shape, generator=g) for shape in SHAPES]
        for pid, gr, shape in zip(ids, grads, SHAPES):
            gt = e.grad_tensor(pid)
            assert gt.device == DEV and gt.dtype == torch.float32 and tuple(gt.shape) == shape
            assert gt.data_ptr() == e.grad_ptr(pid)
            assert torch.count_nonzero(gt).item() == 0
            gt.copy_(gr)
            e.grad_ready(pid)
        info = e.step()
        assert info.step == 1 and not info.skipped
        worst = 0.0
        for pid, v, gr in zip(ids, vals, grads):
            want = v.double() - 0.1 * gr.double() / (gr.double().abs() + 1e-8)
            got = e.param_tensor(pid).double().cpu()
            worst = max(worst, (got - want).abs().max().item())
        print("engine views on %s: params and gradient slots zero-copy, first step within "
              "%.2g of lr * sign(g)" % (DEV, worst))
        assert worst <= 1e-6
    finally:
        e.close()
        comm.close()


def test_engine_param_and_grad_tensors_are_zero_copy_cuda():
    on_rank_stream(_engine_views)


# ------------------------------------------------------------------------------------------
# (c) tracing on the CUDA device, as test_trace.py on the CPU


@pytest.mark.parametrize("world,mb", [(1, 1), (2, 2)])
def test_trace_counts_and_causality_on_cuda(world, mb, tmp_path):
    if not sg._lib.has("sg_trace_start"):
        pytest.skip("the library predates the tracing API")
    import test_trace as tt
    steps = 3

    def work(s, comm):
        with tt.make_engine(comm, device="cuda", cuda_device=0) as e:
            e.set_stream(s)
            e.trace_start(4096)
            tt.train(e, steps, mb)
            e.trace_stop()
            events, dropped = e.trace_events()
            e.trace_write(str(tmp_path / "cuda-%r.json"))
            return events, dropped

    results = sg.run_threads(world, lambda c: on_rank_stream(work, c))
    for rank, (events, dropped) in enumerate(results):
        assert dropped == 0
        doc = tt.check_json(str(tmp_path / ("cuda-%d.json" % rank)), events, rank)
        nb = doc["otherData"]["buckets"]
        assert nb >= 2, nb
        assert doc["otherData"]["world"] == world
        assert tt.buckets_per_microbatch(events) == [list(range(nb))] * (mb * steps)
        assert tt.count(events, sg.TraceKind.REDUCE) == nb * mb * steps
        assert tt.count(events, sg.TraceKind.GRAD_READY) == tt.NPARAM * mb * steps
        assert tt.count(events, sg.TraceKind.MARK) == mb * steps
        assert tt.count(events, sg.TraceKind.STEP) == steps
        assert tt.count(events, sg.TraceKind.GATHER) == (steps if world > 1 else 0)
        tt.check_causality(events)
        ov = sg.trace_overlap(events)
        assert ov["steps"] == steps and 0.0 <= ov["hidden_us"] <= ov["reduce_us"]
        if rank == 0:
            print("CUDA W=%d mb=%d: %d events, %d buckets, reductions %.1f us, %.0f%% hidden"
                  % (world, mb, len(events), nb, ov["reduce_us"], 100 * ov["hidden_fraction"]))
