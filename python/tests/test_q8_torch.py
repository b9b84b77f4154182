"""ShardedAdamW(..., optim_state_dtype="q8"): AdamW's m and v in blockwise 8 bits (issue 27).

The C test (tests/test_q8.c) checks the bits (W = 1..4, the small-tensor rule, the kernel
against a reference); here the binding: the keyword reaches the library, param_state() returns
the decoded moments, memory() counts the smaller state, bad values are refused, and a short
training run stays close to the fp32-state one."""
import copy

import pytest

torch = pytest.importorskip("torch")

import shardgrad as sg  # noqa: E402
from shardgrad.torch import ShardedAdamW  # noqa: E402
from sg_models import make_batches, make_model, train_sharded  # noqa: E402

HP = dict(lr=3e-3, weight_decay=0.1, timeout_ms=60000)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run(world, **kw):
    base = make_model(0)
    batches = make_batches(1, 8, 1, world, 4)

    def body(comm):
        m = copy.deepcopy(base)
        opt = ShardedAdamW(m, comm, **HP, **kw)
        losses, _ = train_sharded(m, opt, batches, comm.rank)
        states = opt.state_dict()["state"]  # param_state() of every parameter
        mem = opt.memory()
        params = {n: p.detach().clone() for n, p in m.named_parameters()}
        opt.close()
        return losses, states, params, mem

    return sg.run_threads(world, body)


def test_config_keyword():
    assert sg.Config(optim_state_dtype="q8").optim_state_dtype == sg.DType.Q8
    assert sg.Config().optim_state_dtype == sg.DType.F32
    assert sg.Config().optim_state_min_numel == 4096
    with pytest.raises(ValueError, match="optim_state_dtype"):
        sg.Config(optim_state_dtype="int4")
    with pytest.raises(sg.InvalidArgumentError, match="optim_state_dtype"):
        sg.Config(optim_state_dtype="bf16")
    with pytest.raises(sg.InvalidArgumentError, match="optim_state_min_numel"):
        sg.Config(optim_state_dtype="q8", optim_state_min_numel=-1)
    with pytest.raises(sg.InvalidArgumentError, match="param_dtype"):
        sg.Config(param_dtype="q8")


def test_q8_trains_close_to_fp32_and_saves_memory():
    """Every tensor coded (min_numel 0): the same loss curve within a few percent, m and v
    within a quarter of each tensor's largest value, the state about a quarter of fp32's."""
    f32 = _run(2)
    q8 = _run(2, optim_state_dtype="q8", optim_state_min_numel=0)
    for rank in range(2):
        lf, lq = f32[rank][0], q8[rank][0]
        assert lq[-1] < lq[0]
        assert abs(lq[-1] - lf[-1]) <= 0.05 * lf[-1], (lq, lf)
    for n, st in q8[0][1].items():
        ref = f32[0][1][n]
        for key in ("exp_avg", "exp_avg_sq"):
            top = ref[key].abs().max().item()
            assert (st[key] - ref[key]).abs().max().item() <= 0.25 * top + 1e-30, (n, key)
        assert not torch.equal(st["exp_avg"], ref["exp_avg"]), n  # coded, not fp32
        assert (st["exp_avg_sq"] >= 0).all(), n
    assert q8[0][3].optim_bytes < f32[0][3].optim_bytes / 2


def test_small_tensors_keep_fp32_state():
    """Below the threshold (the tiny model's largest tensors have 4096 elements) every tensor
    keeps fp32 state: the run is bitwise the fp32 one."""
    f32 = _run(2)
    q8 = _run(2, optim_state_dtype="q8", optim_state_min_numel=4097)
    for rank in range(2):
        assert f32[rank][0] == q8[rank][0]
        for n, p in f32[rank][2].items():
            assert torch.equal(p, q8[rank][2][n]), n


def _save_load(tmp_path, save_kw, load_kw, convert):
    """Trains 2 ranks with save_kw and saves; a fresh optimizer with load_kw loads that (with
    convert_optim_state=convert); both sides' state_dict()["state"] per rank, or the error."""
    base = make_model(0)
    batches = make_batches(1, 8, 1, 2, 4)
    ckpt = str(tmp_path / "ckpt")

    def body(comm):
        m = copy.deepcopy(base)
        opt = ShardedAdamW(m, comm, **HP, **save_kw)
        train_sharded(m, opt, batches, comm.rank)
        saved = opt.state_dict()["state"]
        opt.save(ckpt)
        opt.close()
        m2 = copy.deepcopy(base)
        opt2 = ShardedAdamW(m2, comm, **HP, **load_kw)
        try:
            opt2.load(ckpt, convert_optim_state=convert)
            return saved, opt2.state_dict()["state"]
        except sg.ShardgradError as e:
            return saved, e
        finally:
            opt2.close()

    return sg.run_threads(2, body)


def test_load_converts_state_formats(tmp_path):
    """fp32 state into a q8 engine and 8-bit state into an fp32 one: refused without
    convert_optim_state (the message names it); with it, 8 bits decoded are the values
    param_state() gave before the save, and fp32 coded are close to the saved ones."""
    q8 = dict(optim_state_dtype="q8", optim_state_min_numel=0)
    for save_kw, load_kw in (({}, q8), (q8, {})):
        for saved, err in _save_load(tmp_path, save_kw, load_kw, False):
            assert isinstance(err, sg.MismatchError) and "convert_optim_state" in str(err)
    for saved, loaded in _save_load(tmp_path, q8, {}, True):
        for k, st in saved.items():
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[name], loaded[k][name]), (k, name)
    for saved, loaded in _save_load(tmp_path, {}, q8, True):
        for k, st in saved.items():
            for name in ("exp_avg", "exp_avg_sq"):
                top = st[name].abs().max().item()
                assert (st[name] - loaded[k][name]).abs().max().item() <= 0.07 * top, (k, name)
