"""shardgrad.torch.ShardedAdamW against torch.optim.AdamW on a small transformer LM.

Two references, both torch.optim.AdamW (single-tensor path) in one process, 20 steps
(lr 3e-3, weight decay 0.1, clipping at 0.5, 1-3 micro-batches), parameters up to ~4 in size:
 - the combined batch (all ranks' data in one batch): every parameter within TOL = 5e-5;
 - DDP's gradients (each rank's slice separately, summed, divided by W): within TOL_DDP = 2e-6.
Measured: ~3e-7 against DDP's gradients (a few float32 ulps: a different summation order). Against
the combined batch also ~3e-7, except at W = 3 where torch itself differs by 1.1e-5 between
the two references: one element of an attention key weight has a gradient of 3e-8 (|g| ~ eps)
and Adam turns its rounding into a 1e-5 step difference. Rank replicas must agree bitwise.
"""

import copy
import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import shardgrad as sg  # noqa: E402
from shardgrad.torch import ShardedAdamW, ShardGrad  # noqa: E402
from sg_models import (lm_loss, make_batches, make_model, max_param_diff,  # noqa: E402
                       param_groups_like_sharded, torch_reference, train_sharded)

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 5e-5
TOL_DDP = 2e-6
STEPS = 20
HP = dict(lr=3e-3, weight_decay=0.1)
FAST = dict(timeout_ms=60000)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@functools.lru_cache(maxsize=None)
def reference(world, micro, clip):
    base = make_model(0)
    batches = make_batches(1, STEPS, micro, world, 4)
    ref, losses, norms, _ = torch_reference(base, batches, max_grad_norm=clip, **HP)
    return base, batches, ref, losses, norms


@functools.lru_cache(maxsize=None)
def ddp_reference(world, micro, clip):
    base, batches = reference(world, micro, clip)[:2]
    return torch_reference(base, batches, max_grad_norm=clip, per_rank=True, **HP)[0]


def run_sharded(world, micro, clip, strategy, no_sync, defer=False, **extra):
    base, batches, ref, ref_losses, ref_norms = reference(world, micro, clip)
    models = [copy.deepcopy(base) for _ in range(world)]  # built here: torch RNG is global

    def body(comm):
        m = models[comm.rank]
        opt = ShardedAdamW(m, comm, strategy=strategy, max_grad_norm=clip, bucket_bytes=8192,
                           **HP, **FAST, **extra)
        if defer:
            # the mode ShardedAdamW takes on its own for CUDA ranks as threads (gradients wait
            # in .grad and reach the library in step()), here on the CPU
            opt._defer = True
        losses, infos = train_sharded(m, opt, batches, comm.rank, use_no_sync=no_sync)
        mem = opt.memory()
        opt.close()
        return losses, infos, mem

    results = sg.run_threads(world, body)
    return models, results, ref, ref_losses, ref_norms


CASES = [
    # world, micro-batches, clip, strategy, no_sync for all but the last micro-batch
    (1, 2, 0.5, "shard_grad_op", True),
    (2, 2, 0.5, "shard_grad_op", False),
    (2, 3, 0.5, "shard_grad_op", True),
    (2, 1, 0.0, "shard_grad_op", False),
    (2, 2, 0.5, "no_shard", True),
    (3, 1, 0.5, "shard_opt", False),
]


