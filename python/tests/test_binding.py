"""The ctypes binding without torch: every C function bound and reachable, struct layouts
checked against the header with a C compiler, Config, errors, Engine with NumPy views, threads,
leaks over 1000 create/destroy cycles, library discovery."""

import ctypes
import os
import re
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

import shardgrad as sg
from shardgrad import _lib
from shardgrad._structs import (SgCommTraffic, SgConfig, SgHardware, SgHparams, SgMemoryStats,
                                SgStepEstimate, SgStepInfo, SgTraceEvent, SgXport)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
HEADER = os.path.join(REPO, "include", "shardgrad.h")

# A short deadline: a failing rank must not leave the others waiting 10 minutes.
FAST = dict(timeout_ms=30000)


def lib():
    return _lib.load()


def header_functions():
    """{name: number of parameters} of every SG_API function in the public header."""
    text = open(HEADER).read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = {}
    for m in re.finditer(r"SG_API\s+[^;{]*?\b(sg_\w+)\s*\(([^)]*)\)\s*;", text, flags=re.S):
        args = m.group(2).strip()
        out[m.group(1)] = 0 if args in ("", "void") else args.count(",") + 1
    return out


# ------------------------------------------------------------------------------------------
# coverage of the C API


def test_every_header_function_is_bound_with_prototype():
    funcs = header_functions()
    assert len(funcs) >= 29, funcs  # the header has at least the 29 functions of version 0.1
    L = lib()
    for name, nargs in funcs.items():
        assert name in _lib.PROTOTYPES, "%s is in shardgrad.h but not bound" % name
        if name in _lib.OPTIONAL and not _lib.has(name):
            print("%s: in the header, not exported by this build" % name)
            continue
        fn = getattr(L, name)  # exported by the library
        restype, argtypes = _lib.PROTOTYPES[name]
        assert fn.argtypes is not None and list(fn.argtypes) == list(argtypes), name
        assert fn.restype == restype, name
        assert len(argtypes) == nargs, "%s: %d ctypes args, header has %d" % (
            name, len(argtypes), nargs)
    print("%d header functions bound; optional ones exported: %s" % (
        len(funcs), sorted(n for n in _lib.OPTIONAL if _lib.has(n))))


def test_every_bound_function_exported_or_optional():
    L = lib()
    header = header_functions()
    for name in _lib.PROTOTYPES:
        if name not in _lib.OPTIONAL:
            assert hasattr(L, name), name
            assert name in header, "%s bound as required but not in the header" % name


def test_c_argument_checks_reachable_with_null_handles():
    """Every engine/comm function answers a NULL handle with SG_ERR_INVALID_ARGUMENT and text
    naming the function: the call reached the C code with the right arity."""
    L = lib()
    vp = ctypes.c_void_p()
    f = ctypes.c_float()
    st = SgStepInfo(struct_size=ctypes.sizeof(SgStepInfo))
    ms = SgMemoryStats(struct_size=ctypes.sizeof(SgMemoryStats))
    i = ctypes.c_int()
    buf = (ctypes.c_float * 4)()
    calls = {
        "sg_comm_create_local": (0, ctypes.cast(None, ctypes.POINTER(ctypes.c_void_p))),
        "sg_config_init": (None, ctypes.sizeof(SgConfig)),
        "sg_engine_create": (None, None, ctypes.byref(vp)),
        "sg_add_param": (None, b"x", 4, 0, ctypes.byref(i)),
        "sg_finalize": (None,),
        "sg_param_ptr": (None, 0, ctypes.byref(vp)),
        "sg_set_param": (None, 0, buf, 0),
        "sg_get_param": (None, 0, buf, 0),
        "sg_broadcast_params": (None, 0),
        "sg_get_master": (None, 0, buf),
        "sg_get_optim_state": (None, 0, 0, buf),
        "sg_grad_ptr": (None, 0, ctypes.byref(vp)),
        "sg_grad_ready": (None, 0),
        "sg_grad_add": (None, 0, buf, 0),
        "sg_backward_end": (None,),
        "sg_set_sync": (None, 1),
        "sg_step": (None, ctypes.byref(st)),
        "sg_set_lr": (None, 1e-3),
        "sg_get_loss_scale": (None, ctypes.byref(f)),
        "sg_memory": (None, ctypes.byref(ms)),
        "sg_estimate_memory": (None, None, 1, 1, ctypes.byref(ms)),
    }
    for name in ("sg_set_stream", "sg_save", "sg_load", "sg_export", "sg_import",
                 "sg_get_step"):
        if _lib.has(name):
            calls[name] = (None, None)
    if _lib.has("sg_param_wait"):
        calls["sg_param_wait"] = (None, -1)
    if _lib.has("sg_last_step_info"):
        calls["sg_last_step_info"] = (None, ctypes.byref(st))
    if _lib.has("sg_set_group"):
        calls["sg_set_param_group"] = (None, 0, 0)
        calls["sg_set_group"] = (None, 0, 1e-3, 0.0)
        calls["sg_get_group"] = (None, 0, ctypes.byref(f), ctypes.byref(f))
    for name, args in calls.items():
        rc = getattr(L, name)(*args)
        assert rc == sg.Status.ERR_INVALID_ARGUMENT, (name, rc)
        assert L.sg_last_error().decode().startswith(name), (name, L.sg_last_error())
    # the functions without a status
    assert L.sg_comm_rank(None) == -1 and L.sg_comm_size(None) == -1
    L.sg_comm_destroy(None)
    L.sg_engine_destroy(None)
    assert L.sg_has_backend(None) == 0
    # NCCL: without NCCL (or a GPU) these refuse; with NULL outputs they must not crash
    nccl = {"sg_nccl_unique_id": (None,), "sg_comm_create_nccl": (0, 1, None, -1, None),
            "sg_comm_create_nccl_mpi": (None, None)}
    for name, args in nccl.items():
        if _lib.has(name):
            rc = getattr(L, name)(*args)
            assert rc in (sg.Status.ERR_INVALID_ARGUMENT, sg.Status.ERR_UNSUPPORTED), (name, rc)
            assert L.sg_last_error().decode().startswith(name), (name, L.sg_last_error())
    print("%d functions answered a NULL handle with SG_ERR_INVALID_ARGUMENT" % len(calls))


