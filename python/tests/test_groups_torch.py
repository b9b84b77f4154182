"""Parameter groups: ShardedAdamW with torch-style groups (per-group lr and weight decay) against
torch.optim.AdamW with the same groups, on the small LM of test_torch.py at W = 2 ranks as
threads; a per-group LambdaLR changes every group's lr each step. Tolerance: test_torch.py's
TOL for the combined batch. Then the Engine API (set_param_group, set_group, get_group), the
model + param_groups= form, and the errors."""

import copy

import pytest

torch = pytest.importorskip("torch")

import shardgrad as sg  # noqa: E402
from shardgrad.torch import ShardedAdamW  # noqa: E402
from sg_models import lm_loss, make_batches, make_model, max_param_diff  # noqa: E402

TOL = 5e-5
STEPS = 10
FAST = dict(timeout_ms=60000)
LAMBDAS = [lambda s: 0.5 ** (s // 3), lambda s: 1.0 / (1 + s)]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def two_groups(model):
    """Matrices: lr 3e-3, weight decay 0.1; vectors (biases, norms): lr 1e-2, weight decay 0.05
    (they decay too: explicit groups follow torch)."""
    mats = [p for p in model.parameters() if p.ndim > 1]
    vecs = [p for p in model.parameters() if p.ndim <= 1]
    return [{"params": mats, "lr": 3e-3, "weight_decay": 0.1},
            {"params": vecs, "lr": 1e-2, "weight_decay": 0.05}]


def torch_run(base, batches):
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(two_groups(model), foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, LAMBDAS)
    for step in batches:
        for micro in step:
            (lm_loss(model, torch.cat(micro)) / len(step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return model


def test_two_groups_match_torch_adamw_w2():
    base = make_model(0)
    batches = make_batches(3, STEPS, 1, 2, 4)
    ref = torch_run(base, batches)
    models = [copy.deepcopy(base) for _ in range(2)]

    def body(comm):
        m = models[comm.rank]
        opt = ShardedAdamW(two_groups(m), comm, bucket_bytes=8192, **FAST)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, LAMBDAS)
        seen = []
        for step in batches:
            for micro in step:
                (lm_loss(m, micro[comm.rank]) / len(step)).backward()
            opt.step()
            seen.append((opt.engine.get_group(0), opt.engine.get_group(1)))
            sched.step()
        opt.close()
        return seen

    seen = sg.run_threads(2, body)[0]
    diff, scale = max_param_diff(models[0], ref)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b), "rank replicas differ"
    print("two groups, W=2, %d steps: max |param - torch| = %.3g (|param| <= %.2f)"
          % (STEPS, diff, scale))
    assert diff <= TOL
    for k, (g0, g1) in enumerate(seen):  # the scheduler's lr reached the engine every step
        assert g0 == (pytest.approx(3e-3 * LAMBDAS[0](k)), pytest.approx(0.1))
        assert g1 == (pytest.approx(1e-2 * LAMBDAS[1](k)), pytest.approx(0.05))
    # the groups matter: one lr for everything ends elsewhere
    single = copy.deepcopy(base)
    opt = torch.optim.AdamW(single.parameters(), lr=3e-3, weight_decay=0.1, foreach=False)
    for step in batches:
        for micro in step:
            (lm_loss(single, torch.cat(micro)) / len(step)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert max_param_diff(single, ref)[0] > 100 * TOL


def test_model_with_param_groups_equals_list_of_groups():
    base = make_model(1)
    batches = make_batches(4, 3, 1, 1, 4)
    out = []
    for form in ("list", "model"):
        m = copy.deepcopy(base)
        comm = sg.Comm.local(1)[0]
        head = [p for n, p in m.named_parameters() if n.startswith("head")]
        hp = {"params": head, "lr": 2e-2, "weight_decay": 0.0}
        if form == "list":
            rest = [p for n, p in m.named_parameters() if not n.startswith("head")]
            opt = ShardedAdamW([hp, {"params": rest}], comm, lr=1e-3, weight_decay=0.2, **FAST)
        else:
            # the parameters not listed form one more group, last, with the constructor's values
            opt = ShardedAdamW(m, comm, lr=1e-3, weight_decay=0.2, param_groups=[hp], **FAST)
        assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 1e-3
        assert opt.param_groups[1]["weight_decay"] == 0.2
        for step in batches:
            lm_loss(m, step[0][0]).backward()
            opt.step()
        out.append([p.detach().clone() for p in m.parameters()])
        opt.close()
        comm.close()
    assert any(n.startswith("head") for n, _ in base.named_parameters())
    for a, b in zip(*out):
        assert torch.equal(a, b)


def test_engine_group_api():
    comm = sg.Comm.local(1)[0]
    e = sg.Engine(comm, sg.Config(lr=0.5, weight_decay=0.25))
    a = e.add_param("a", 8)
    b = e.add_param("b", 8)
    e.set_param_group(b, 3)
    e.set_param_group("a", 0)
    assert e.get_group(3) == (0.5, 0.25)  # never set: the config's
    with pytest.raises(sg.InvalidArgumentError, match="group"):
        e.set_param_group(a, sg.MAX_GROUPS)
    e.finalize()
    with pytest.raises(sg.InvalidStateError):
        e.set_param_group(a, 1)
    e.set_group(3, 0.125, 0.0)
    assert e.get_group(3) == (0.125, 0.0)
    e.set_lr(0.75)
    assert e.get_group(0) == (0.75, 0.25) and e.lr == 0.75
    with pytest.raises(sg.InvalidArgumentError, match="weight_decay"):
        e.set_group(1, 0.1, -1.0)
    with pytest.raises(sg.InvalidArgumentError, match="lr"):
        e.set_group(1, float("nan"), 0.0)
    e.close()
    comm.close()


def test_group_errors():
    comm = sg.Comm.local(1)[0]
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(sg.UnsupportedError, match="betas"):
        ShardedAdamW([{"params": [lin.weight], "betas": (0.8, 0.9)}, {"params": [lin.bias]}],
                     comm)
    with pytest.raises(sg.UnsupportedError, match="eps"):
        ShardedAdamW([{"params": [lin.weight], "eps": 1e-3}, {"params": [lin.bias]}], comm)
    many = [{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(sg.MAX_GROUPS + 1)]
    with pytest.raises(sg.InvalidArgumentError, match="groups"):
        ShardedAdamW(many, comm)
    with pytest.raises(sg.InvalidArgumentError, match="not in the model"):
        ShardedAdamW(lin, comm, param_groups=[{"params": [torch.zeros(1, requires_grad=True)]}])
    with pytest.raises(sg.InvalidArgumentError, match="two"):
        ShardedAdamW(lin, comm, param_groups=[{"params": [lin.weight]},
                                              {"params": [lin.weight]}])
    # same betas as the constructor's: accepted
    opt = ShardedAdamW([{"params": [lin.weight], "betas": (0.9, 0.999)}, {"params": [lin.bias]}],
                       comm, param_order="registration", **FAST)
    assert len(opt.param_groups) == 2
    assert opt.state_dict()["param_groups"][1]["params"] == [1]
    opt.close()
    comm.close()