@pytest.mark.parametrize("world,micro,clip,strategy,no_sync", CASES)
def test_matches_torch_adamw(world, micro, clip, strategy, no_sync):
    models, results, ref, ref_losses, ref_norms = run_sharded(world, micro, clip, strategy,
                                                              no_sync)
    diff, scale = max_param_diff(models[0], ref)
    diff_ddp, _ = max_param_diff(models[0], ddp_reference(world, micro, clip))
    for m in models[1:]:
        for a, b in zip(models[0].parameters(), m.parameters()):
            assert torch.equal(a, b), "rank replicas differ"
    infos = results[0][1]
    assert [i.step for i in infos] == list(range(1, STEPS + 1))
    norm_err = max(abs(i.grad_norm - n) / n for i, n in zip(infos, ref_norms))
    # the global loss is the mean of the ranks' losses
    losses = np.mean([r[0] for r in results], axis=0)
    loss_err = np.max(np.abs(losses - np.array(ref_losses)))
    mem = results[0][2]
    print("W=%d %s micro=%d clip=%g no_sync=%s: max |param - torch| = %.3g combined batch, "
          "%.3g DDP gradients (|param| <= %.2f), grad-norm rel err %.2g, loss err %.2g, "
          "loss %.3f -> %.3f; shard %d of %d elements"
          % (world, strategy, micro, clip, no_sync, diff, diff_ddp, scale, norm_err, loss_err,
             ref_losses[0], ref_losses[-1], mem.shard_numel, mem.numel))
    assert diff <= TOL
    assert diff_ddp <= TOL_DDP
    assert norm_err <= 1e-4
    assert loss_err <= 1e-4
    assert ref_losses[-1] < ref_losses[0] - 0.5  # it learns
    if clip:
        assert min(i.clip_coef for i in infos) < 1.0  # clipping was active
    if strategy != "no_shard":
        assert mem.shard_numel * world == mem.numel