def test_version_backends_status_strings():
    major, minor, patch = sg.version()
    text = open(HEADER).read()
    want = [int(re.search(r"#define SG_VERSION_%s (\d+)" % k, text).group(1))
            for k in ("MAJOR", "MINOR", "PATCH")]
    assert [major, minor, patch] == want
    assert sg.has_backend("local")
    assert not sg.has_backend("no-such-backend")
    for s in sg.Status:
        assert sg.status_string(s) == "SG_" + s.name
    print("version %d.%d.%d, backends: %s" % (major, minor, patch, [
        b for b in ("local", "mpi", "cuda", "nccl") if sg.has_backend(b)]))


# ------------------------------------------------------------------------------------------
# struct layouts against the header


def _c_compiler():
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


STRUCTS = {"sg_config": SgConfig, "sg_step_info": SgStepInfo, "sg_memory_stats": SgMemoryStats,
           "sg_trace_event": SgTraceEvent, "sg_comm_traffic": SgCommTraffic,
           "sg_hparams": SgHparams, "sg_xport": SgXport, "sg_hardware": SgHardware,
           "sg_step_estimate": SgStepEstimate}
ENUMS = {
    **{"SG_" + s.name: int(s) for s in sg.Status},
    **{("SG_DTYPE_AUTO" if d == sg.DType.AUTO else "SG_" + d.name): int(d) for d in sg.DType},
    **{"SG_DEVICE_" + d.name: int(d) for d in sg.Device},
    **{"SG_" + s.name: int(s) for s in sg.Strategy},
    **{"SG_TRACE_" + k.name: int(k) for k in sg.TraceKind},
    "SG_PARAM_NO_DECAY": sg.PARAM_NO_DECAY,
}


def test_struct_layout_matches_c_compiler(tmp_path):
    cc = _c_compiler()
    if cc is None:
        pytest.skip("no C compiler; test_config_init_defaults checks the layout instead")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "shardgrad.h"',
             "int main(void) {"]
    for cname, py in STRUCTS.items():
        lines.append('printf("%s sizeof %%zu\\n", sizeof(%s));' % (cname, cname))
        for field, _ in py._fields_:
            lines.append('printf("%s %s %%zu %%zu\\n", offsetof(%s, %s), sizeof(((%s *)0)->%s));'
                         % (cname, field, cname, field, cname, field))
    for name in ENUMS:
        lines.append('printf("enum %s %%ld\\n", (long)(%s));' % (name, name))
    for t in ("sg_status", "sg_dtype", "sg_device", "sg_strategy", "sg_trace_kind"):
        lines.append('printf("enumsize %s %%zu\\n", sizeof(%s));' % (t, t))
    lines += ["return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c11", "-I", os.path.join(REPO, "include"), str(src), "-o",
                    str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    n = 0
    for line in out.splitlines():
        parts = line.split()
        if parts[0] == "enum":
            assert ENUMS[parts[1]] == int(parts[2]), line
        elif parts[0] == "enumsize":
            assert int(parts[2]) == ctypes.sizeof(ctypes.c_int), line
        elif parts[1] == "sizeof":
            assert ctypes.sizeof(STRUCTS[parts[0]]) == int(parts[2]), line
        else:
            py = STRUCTS[parts[0]]
            desc = getattr(py, parts[1])
            assert (desc.offset, desc.size) == (int(parts[2]), int(parts[3])), line
        n += 1
    print("%d sizes, offsets and enum values agree with %s" % (n, cc))


def test_config_init_defaults_and_struct_size():
    """sg_config_init fills the header's defaults at the offsets ctypes expects, and accepts
    exactly the struct size ctypes computes."""
    L = lib()
    c = SgConfig()
    assert L.sg_config_init(ctypes.byref(c), ctypes.sizeof(c)) == 0
    assert c.struct_size == ctypes.sizeof(SgConfig)
    big = (ctypes.c_char * (ctypes.sizeof(SgConfig) + 64))()
    assert L.sg_config_init(ctypes.cast(big, ctypes.POINTER(SgConfig)),
                            ctypes.sizeof(SgConfig) + 8) == sg.Status.ERR_INVALID_ARGUMENT
    assert "struct_size" in sg.last_error()
    cfg = sg.Config()
    want = dict(strategy=sg.Strategy.SHARD_GRAD_OP, device=sg.Device.CPU, cuda_device=-1,
                param_dtype=sg.DType.F32, grad_dtype=sg.DType.AUTO, reduce_dtype=sg.DType.AUTO,
                accum_dtype=sg.DType.F32, bucket_bytes=32 << 20, staging_buckets=2,
                lr=np.float32(1e-3), beta1=np.float32(0.9), beta2=np.float32(0.999),
                eps=np.float32(1e-8), weight_decay=np.float32(0.01), max_grad_norm=0.0,
                grad_average=1, loss_scale=0.0, init_loss_scale=65536.0, scale_window=2000,
                min_loss_scale=1.0, skip_nonfinite=1, stochastic_rounding=0, seed=0,
                timeout_ms=600000, overlap_param_gather=0, offload_optimizer=0,
                replica_reduce_dtype=sg.DType.F32, shard_ranks=0, replica_codec=sg.Codec.NONE,
                outer_every=0, outer_lr=0.7, outer_momentum=0.9,
                optim_state_dtype=sg.DType.F32, optim_state_min_numel=4096, outer_streaming=0)
    got = cfg.as_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == v, (k, got[k], v)


# ------------------------------------------------------------------------------------------
# Config


def test_config_keywords_validated():
    c = sg.Config(strategy="no_shard", param_dtype="bf16", lr=3e-4, max_grad_norm=1,
                  skip_nonfinite=False, seed=2**63)
    assert c.strategy == sg.Strategy.NO_SHARD
    assert c.param_dtype == sg.DType.BF16
    assert c.grad_dtype == sg.DType.AUTO and c.reduce_dtype == sg.DType.AUTO
    assert c.effective_grad_dtype == sg.DType.BF16  # AUTO follows param_dtype
    assert c.max_grad_norm == 1.0 and c.skip_nonfinite == 0 and c.seed == 2**63
    c2 = sg.Config(param_dtype="bf16", grad_dtype="f32", reduce_dtype="auto")
    assert c2.grad_dtype == sg.DType.F32 and c2.effective_grad_dtype == sg.DType.F32
    assert sg.Config(strategy=sg.Strategy.SHARD_OPT).strategy == sg.Strategy.SHARD_OPT
    assert sg.Config(strategy="SG_SHARD_GRAD_OP").strategy == sg.Strategy.SHARD_GRAD_OP
    assert sg.Config(param_dtype=np.float16).param_dtype == sg.DType.F16
    with pytest.raises(TypeError, match="unknown field"):
        sg.Config(learning_rate=1.0)
    with pytest.raises(TypeError):
        sg.Config(lr="fast")
    with pytest.raises(TypeError):
        sg.Config(staging_buckets=2.5)
    with pytest.raises(ValueError):
        sg.Config(strategy="zero3")
    with pytest.raises(ValueError):
        sg.Config(param_dtype=7)
    with pytest.raises(ValueError):
        sg.Config(bucket_bytes=-1)
    with pytest.raises(sg.InvalidArgumentError, match="lr"):
        sg.Config(lr=-1.0)
    with pytest.raises(sg.InvalidArgumentError, match="beta1"):
        sg.Config(beta1=1.0)
    with pytest.raises(sg.InvalidArgumentError, match="bucket_bytes"):
        sg.Config(bucket_bytes=8)
    with pytest.raises(ValueError):  # InvalidArgumentError is a ValueError too
        sg.Config(staging_buckets=0)
    c = sg.Config()
    c.lr = 0.5
    with pytest.raises(TypeError):
        c.no_such_field = 1
    d = c.copy(beta2=0.95)
    assert d.lr == 0.5 and d.beta2 == np.float32(0.95) and c.beta2 == np.float32(0.999)
    assert c == c.copy() and c != d
    assert "SHARD_GRAD_OP" in repr(c)


# ------------------------------------------------------------------------------------------
# errors


def test_error_classes_per_status():
    seen = set()
    for s in sg.Status:
        if s == sg.Status.OK:
            continue
        cls = sg.errors.error_class(s)
        assert issubclass(cls, sg.ShardgradError) and cls.status == s
        seen.add(cls)
    assert len(seen) == 11
    assert issubclass(sg.InvalidArgumentError, ValueError)
    assert issubclass(sg.OutOfMemoryError, MemoryError)
    assert issubclass(sg.ShardgradTimeoutError, TimeoutError)
    e = sg.InvalidStateError("sg_step: call sg_finalize first", 2, "sg_step")
    assert str(e) == "SG_ERR_INVALID_STATE: sg_step: call sg_finalize first"


def test_real_errors_carry_last_error_text():
    comm = sg.Comm.local(1)[0]
    with sg.Engine(comm, **FAST) as e:
        with pytest.raises(sg.InvalidArgumentError) as ex:
            e.add_param("empty", 0)
        assert ex.value.function == "sg_add_param"
        assert "numel" in ex.value.message and "empty" in ex.value.message
        e.add_param("w", (4, 4))
        e.add_param("w2", 5)  # so that one gradient does not complete the micro-batch
        with pytest.raises(sg.InvalidArgumentError, match="already registered"):
            e.add_param("w", 3)
        with pytest.raises(sg.InvalidStateError, match="sg_finalize"):
            e.step()
        e.finalize()
        with pytest.raises(sg.InvalidStateError, match="after sg_finalize"):
            e.add_param("late", 3)
        e.grad_add(0, np.ones(16, np.float32))
        with pytest.raises(sg.InvalidStateError, match="already marked ready"):
            e.grad_ready(0)
        with pytest.raises(sg.InvalidArgumentError):  # Python-side size check
            e.grad_add(0, np.ones(3, np.float32))
        with pytest.raises(sg.InvalidArgumentError, match="which"):
            sg.core._call("sg_get_optim_state", e.handle, 0, 5,
                          (ctypes.c_float * 16)())
    with pytest.raises(sg.InvalidStateError):
        e.step()  # closed
    comm.close()
    if not sg.has_backend("cuda"):
        c2 = sg.Comm.local(1)[0]
        with pytest.raises(sg.UnsupportedError, match="CUDA"):
            sg.Engine(c2, device="cuda")
        c2.close()


def test_last_error_is_thread_local():
    comm = sg.Comm.local(1)[0]
    e = sg.Engine(comm, **FAST)
    with pytest.raises(sg.InvalidArgumentError):
        e.add_param("", 3)
    main_text = sg.last_error()
    assert "name" in main_text
    other = []

    def worker():
        other.append(sg.last_error())
        try:
            e.add_param("bad", 0)
        except sg.InvalidArgumentError as ex:
            other.append(ex.message)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert other[0] == ""  # a fresh thread has no error
    assert "numel" in other[1]
    assert sg.last_error() == main_text  # unchanged by the other thread
    e.close()
    comm.close()


def test_mismatch_between_thread_ranks():
    def body(comm):
        with sg.Engine(comm, **FAST) as e:
            e.add_param("w", 100 if comm.rank == 0 else 101)
            try:
                e.finalize()
            except sg.MismatchError as ex:
                return ex.message
            return None

    msgs = sg.run_threads(2, body)
    assert all(m is not None and "w" in m for m in msgs), msgs
    print("mismatch message:", msgs[0])


@pytest.mark.skipif(sg.has_backend("mpi"), reason="built with MPI (tested under mpirun)")
def test_comm_mpi_unsupported_without_mpi():
    with pytest.raises(sg.UnsupportedError):
        sg.Comm.mpi()


def test_comm_close_refused_while_engine_uses_it():
    comm = sg.Comm.local(1)[0]
    e = sg.Engine(comm, **FAST)
    with pytest.raises(sg.InvalidStateError):
        comm.close()
    e2 = sg.Engine(comm, **FAST)  # a second engine on one communicator: its own channel
    e2.close()
    with pytest.raises(sg.InvalidStateError):
        comm.close()
    e.close()
    assert comm.rank == 0 and comm.size == 1
    comm.close()
    assert comm.closed
    with pytest.raises(sg.InvalidStateError):
        comm.rank


# ------------------------------------------------------------------------------------------
# Engine with NumPy


def adamw_ref(p, m, v, g, t, lr, b1, b2, eps, wd):
    """DESIGN.md section 5 in float64, with the hyperparameters rounded to float32 as the
    library stores them."""
    lr, b1, b2, eps, wd = (float(np.float32(x)) for x in (lr, b1, b2, eps, wd))
    p = p * (1 - lr * wd)
    m = m + (g - m) * (1 - b1)
    v = v * b2 + (1 - b2) * g * g
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    p = p - (lr / bc1) * m / (np.sqrt(v) / np.sqrt(bc2) + eps)
    return p, m, v


def test_engine_single_rank_numpy_views_and_adamw():
    rng = np.random.default_rng(0)
    shapes = {"w1": (8, 16), "b1": (16,), "w2": (300,)}
    init = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    lr, wd = 0.01, 0.1
    comm = sg.Comm.local(1)[0]
    with sg.Engine(comm, lr=lr, weight_decay=wd, bucket_bytes=1024, **FAST) as e:
        ids = {k: e.add_param(k, s, no_decay=(k == "b1")) for k, s in shapes.items()}
        assert ids == {"w1": 0, "b1": 1, "w2": 2}
        e.finalize()
        for k in shapes:
            e.set_param(ids[k], init[k])
        views = {k: e.param(ids[k]) for k in shapes}
        for k in shapes:
            assert views[k].shape == shapes[k] and views[k].dtype == np.float32
            np.testing.assert_array_equal(views[k], init[k])
            np.testing.assert_array_equal(e.get_param(ids[k]), init[k])
        # zero copy: a write through the view is what the library sees
        views["w2"][0] = 5.0
        assert e.get_param(ids["w2"])[0] == 5.0
        views["w2"][0] = init["w2"][0]
        p = {k: init[k].astype(np.float64) for k in shapes}
        m = {k: np.zeros(s) for k, s in shapes.items()}
        v = {k: np.zeros(s) for k, s in shapes.items()}
        for t in range(1, 4):
            grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
            # three ways of giving a gradient: view of the slot, grad_add, torch-free ptr
            slot = e.grad(ids["w2"])
            assert slot.shape == shapes["w2"] and not slot.any()  # zeroed
            slot[...] = grads["w2"]
            e.grad_ready(ids["w2"])
            e.grad_add(ids["b1"], grads["b1"])
            e.grad_add(ids["w1"], grads["w1"])
            info = e.step()
            assert info.step == t and not info.skipped and info.clip_coef == 1.0
            norm = np.sqrt(sum((grads[k].astype(np.float64) ** 2).sum() for k in shapes))
            assert info.grad_norm == pytest.approx(norm, rel=1e-5)
            for k in shapes:
                p[k], m[k], v[k] = adamw_ref(p[k], m[k], v[k], grads[k].astype(np.float64), t,
                                             lr, 0.9, 0.999, 1e-8, 0.0 if k == "b1" else wd)
        for k in shapes:
            np.testing.assert_allclose(views[k], p[k], rtol=2e-6, atol=2e-7)
            np.testing.assert_allclose(e.get_master(ids[k]), p[k], rtol=2e-6, atol=2e-7)
            np.testing.assert_allclose(e.get_optim_state(ids[k], "m"), m[k], rtol=1e-5,
                                       atol=1e-7)
            np.testing.assert_allclose(e.get_optim_state(ids[k], "exp_avg_sq"), v[k],
                                       rtol=1e-5, atol=1e-9)
        assert e.loss_scale == 1.0
        e.lr = 0.0  # lr 0 and wd*lr 0: a step changes nothing
        before = e.get_param(ids["w1"])
        e.grad_add(ids["w1"], np.ones(128, np.float32))
        e.step()
        np.testing.assert_array_equal(e.get_param(ids["w1"]), before)
        mem = e.memory()
        est = sg.estimate_memory([128, 16, 300], 1, config=e.config)
        assert mem.total_bytes == sum([mem.params_bytes, mem.grads_bytes, mem.master_bytes,
                                       mem.optim_bytes, mem.comm_bytes])
        assert mem.numel == est.numel and mem.optim_bytes == est.optim_bytes
        assert mem.peak_bytes >= mem.total_bytes and mem.shard_numel == mem.numel
        print("memory:", mem)


def test_step_info_read_later():
    """step(info=False) asks for no result (no host sync on a GPU); last_step_info() gives what
    step() would have returned, and refuses before the first step."""
    if not _lib.has("sg_last_step_info"):
        pytest.skip("library without sg_last_step_info")
    rng = np.random.default_rng(1)
    comm = sg.Comm.local(1)[0]
    infos = []
    for later in (False, True):
        with sg.Engine(comm, lr=0.01, max_grad_norm=0.5, **FAST) as e:
            pid = e.add_param("w", (64,))
            e.finalize()
            e.set_param(pid, np.ones(64, np.float32))
            if later:
                with pytest.raises(sg.InvalidStateError):
                    e.last_step_info()
            got = []
            for _ in range(3):
                e.grad_add(pid, rng.standard_normal(64).astype(np.float32))
                info = e.step(info=not later)
                assert (info is None) == later
                got.append(e.last_step_info() if later else info)
                assert e.last_step_info() == got[-1]
            infos.append((got, e.get_param(pid)))
        rng = np.random.default_rng(1)
    (eager, p0), (lazy, p1) = infos
    assert eager == lazy and eager[-1].step == 3 and eager[-1].clip_coef < 1.0
    np.testing.assert_array_equal(p0, p1)


def test_bf16_params_as_uint16_views():
    comm = sg.Comm.local(1)[0]
    with sg.Engine(comm, param_dtype="bf16", **FAST) as e:
        e.add_param("w", (2, 3))
        e.finalize()
        vals = np.array([[1.0, -2.0, 0.5], [3.0, 0.0, -0.125]], np.float32)
        e.set_param(0, vals)
        view = e.param(0)
        assert view.dtype == np.uint16 and view.shape == (2, 3)
        np.testing.assert_array_equal(view, (vals.view(np.uint32) >> 16).astype(np.uint16))
        np.testing.assert_array_equal(e.get_param(0, "bf16"), view)
        np.testing.assert_array_equal(e.get_param(0), vals)
        np.testing.assert_array_equal(e.get_master(0), vals)  # fp32 master from set_param
        g = e.grad(0)
        assert g.dtype == np.uint16  # grad_dtype follows param_dtype
        e.grad_ready(0)
        e.step()
        bits = np.ones(6, np.float32).view(np.uint32) >> 16
        e.grad_add(0, bits.astype(np.uint16), dtype="bf16")
        e.step()
        with pytest.raises(sg.InvalidArgumentError, match="bf16"):
            e.grad_add(0, bits.astype(np.uint16))  # ambiguous without dtype


def _integer_rank_body(comm, steps, strategy, nosync):
    """Each rank adds (rank + 1) * k to every gradient element: sums are exact."""
    cfg = dict(lr=0.05, weight_decay=0.0, bucket_bytes=512, staging_buckets=3,
               strategy=strategy, **FAST)
    with sg.Engine(comm, **cfg) as e:
        e.add_param("a", (10, 30))
        e.add_param("b", 7, no_decay=True)
        e.add_param("c", 200)
        e.finalize()
        for i in range(3):
            e.set_param(i, np.full(e.param_shape(i), 0.5, np.float32))
        r = comm.rank
        for s in range(steps):
            if nosync:
                e.set_sync(False)
                for i in range(3):
                    e.grad_add(i, np.full(e.param_shape(i), float(r + 1), np.float32))
                e.backward_end()
                e.set_sync(True)
            for i in (2, 0):  # b gets no gradient: counts as zero
                e.grad_add(i, np.full(e.param_shape(i), float((r + 1) * (s + 1)), np.float32))
            e.backward_end()
            info = e.step()
        return ([e.get_param(i) for i in range(3)], [e.get_master(i) for i in range(3)],
                [e.get_optim_state(i, 0) for i in range(3)], info, e.memory())


@pytest.mark.parametrize("strategy", ["shard_grad_op", "no_shard", "shard_opt"])
def test_threads_match_single_rank(strategy):
    """W = 1, 2, 3 thread ranks: with exact sums, every rank of every W holds the parameters
    of one rank fed the average gradient."""
    steps = 3
    out = {}
    for w in (1, 2, 3):
        out[w] = sg.run_threads(w, _integer_rank_body, steps, strategy, w == 2)
    # the W=1 run with the average gradient (mean of (r+1) over W ranks) differs per W, so
    # compare each W against a NumPy AdamW instead
    for w, ranks in out.items():
        avg = np.mean([r + 1 for r in range(w)])
        p = pb = 0.5
        mm = vv = mb = vb = 0.0
        extra = avg if w == 2 else 0.0  # the no_sync micro-batch
        for s in range(steps):
            p, mm, vv = adamw_ref(p, mm, vv, avg * (s + 1) + extra, s + 1, 0.05, 0.9, 0.999,
                                  1e-8, 0.0)
            pb, mb, vb = adamw_ref(pb, mb, vb, extra, s + 1, 0.05, 0.9, 0.999, 1e-8, 0.0)
        for params, masters, ms, info, mem in ranks:
            assert info.step == steps
            np.testing.assert_allclose(params[0], p, rtol=1e-6)
            np.testing.assert_allclose(params[2], p, rtol=1e-6)
            np.testing.assert_allclose(params[1], pb, rtol=1e-6)
            if w != 2:
                np.testing.assert_array_equal(params[1], 0.5)  # zero gradient: unchanged
            np.testing.assert_array_equal(masters[0], params[0])
            np.testing.assert_allclose(ms[0], mm, rtol=1e-5)
        first = ranks[0][0]
        for params, *_ in ranks[1:]:
            for a, b in zip(first, params):
                np.testing.assert_array_equal(a, b)  # replicas agree bitwise
        mem = ranks[0][4]
        if strategy != "no_shard":
            assert mem.shard_numel * w == mem.numel
        print("%s W=%d: shard %d of %d elements, optim %d bytes per rank"
              % (strategy, w, mem.shard_numel, mem.numel, mem.optim_bytes))


def _overlap_rank_body(comm, overlap, steps):
    """Random gradients (seeded by rank and step) into several buckets. After each step: with
    overlap, param_wait for every id in registration order, then read the NumPy views; also
    get_param, which waits by itself."""
    cfg = dict(lr=0.05, bucket_bytes=1024, overlap_param_gather=overlap, **FAST)
    shapes = [(16, 20), 64, (10, 30), 200, 7]
    with sg.Engine(comm, **cfg) as e:
        assert e.overlap_param_gather == bool(overlap)
        for i, shp in enumerate(shapes):
            e.add_param("p%d" % i, shp, no_decay=(i == 4))
        e.finalize()
        e.param_wait()  # nothing pending yet: returns at once
        rng = np.random.default_rng(0)
        for i in range(len(shapes)):
            e.set_param(i, rng.standard_normal(e.param_shape(i)).astype(np.float32))
        views, copies = [], []
        for s in range(steps):
            rng = np.random.default_rng(100 * s + comm.rank + 1)
            for i in reversed(range(len(shapes))):
                e.grad_add(i, rng.standard_normal(e.param_shape(i)).astype(np.float32))
            e.backward_end()
            e.step()
            got = []
            for i in range(len(shapes)):
                if overlap:
                    e.param_wait(i if i % 2 else e.param_name(i))  # ids and names
                got.append(e.param(i).copy())
            views.append(got)
            copies.append([e.get_param(i) for i in range(len(shapes))])
        return views, copies, e.memory()


def test_param_wait_overlap_matches_no_overlap():
    """overlap_param_gather=1 at W=2: reading each parameter after param_wait gives bitwise
    the parameters of the same run without overlap, at every step and on every rank."""
    steps = 4
    off = sg.run_threads(2, _overlap_rank_body, 0, steps)
    on = sg.run_threads(2, _overlap_rank_body, 1, steps)
    numel = on[0][2].numel
    for rank in range(2):
        for s in range(steps):
            for a, b, c, d in zip(off[rank][0][s], on[rank][0][s], off[rank][1][s],
                                  on[rank][1][s]):
                np.testing.assert_array_equal(a, b)
                np.testing.assert_array_equal(a, c)
                np.testing.assert_array_equal(a, d)
        for a, b in zip(on[0][0][-1], on[1][0][-1]):
            np.testing.assert_array_equal(a, b)  # replicas agree
    assert any(not np.array_equal(a, b) for a, b in zip(on[0][0][0], on[0][0][-1]))  # trained
    print("overlap_param_gather: %d steps at W=2, %d elements: views after param_wait equal "
          "the run without overlap bitwise" % (steps, numel))


def test_overlap_refused_by_a_library_without_it(monkeypatch):
    """A 0.1 library has the same sizeof(sg_config) (the field took the tail padding) but would
    ignore overlap_param_gather: the binding refuses a non-default value there, and param_wait
    is a no-op (nothing can be pending)."""
    real_has = _lib.has
    monkeypatch.setattr(_lib, "has", lambda name: name != "sg_param_wait" and real_has(name))
    with pytest.raises(sg.UnsupportedError, match="overlap_param_gather"):
        sg.Config(overlap_param_gather=1)
    assert sg.Config(overlap_param_gather=0).overlap_param_gather == 0
    comm = sg.Comm.local(1)[0]
    with sg.Engine(comm, **FAST) as e:
        e.add_param("w", 4)
        e.finalize()
        e.param_wait(0)
        e.param_wait(-1)
        with pytest.raises(sg.InvalidArgumentError, match="99"):
            e.param_wait(99)  # checked by the binding instead
    comm.close()


def test_param_wait_errors_and_config():
    with pytest.raises(sg.InvalidArgumentError, match="overlap_param_gather"):
        sg.Config(overlap_param_gather=2)
    with pytest.raises(sg.InvalidArgumentError, match="overlap_param_gather"):
        sg.Config(overlap_param_gather=-1)
    assert sg.Config(overlap_param_gather=True).overlap_param_gather == 1
    with pytest.raises(TypeError):
        sg.Config(overlap_param_gather="yes")
    comm = sg.Comm.local(1)[0]
    with sg.Engine(comm, overlap_param_gather=1, **FAST) as e:
        e.add_param("w", 100)
        e.add_param("b", 3)
        with pytest.raises(sg.InvalidStateError, match="sg_param_wait"):
            e.param_wait(0)  # before finalize
        e.finalize()
        for bad in (2, -2, 1 << 20):
            with pytest.raises(sg.InvalidArgumentError) as info:
                e.param_wait(bad)
            # the library's own text, naming the function and the value
            assert info.value.function == "sg_param_wait"
            assert info.value.message == sg.last_error()
            assert info.value.message.startswith("sg_param_wait") and str(bad) in str(info.value)
        with pytest.raises(sg.InvalidArgumentError, match="nope"):
            e.param_wait("nope")
        with pytest.raises(TypeError):
            e.param_wait(1.5)
        with pytest.raises(TypeError):
            e.param_wait(True)
        e.param_wait(np.int64(1))
        e.param_wait(None)
        e.grad_add(0, np.ones(100, np.float32))
        e.step()  # W = 1: nothing to gather, nothing pending
        e.param_wait(-1)
        e.param_wait("b")
    with pytest.raises(sg.InvalidStateError, match="closed"):
        e.param_wait()
    comm.close()


def test_broadcast_params_from_root():
    def body(comm):
        with sg.Engine(comm, **FAST) as e:
            e.add_param("w", 100)
            e.finalize()
            e.set_param(0, np.full(100, float(comm.rank), np.float32))
            e.broadcast_params(1)
            return e.get_param(0), e.get_master(0)

    for p, m in sg.run_threads(3, body):
        np.testing.assert_array_equal(p, 1.0)
        np.testing.assert_array_equal(m, 1.0)


def test_estimate_memory_zero2_vs_ddp():
    numels = [1 << 20, 4096, 1 << 18]
    ddp = sg.estimate_memory(numels, 4, strategy="no_shard", param_dtype="bf16")
    z2 = sg.estimate_memory(numels, 4, strategy="shard_grad_op", param_dtype="bf16",
                            bucket_bytes=1 << 16)
    assert z2.optim_bytes * 4 == pytest.approx(ddp.optim_bytes, rel=0.01)
    assert z2.total_bytes < ddp.total_bytes / 2
    with pytest.raises(sg.InvalidArgumentError, match="world"):
        sg.estimate_memory(numels, 0)
    print("W=4 bf16: DDP-like %.2f MiB, ZeRO-2 %.2f MiB per rank"
          % (ddp.total_bytes / 2**20, z2.total_bytes / 2**20))


def test_set_stream_on_cpu():
    comm = sg.Comm.local(1)[0]
    with sg.Engine(comm, **FAST) as e:
        e.set_stream(None)  # NULL is accepted everywhere
        with pytest.raises(sg.UnsupportedError, match="sg_set_stream"):
            e.set_stream(0x1234)
    comm.close()


def _ckpt_engine(comm, strategy="shard_grad_op", bucket_bytes=1024):
    e = sg.Engine(comm, lr=0.01, strategy=strategy, bucket_bytes=bucket_bytes, **FAST)
    e.add_param("emb", (50, 8))
    e.add_param("bias", 8, no_decay=True)
    e.add_param("out", (8, 30))
    e.finalize()
    return e


def _train(e, steps, seed):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        for i in (2, 1, 0):
            e.grad_add(i, rng.standard_normal(e.param_shape(i)).astype(np.float32))
        e.step()


def test_checkpoint_save_at_w2_load_at_w1_and_export(tmp_path):
    """Saved by 2 thread ranks, loaded by 1 rank with another strategy and bucket size: the
    same parameters and moments, and the next step agrees with a run that never stopped."""
    ck = str(tmp_path / "ck")
    init = np.random.default_rng(1)

    inits = [init.standard_normal(s).astype(np.float32) for s in ((50, 8), (8,), (8, 30))]

    def save_body(comm):
        with _ckpt_engine(comm) as e:
            for i, v in enumerate(inits):
                e.set_param(i, v)
            _train(e, 3, seed=7)  # same gradients on both ranks: the average is the same
            e.save(ck)
            e.export(str(tmp_path / "w.safetensors"))
            state = [(e.get_param(i), e.get_optim_state(i, "m"), e.get_optim_state(i, "v"))
                     for i in range(3)]
            _train(e, 1, seed=8)
            return state, [e.get_param(i) for i in range(3)]

    (state, after), _ = sg.run_threads(2, save_body)
    comm = sg.Comm.local(1)[0]
    with _ckpt_engine(comm, strategy="no_shard", bucket_bytes=1 << 20) as e:
        e.load(ck)
        assert e.lr == np.float32(0.01)  # the lr in effect after the load
        if _lib.has("sg_get_step"):
            assert e.step_count == 3
        for i in range(3):
            np.testing.assert_array_equal(e.get_param(i), state[i][0])
            np.testing.assert_array_equal(e.get_optim_state(i, "m"), state[i][1])
            np.testing.assert_array_equal(e.get_optim_state(i, "v"), state[i][2])
        _train(e, 1, seed=8)
        for i in range(3):
            np.testing.assert_allclose(e.get_param(i), after[i], rtol=1e-6, atol=1e-7)
    comm.close()
    # safetensors: 8-byte header length, JSON header naming every parameter
    import json
    import struct
    raw = open(tmp_path / "w.safetensors", "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    assert {"emb", "bias", "out"} <= set(header)
    assert header["out"]["dtype"] == "F32"
    lo, hi = header["out"]["data_offsets"]
    np.testing.assert_array_equal(
        np.frombuffer(raw[8 + n + lo:8 + n + hi], np.float32), state[2][0].ravel())
    # import into a fresh engine: parameters from the file, state untouched
    comm = sg.Comm.local(1)[0]
    with _ckpt_engine(comm) as e:
        e.import_(str(tmp_path / "w.safetensors"))
        for i in range(3):
            np.testing.assert_array_equal(e.get_param(i), state[i][0])
            assert not e.get_optim_state(i, "m").any()
        with pytest.raises(sg.ShardgradIOError):
            e.load(str(tmp_path / "missing"))
        with pytest.raises(sg.ShardgradIOError):
            e.import_(str(tmp_path / "missing.safetensors"))
    comm.close()


# ------------------------------------------------------------------------------------------
# leaks


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_no_leak_over_1000_create_destroy_cycles():
    g = np.ones(1000, np.float32)

    def cycle():
        comm = sg.Comm.local(1)[0]
        e = sg.Engine(comm, bucket_bytes=4096, **FAST)
        e.add_param("a", 1000)
        e.add_param("b", 10)
        e.finalize()
        e.grad_add(0, g)
        e.step()
        e.memory()
        e.close()
        comm.close()

    for _ in range(100):  # warm up allocator arenas and Python caches
        cycle()
    before = _rss_bytes()
    for _ in range(1000):
        cycle()
    grown = _rss_bytes() - before
    print("RSS growth over 1000 engine create/finalize/step/destroy cycles: %.1f KiB"
          % (grown / 1024))
    # each engine holds > 20 KiB: a leak of one engine per cycle would be > 20 MiB
    assert grown < 4 << 20


# ------------------------------------------------------------------------------------------
# discovery


def _run_python(code, env):
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)


def _copy_package(dest):
    shutil.copytree(os.path.join(REPO, "python", "shardgrad"), dest,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so*"))


def test_discovery_error_lists_paths_tried(tmp_path):
    # a copy of the package outside any checkout, without a library next to it
    _copy_package(tmp_path / "site" / "shardgrad")
    env = dict(os.environ, SHARDGRAD_LIBRARY="/nonexistent/libshardgrad.so",
               PYTHONPATH=str(tmp_path / "site"))
    env.pop("LD_LIBRARY_PATH", None)
    code = ("import shardgrad as sg\n"
            "try:\n    sg.version()\nexcept sg.LibraryNotFoundError as ex:\n"
            "    print('TRIED', len(ex.tried)); print(ex)\n")
    r = _run_python(code, env)
    assert r.returncode == 0, r.stderr
    assert "TRIED" in r.stdout
    assert "/nonexistent/libshardgrad.so (SHARDGRAD_LIBRARY)" in r.stdout
    assert "next to the package" in r.stdout and "system search path" in r.stdout
    assert "pip install ./python" in r.stdout


def test_discovery_source_checkout_build_dir(tmp_path):
    # <checkout>/python/shardgrad imported through PYTHONPATH finds <checkout>/build's library
    # with no environment variable
    co = tmp_path / "checkout"
    _copy_package(co / "python" / "shardgrad")
    shutil.copy(os.path.join(REPO, "CMakeLists.txt"), co / "CMakeLists.txt")
    (co / "build").mkdir()
    shutil.copy(_lib.library_path(), co / "build" / "libshardgrad.so")
    env = dict(os.environ, PYTHONPATH=str(co / "python"))
    env.pop("SHARDGRAD_LIBRARY", None)
    env.pop("LD_LIBRARY_PATH", None)
    r = _run_python("import shardgrad as sg; print(sg.library_path()); print(sg.version())", env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == str(co / "build" / "libshardgrad.so")
    # not a shardgrad checkout: no build/ lookup
    (co / "CMakeLists.txt").write_text("project(other C)\n")
    r = _run_python("import shardgrad as sg\ntry:\n    print(sg.library_path())\n"
                    "except sg.LibraryNotFoundError as ex:\n    print('NOTFOUND')\n", env)
    assert r.returncode == 0, r.stderr
    assert "NOTFOUND" in r.stdout or str(co / "build") not in r.stdout


def test_discovery_next_to_package_and_directory(tmp_path):
    src = _lib.library_path()
    pkg = tmp_path / "site" / "shardgrad"
    _copy_package(pkg)
    shutil.copy(src, pkg / "libshardgrad.so")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    env.pop("SHARDGRAD_LIBRARY", None)
    env.pop("LD_LIBRARY_PATH", None)
    r = _run_python("import shardgrad as sg; print(sg.library_path()); print(sg.version())", env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == str(pkg / "libshardgrad.so")
    env["SHARDGRAD_LIBRARY"] = os.path.dirname(src)  # a directory works too
    r = _run_python("import shardgrad as sg; print(sg.library_path())", env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(os.path.dirname(src))


def test_exact_hparams_and_grad_norm():
    """sg_set_hparams / sg_get_hparams keep doubles exactly; every value is checked first;
    sg_grad_norm gives the norm sg_step then clips with (and reuses)."""
    comm = sg.Comm.local(1)[0]
    with sg.Engine(comm, lr=0.01, timeout_ms=60000) as e:
        w = e.add_param("w", 4)
        e.finalize()
        h = e.hparams()
        assert h["lr"] == float(np.float32(0.01)) and h["beta2"] == float(np.float32(0.999))
        e.set_hparams(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                      max_grad_norm=0.5)
        assert e.hparams() == dict(lr=3e-4, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                                   max_grad_norm=0.5)
        for bad in (dict(beta2=1.0), dict(eps=0.0), dict(lr=-1.0), dict(max_grad_norm=np.inf),
                    dict(weight_decay=np.nan)):
            with pytest.raises(sg.InvalidArgumentError, match="sg_set_hparams"):
                e.set_hparams(**bad)
        assert e.hparams()["beta2"] == 0.95  # nothing changed by the refused calls
        with pytest.raises(sg.InvalidArgumentError, match="group"):
            e.set_hparams(group=16, lr=1.0)
        with pytest.raises(TypeError, match="momentum"):
            e.set_hparams(momentum=0.9)
        e.grad_add(w, np.array([3.0, 4.0, 0.0, 0.0], np.float32))
        assert e.grad_norm() == pytest.approx(5.0)
        info = e.step()
        assert info.grad_norm == pytest.approx(5.0)
        assert info.clip_coef == pytest.approx(0.5 / (5.0 + 1e-6))
        e.grad_add(w, np.array([0.0, 0.0, 0.0, 1.0], np.float32))
        assert e.grad_norm() == pytest.approx(1.0)
        e.grad_add(w, np.array([0.0, 0.0, 0.0, 1.0], np.float32))  # arrives after: recomputed
        assert e.step().grad_norm == pytest.approx(2.0)
    comm.close()