@pytest.mark.parametrize("world,micro,no_sync", [(2, 2, False), (2, 3, True)])
def test_deferred_hand_over_matches_torch_adamw(world, micro, no_sync):
    models, results, ref, ref_losses, _ = run_sharded(world, micro, 0.5, "shard_grad_op",
                                                      no_sync, defer=True)
    diff, _ = max_param_diff(models[0], ref)
    for m in models[1:]:
        for a, b in zip(models[0].parameters(), m.parameters()):
            assert torch.equal(a, b), "rank replicas differ"
    assert [i.step for i in results[0][1]] == list(range(1, STEPS + 1))
    # torch sums the micro-batches in .grad before the hand-over: the same tolerance
    assert diff <= TOL
    assert ref_losses[-1] < ref_losses[0] - 0.5


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_matches_torch_adamw_under_mpirun(tmp_path):
    if not sg.has_backend("mpi"):
        pytest.skip("libshardgrad built without MPI")
    out = str(tmp_path / "res")
    env = dict(os.environ, OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1")
    cmd = ["mpirun", "-np", "2", "--oversubscribe", "--allow-run-as-root", sys.executable,
           os.path.join(HERE, "mpi_helper.py"), out, "shard_grad_op", "2", "1", "0.5"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    res = [json.load(open("%s.%d.json" % (out, k))) for k in range(2)]
    assert [x["rank"] for x in res] == [0, 1] and all(x["world"] == 2 for x in res)
    assert res[0]["sha"] == res[1]["sha"], "rank replicas differ"
    norm_err = max(abs(a - b) / b for a, b in zip(res[0]["norms"], res[0]["ref_norms"]))
    print("mpirun -np 2 SHARD_GRAD_OP micro=2 (no_sync) clip=0.5: max |param - torch| = %.3g, "
          "grad-norm rel err %.2g, loss %.3f -> %.3f, shard %d of %d"
          % (res[0]["diff"], norm_err, res[0]["first_loss"], res[0]["last_loss"],
             res[0]["shard_numel"], res[0]["numel"]))
    assert max(x["diff"] for x in res) <= TOL
    assert norm_err <= 1e-4
    assert res[0]["shard_numel"] * 2 == res[0]["numel"]


# ------------------------------------------------------------------------------------------
# behaviour of the optimizer object


def _single(model, **kw):
    comm = sg.Comm.local(1)[0]
    return ShardedAdamW(model, comm, **FAST, **kw), comm


def test_zero_copy_params_and_grads_dropped():
    model = make_model(0)
    frozen_ptr = model.frozen_gain.data_ptr()
    opt, comm = _single(model, lr=1e-3)
    tokens = make_batches(1, 1, 1, 1, 2)[0][0][0]
    lm_loss(model, tokens).backward()
    e = opt.engine
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # handed to the library; .grad stands for the reduced gradient held there
        assert isinstance(p.grad, ShardGrad), name
        assert p.data_ptr() == e.param_ptr(opt.param_id(p)), name
    assert model.frozen_gain.data_ptr() == frozen_ptr  # left alone
    assert model.frozen_gain.grad is None
    assert e.num_params == sum(1 for p in model.parameters() if p.requires_grad)
    # a write through the library's view shows in the model (and vice versa)
    view = e.param_tensor(opt.param_id(model.head.bias))
    view[0] = 42.0
    assert model.head.bias[0].item() == 42.0
    with torch.no_grad():
        model.head.bias[1] = -7.0
    assert e.get_param(opt.param_id(model.head.bias))[1] == -7.0
    opt.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.close()  # parameters copied back into torch memory, still usable
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
        if p.requires_grad:
            assert p.data_ptr() != 0
    lm_loss(model, tokens).backward()  # the model still trains with plain torch
    assert model.head.weight.grad is not None
    assert not e.closed  # `view` and `e` still refer to it
    assert torch.equal(view, model.head.bias)  # still the library's memory, still valid
    alive = weakref.ref(e)
    comm.close()  # deferred: the engine goes first
    assert not comm.closed
    del view, e
    assert alive() is None and comm.closed


def test_weight_decay_like_torch_and_1d_exemption_on_request():
    lr, wd = 0.1, 0.5
    f = float(np.float32(1 - lr * wd))
    for no_decay in (None, "1d"):
        lin = torch.nn.Linear(4, 3)
        w0, b0 = lin.weight.detach().clone(), lin.bias.detach().clone()
        opt, comm = _single(lin, lr=lr, weight_decay=wd, no_decay=no_decay)
        for _ in range(3):
            (lin(torch.ones(2, 4)) * 0.0).sum().backward()  # zero gradients: only decay acts
            opt.step()
        torch.testing.assert_close(lin.weight.detach(), w0 * f ** 3, rtol=1e-6, atol=1e-7)
        if no_decay is None:  # torch.optim.AdamW's default: the bias decays too
            torch.testing.assert_close(lin.bias.detach(), b0 * f ** 3, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(lin.bias.detach(), b0)  # 1-D: no decay
        opt.close()
        comm.close()
    with pytest.raises(ValueError, match="no_decay"):
        ShardedAdamW(torch.nn.Linear(2, 2), sg.Comm.local(1)[0], no_decay="2d")
    # told otherwise: decay everything except names listed
    lin2 = torch.nn.Linear(4, 3)
    b0 = lin2.bias.detach().clone()
    w0 = lin2.weight.detach().clone()
    opt, comm = _single(lin2, lr=lr, weight_decay=wd, no_decay={"weight"})
    (lin2(torch.ones(2, 4)) * 0.0).sum().backward()
    opt.step()
    torch.testing.assert_close(lin2.bias.detach(), b0 * f, rtol=1e-6, atol=1e-7)
    assert torch.equal(lin2.weight.detach(), w0)
    opt.close()
    comm.close()


def test_lr_scheduler_drives_the_library_lr():
    base = make_model(0)
    batches = make_batches(2, 8, 1, 1, 4)
    ref = copy.deepcopy(base)
    ropt = torch.optim.AdamW(param_groups_like_sharded(ref, 0.1), lr=3e-3, foreach=False)
    rs = torch.optim.lr_scheduler.StepLR(ropt, step_size=2, gamma=0.5)
    model = copy.deepcopy(base)
    opt, comm = _single(model, lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    seen = []
    for step in batches:
        lm_loss(ref, step[0][0]).backward()
        ropt.step()
        ropt.zero_grad()
        rs.step()
        lm_loss(model, step[0][0]).backward()
        opt.step()
        seen.append(opt.engine.lr)
        sched.step()
    assert seen == [pytest.approx(3e-3 * 0.5 ** (k // 2)) for k in range(8)]
    diff, _ = max_param_diff(model, ref)
    print("StepLR over 8 steps: lr %s, max |param - torch| = %.3g" % (seen, diff))
    assert diff <= TOL
    opt.lr = 1e-4  # the setter writes param_groups, read at the next step
    assert opt.param_groups[0]["lr"] == 1e-4
    opt.param_groups[0]["betas"] = (0.8, 0.9)
    with pytest.raises(sg.UnsupportedError, match="lr"):
        opt.step()
    opt.close()
    comm.close()


def test_state_dict_matches_torch_state():
    base = make_model(0)
    batches = make_batches(3, 4, 1, 2, 4)
    ref, _, _, ropt = torch_reference(base, batches, **HP)
    models = [copy.deepcopy(base) for _ in range(2)]

    def body(comm):
        m = models[comm.rank]
        opt = ShardedAdamW(m, comm, **HP, **FAST)
        train_sharded(m, opt, batches, comm.rank)
        sd = opt.state_dict()  # collective
        masters = opt.master_weights()
        opt.close()
        return sd, masters

    (sd, masters), (sd1, _) = sg.run_threads(2, body)
    rstate = {id(p): s for p, s in ropt.state.items()}
    named = [(n, p) for n, p in ref.named_parameters() if p.requires_grad]
    assert sd["names"] == [n for n, _ in named]
    worst = 0.0
    for i, (n, p) in enumerate(named):
        st = sd["state"][i]
        assert float(st["step"]) == 4.0
        for key in ("exp_avg", "exp_avg_sq"):
            want = rstate[id(p)][key]
            worst = max(worst, ((st[key] - want).abs().max() / want.abs().max().clamp_min(
                1e-12)).item())
            assert torch.equal(st[key], sd1["state"][i][key])  # every rank gets the full state
        torch.testing.assert_close(masters[n], p.detach(), rtol=0, atol=TOL)
        torch.testing.assert_close(st["master"], p.detach(), rtol=0, atol=TOL)
    print("state_dict: max relative difference of exp_avg/exp_avg_sq vs torch = %.3g" % worst)
    assert worst < 1e-3
    assert sd["param_groups"][0]["lr"] == HP["lr"]


def test_save_at_w2_load_at_w1_continues_training(tmp_path):
    """ShardedAdamW.save by 2 thread ranks, load into a fresh model at W=1: the model's
    parameters become the saved ones in place, and the next steps match a run at W=1 that
    continues from the same state (same data on every rank, so W does not matter)."""
    base = make_model(0)
    batches = make_batches(5, 6, 1, 1, 4)
    models = [copy.deepcopy(base) for _ in range(2)]
    ck = str(tmp_path / "ck")

    def body(comm):
        m = models[comm.rank]
        opt = ShardedAdamW(m, comm, **HP, **FAST)
        for step in batches[:3]:
            lm_loss(m, step[0][0]).backward()  # every rank the same data
            opt.step()
        opt.save(ck)
        for step in batches[3:]:
            lm_loss(m, step[0][0]).backward()
            opt.step()
        opt.close()

    sg.run_threads(2, body)
    fresh = make_model(1)
    opt, comm = _single(fresh, param_order="registration", **HP)
    opt.load(ck)
    if sg._lib.has("sg_get_step"):
        assert opt.step_count == 3
    for step in batches[3:]:
        lm_loss(fresh, step[0][0]).backward()
        opt.step()
    diff, _ = max_param_diff(fresh, models[0])
    print("continued after save at W=2 / load at W=1: max |param diff| = %.3g" % diff)
    assert diff <= TOL_DDP
    assert opt.last_step_info.step == 6
    opt.close()
    comm.close()


def test_bf16_params_train_and_loss_falls():
    """A bf16 model: param_dtype follows the parameters, the library keeps fp32 masters."""
    base = make_model(0).to(torch.bfloat16)
    batches = make_batches(4, 15, 1, 2, 8)
    models = [copy.deepcopy(base) for _ in range(2)]

    def body(comm):
        m = models[comm.rank]
        opt = ShardedAdamW(m, comm, **HP, **FAST)
        losses = []
        for step in batches:
            loss = lm_loss(m, step[0][comm.rank])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        cfg, mem = opt.engine.config, opt.memory()
        dtypes = {p.dtype for p in m.parameters() if p.requires_grad}
        opt.close()
        return losses, dtypes, cfg, mem

    (l0, d0, cfg, mem), (l1, *_) = sg.run_threads(2, body)
    assert cfg.param_dtype == sg.DType.BF16 and cfg.effective_grad_dtype == sg.DType.BF16
    assert d0 == {torch.bfloat16}
    assert mem.master_bytes == 4 * mem.shard_numel  # fp32 master of this rank's shard
    print("bf16 W=2: loss %.3f -> %.3f; %s" % ((l0[0] + l1[0]) / 2, (l0[-1] + l1[-1]) / 2, mem))
    assert (l0[-1] + l1[-1]) / 2 < (l0[0] + l1[0]) / 2 - 0.3
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


class Reordered(torch.nn.Module):
    """Registered output layer first: named_parameters order is not execution order."""

    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(64, 8)
        self.mid = torch.nn.Linear(64, 64)
        self.inp = torch.nn.Linear(16, 64)

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


def test_param_order_backward_needs_no_extra_staging():
    """With param_order='backward' the plan follows gradient arrival, and SHARD_GRAD_OP keeps
    its planned staging buckets; in named_parameters order the output layer's gradients
    arrive first but are reduced last, so the library must allocate extra staging buckets
    (and warns)."""
    grads = {}
    for order in ("backward", "registration"):
        torch.manual_seed(0)
        base = Reordered()
        models = [copy.deepcopy(base) for _ in range(2)]

        def body(comm):
            m = models[comm.rank]
            opt = ShardedAdamW(m, comm, bucket_bytes=4096, param_order=order, **FAST)
            seen = []
            for _ in range(3):
                m(torch.ones(4, 16)).square().mean().backward()
                seen.append(opt.memory().grads_bytes)
                opt.step()
            opt.close()
            return seen

        grads[order] = sg.run_threads(2, body)[0]
    print("gradient bytes per rank over 3 steps: %s" % grads)
    assert len(set(grads["backward"])) == 1
    assert grads["registration"][0] > grads["backward"][0]


# ------------------------------------------------------------------------------------------
# overlap_param_gather: forward pre-hooks wait for each module's own parameters


class Permuted(torch.nn.Module):
    """Four square layers applied in a different order at every step (set .order), a
    parameter owned by the root module, and an output layer tied to the input embedding (one
    parameter held by two modules): the forward order is never the registration order."""

    def __init__(self, d=32, vocab=24):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(4))
        self.gain = torch.nn.Parameter(torch.ones(d))
        self.out = torch.nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight
        self.order = [0, 1, 2, 3]

    def forward(self, x):
        h = self.emb(x)
        for k in self.order:
            h = h + torch.tanh(self.layers[k](h))
        return self.out(h * self.gain)


ORDERS = [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1], [1, 3, 0, 2]]


def _permuted_run(overlap, param_order, steps=6):
    """W=2 ranks as threads; returns per rank (losses, step infos, final parameters, what the
    wait log saw, hooks while open, hooks after close)."""
    torch.manual_seed(0)
    base = Permuted()
    models = [copy.deepcopy(base) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 24, (2, 4, 9), generator=g) for _ in range(steps)]

    def body(comm):
        m = models[comm.rank]
        opt = ShardedAdamW(m, comm, lr=1e-2, bucket_bytes=4096, staging_buckets=16,
                           param_order=param_order, overlap_param_gather=overlap, **FAST)
        # Records param_wait calls, and checks in a pre-hook registered after ShardedAdamW's
        # (hooks run in registration order) that every parameter of the module was waited for
        # since the last step, whatever order the forward pass takes.
        waited, bad = set(), []
        real_wait = opt.engine.param_wait

        def logging_wait(pid=-1):
            waited.add(pid)
            real_wait(pid)

        opt.engine.param_wait = logging_wait
        names = {id(p): n for n, p in m.named_parameters()}

        def check(mod, args):
            if not opt._ready or opt.last_step_info is None:
                return  # before the first step nothing is pending
            for p in mod.parameters(recurse=False):
                if opt.param_id(p) not in waited:
                    bad.append(names[id(p)])

        hooked = {n: len(mod._forward_pre_hooks) for n, mod in m.named_modules()}
        checks = [mod.register_forward_pre_hook(check) for mod in m.modules()]
        losses, infos = [], []
        for s, x in enumerate(data):
            m.order = ORDERS[s % len(ORDERS)]
            y = x[comm.rank]
            logits = m(y[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     y[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            waited.clear()
            losses.append(loss.item())
            infos.append(opt.last_step_info)
        with torch.no_grad():
            m.order = [3, 1, 2, 0]
            losses.append(torch.nn.functional.cross_entropy(
                m(data[0][comm.rank][:, :-1]).reshape(-1, 24),
                data[0][comm.rank][:, 1:].reshape(-1)).item())  # an eval pass after training
        for h in checks:
            h.remove()
        opt.close()
        after = {n: len(mod._forward_pre_hooks) for n, mod in m.named_modules()}
        params = {n: p.detach().clone() for n, p in m.named_parameters()}
        return losses, infos, params, bad, hooked, after

    return sg.run_threads(2, body)


@pytest.mark.parametrize("param_order", ["backward", "registration"])
def test_overlap_param_gather_bitwise_equal_and_hooks(param_order):
    """With overlap_param_gather the losses, gradient norms and final parameters are bitwise
    those of the run without it, although the forward order changes every step and one
    parameter is tied across two modules; each module's pre-hook waited for exactly its own
    parameters before it ran; the hooks sit on the modules that own parameters and are gone
    after close()."""
    off = _permuted_run(False, param_order)
    on = _permuted_run(True, param_order)
    for rank in range(2):
        l0, i0, p0, _, hooked0, after0 = off[rank]
        l1, i1, p1, bad, hooked1, after1 = on[rank]
        assert l0 == l1
        assert [i.grad_norm for i in i0] == [i.grad_norm for i in i1]
        assert p0.keys() == p1.keys()
        for n in p0:
            assert torch.equal(p0[n], p1[n]), n
        assert bad == []
        owners = {"": 1, "emb": 1, "out": 1, "layers.0": 1, "layers.1": 1, "layers.2": 1,
                  "layers.3": 1, "layers": 0}
        # param_order="backward": one more pre-hook per owner until the engine is built (it
        # records the first forward pass's order)
        rec = 1 if param_order == "backward" else 0
        assert hooked0 == {n: v * rec for n, v in owners.items()}, hooked0  # no wait hooks
        assert hooked1 == {n: v * (1 + rec) for n, v in owners.items()}, hooked1
        assert all(v == 0 for v in after1.values()), after1
    for n in on[0][2]:
        assert torch.equal(on[0][2][n], on[1][2][n]), n  # replicas agree
    assert on[0][0][-2] < on[0][0][0]  # it learns
    print("overlap_param_gather (%s order): %d steps at W=2 bitwise equal to no overlap, "
          "loss %.3f -> %.3f" % (param_order, len(on[0][1]), on[0][0][0], on[0][0][-2]))


def test_overlap_param_gather_wait_params_and_errors():
    lin = torch.nn.Linear(4, 3)
    comm = sg.Comm.local(1)[0]
    with pytest.raises(sg.InvalidArgumentError, match="nn.Module"):
        ShardedAdamW(list(lin.parameters()), comm, overlap_param_gather=True, **FAST)
    opt = ShardedAdamW(lin, comm, overlap_param_gather=True, param_order="registration",
                       **FAST)
    assert opt.engine.overlap_param_gather
    assert len(lin._forward_pre_hooks) == 1
    lin(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.wait_params()  # nothing left to wait for; the hooks then make no library call
    assert opt._unwaited == set()
    calls = []
    opt.engine.param_wait = lambda pid=-1: calls.append(pid)
    lin(torch.ones(2, 4))
    assert calls == []
    opt.close()
    assert len(lin._forward_pre_hooks) == 0
    opt.wait_params()  # closed: a no-op
    comm.close()


def test_hyperparameters_from_arguments_config_and_defaults():
    comm = sg.Comm.local(1)[0]
    lin = torch.nn.Linear(2, 2)
    opt = ShardedAdamW(lin, comm, param_order="registration", **FAST)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.01)
    opt.close()
    cfg = sg.Config(lr=0.1, weight_decay=0.0, beta2=0.95, max_grad_norm=2.0)
    opt = ShardedAdamW(lin, comm, config=cfg, eps=1e-6, param_order="registration")
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (0.1, (0.9, 0.95), 1e-6, 0.0)
    c = opt.engine.config
    assert c.max_grad_norm == 2.0 and c.eps == np.float32(1e-6) and c.lr == np.float32(0.1)
    opt.close()
    comm.close()


def test_argument_errors():
    comm = sg.Comm.local(1)[0]
    with pytest.raises(TypeError):
        ShardedAdamW(torch.nn.Linear(2, 2), "not a comm")
    with pytest.raises(ValueError):
        ShardedAdamW(torch.nn.Linear(2, 2), comm, param_order="random")
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(sg.InvalidArgumentError, match="no trainable"):
        ShardedAdamW(frozen, comm)
    with pytest.raises(TypeError, match="unknown field"):
        ShardedAdamW(torch.nn.Linear(2, 2), comm, momentum=0.9)
    opt = ShardedAdamW(torch.nn.Linear(2, 2), comm, param_order="registration", **FAST)
    with pytest.raises(sg.UnsupportedError):
        opt.load_state_dict({})
    with pytest.raises(sg.UnsupportedError):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    assert "ShardedAdamW(2 params" in repr(opt)
    opt.close()
    comm.close()


# ------------------------------------------------------------------------------------------
# memory


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_peak_memory_below_replicated_torch_adamw():
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    res = {}
    for mode in ("torch", "sharded"):
        out = os.path.join(os.environ.get("TMPDIR", "/tmp"), "sg_mem_%d_%s.json"
                           % (os.getpid(), mode))
        r = subprocess.run([sys.executable, os.path.join(HERE, "mem_helper.py"), mode, "2", out],
                           env=env, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        with open(out) as f:
            res[mode] = json.load(f)
        os.unlink(out)
    t, s = res["torch"], res["sharded"]
    mib = 1 << 20
    print("peak memory of a training step, 2 ranks as threads, %d parameters per replica:"
          % t["params"])
    print("  torch.optim.AdamW, replicated state: %.1f MiB above baseline (%.1f MiB per rank; "
          "optimizer state %.1f MiB per rank)" % (t["step_peak_bytes"] / mib,
                                                 t["step_peak_bytes"] / 2 / mib,
                                                 t["optimizer_state_bytes"] / 2 / mib))
    print("  ShardedAdamW SHARD_GRAD_OP:          %.1f MiB above baseline (%.1f MiB per rank; "
          "library holds %.1f MiB per rank incl. the %.1f MiB working params that replaced "
          "torch's)" % (s["step_peak_bytes"] / mib, s["step_peak_bytes"] / 2 / mib,
                        s["library_total_bytes_per_rank"] / mib,
                        s["library"]["params_bytes"] / mib))
    assert s["step_peak_bytes"] < t["step_peak_bytes"]


# ------------------------------------------------------------------------------------------
# optimizer offload


def _offload_run(offload, world=2, steps=4):
    base = make_model(0)
    batches = make_batches(1, steps, 2, world, 4)

    def body(comm):
        m = copy.deepcopy(base)
        opt = ShardedAdamW(m, comm, max_grad_norm=0.5, offload_optimizer=offload, **HP, **FAST)
        losses, infos = train_sharded(m, opt, batches, comm.rank)
        mem = opt.memory()
        params = {n: p.detach().clone() for n, p in m.named_parameters()}
        opt.close()
        return losses, [i.grad_norm for i in infos], params, mem

    return sg.run_threads(world, body)


def test_offload_optimizer_on_cpu_tensors_changes_nothing():
    """ShardedAdamW(..., offload_optimizer=True) on CPU tensors: the library keeps the state in
    host memory already, so the run is bitwise the one without it and nothing more is pinned."""
    off, on = _offload_run(False), _offload_run(True)
    for rank in range(2):
        assert off[rank][0] == on[rank][0] and off[rank][1] == on[rank][1]
        for n, p in off[rank][2].items():
            assert torch.equal(p, on[rank][2][n]), n
        assert on[rank][3].host_bytes == 0 and on[rank][3] == off[rank][3]
    assert on[0][0][-1] < on[0][0][0]


def test_offload_optimizer_memory_estimate():
    """estimate_memory for a CUDA config with offload_optimizer: master and moments leave the
    device, the accumulator leaves grads, and host_bytes is (A + 8 + 4) x shard plus the
    pipeline's buffers (2 landing buffers of a bucket slice in bf16, 3 chunks of 2M bf16)."""
    numels = [1 << 22] * 16  # bf16: 4 parameters per 32 MiB bucket, 16M elements each
    kw = dict(strategy="shard_grad_op", param_dtype="bf16", device="cuda")
    for world in (1, 2, 4):
        plain = sg.estimate_memory(numels, world, **kw)
        off = sg.estimate_memory(numels, world, offload_optimizer=True, **kw)
        shard, slice_ = (64 << 20) // world, (16 << 20) // world
        assert off.master_bytes == 0 and off.optim_bytes == 0
        assert off.params_bytes == plain.params_bytes and off.comm_bytes == plain.comm_bytes
        assert off.grads_bytes == plain.grads_bytes - 4 * shard
        assert off.host_bytes == 16 * shard + 2 * slice_ * 2 + 3 * min(slice_, 2 << 20) * 2
        assert plain.host_bytes == 0
    cpu = sg.estimate_memory(numels, 2, strategy="shard_grad_op", param_dtype="bf16",
                             offload_optimizer=True)
    assert cpu.host_bytes == 0 and cpu.master_bytes > 0  # the CPU device: unchanged
    with pytest.raises(sg.UnsupportedError, match="needs a sharded strategy"):
        ShardedAdamW(make_model(0), sg.Comm.local(1)[0], strategy="no_shard", device="cuda",
                     offload_optimizer=True)


def test_finalize_mismatch_hint_only_for_parameter_order():
    """The param_order hint is added where param_order='backward' ranks registered different
    parameters (what a different first-forward order gives), not to other disagreements, where
    it would send the user after the wrong cause."""
    def net(extra):
        layers = [torch.nn.Linear(4, 4)] + ([torch.nn.Linear(4, 4)] if extra else [])
        return torch.nn.Sequential(*layers, torch.nn.Linear(4, 1))

    def attempt(order, kw_of_rank, extra_of_rank):
        def body(comm):
            torch.manual_seed(0)
            m = net(extra_of_rank(comm.rank))
            try:
                opt = ShardedAdamW(m, comm, param_order=order, **kw_of_rank(comm.rank), **FAST)
                m(torch.ones(2, 4)).sum().backward()  # "backward": the engine is built here
                opt.close()
            except sg.MismatchError as ex:
                return str(ex)
            return None
        return sg.run_threads(2, body)

    for order in ("backward", "registration"):
        msgs = attempt(order, lambda r: {}, lambda r: r == 1)
        assert all(m and "registered different parameters" in m for m in msgs), msgs
        assert all(("param_order='registration'" in m) == (order == "backward")
                   for m in msgs), msgs
        msgs = attempt(order, lambda r: dict(max_grad_norm=1.0 + r), lambda r: False)
        assert all(m and "differs between rank 0 and rank 1" in m for m in msgs), msgs
        assert not any("param_order" in m for m in msgs), msgs
