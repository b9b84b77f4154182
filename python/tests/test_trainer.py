"""transformers.Trainer with ShardedAdamW (optimizers=(opt, scheduler)) against
torch.optim.AdamW under DDP, at W=2 (torchrun, gloo for torch and for shardgrad through
Comm.from_torch(); and under mpirun with MPI where the library has it), on a 2-layer GPT-2 built
from a config (nothing is downloaded), 20 steps, Trainer's default max_grad_norm=1.0.

Issue 24: accelerate >= 1.16 clips by computing the norm from p.grad itself
(Accelerator._clip_grad_norm_dtensor_aware: torch.nn.utils.get_total_norm over the .grads, then
clip_grads_with_norm_); ShardedAdamW's p.grad are ShardGrads whose norm is the library's true
global norm and whose mul_ scales the library's gradient. Before, .grad was None there: a norm
of 0.0 at every step, nothing clipped, losses 0.028 apart.

Tolerance: per-step losses within 1e-5 and Trainer's logged gradient norms within 1e-5 relative
(measured: ~2e-7; the two runs differ only in the order the ranks' gradients are summed and in
forming the norm from per-parameter norms (torch) or at once (the library)). Runtime: ~40 s per
launcher (two processes importing transformers)."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # Trainer needs it

import shardgrad as sg  # noqa: E402
from shardgrad import _lib  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 20


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(out):
    with open(out) as f:
        res = json.load(f)
    t, s = res["torch"], res["sharded"]
    assert t["wrapped"] == "DistributedDataParallel"  # the reference is DDP
    assert s["wrapped"] == "GPT2LMHeadModel"  # not wrapped: the optimizer reduces
    assert len(t["loss"]) == len(s["loss"]) == STEPS
    assert all(n is not None and n > 0 for n in s["grad_norm"]), s["grad_norm"]
    dl = max(abs(a - b) for a, b in zip(t["loss"], s["loss"]))
    dn = max(abs(a - b) / a for a, b in zip(t["grad_norm"], s["grad_norm"]))
    print("Trainer, %d steps at W=2: loss %.4f -> %.4f (DDP + AdamW) / %.4f (ShardedAdamW); "
          "grad norm %.4f / %.4f at step 1; max loss difference %.2g, max grad-norm relative "
          "difference %.2g" % (STEPS, t["loss"][0], t["loss"][-1], s["loss"][-1],
                               t["grad_norm"][0], s["grad_norm"][0], dl, dn))
    assert dl <= 1e-5 and dn <= 1e-5
    assert s["loss"][-1] < s["loss"][0] - 1.0  # it learns
    assert max(s["grad_norm"]) > 1.0  # clipping at 1.0 was active in some step


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(_free_port()), TOKENIZERS_PARALLELISM="false")


def test_trainer_under_torchrun_matches_ddp(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun not installed beside %s" % sys.executable)
    if not _lib.has("sg_comm_create_xport"):
        pytest.skip("libshardgrad without the torch.distributed transport")
    out = str(tmp_path / "trainer.json")
    env = _env()
    r = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", env["MASTER_PORT"],
                        os.path.join(HERE, "trainer_helper.py"), out, str(STEPS)],
                       env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    _check(out)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_trainer_under_mpirun_matches_ddp(tmp_path):
    if not sg.has_backend("mpi"):
        pytest.skip("libshardgrad built without MPI")
    out = str(tmp_path / "trainer.json")
    env = dict(_env(), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    r = subprocess.run(["mpirun", "-np", "2", "-x", "MASTER_PORT", "-x", "MASTER_ADDR", "-x",
                        "PYTHONPATH", "-x", "SHARDGRAD_LIBRARY", "-x", "OMP_NUM_THREADS",
                        sys.executable, os.path.join(HERE, "trainer_helper.py"), out,
                        str(STEPS)], env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    _check(out)


HF_TRAINER = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "python",
                          "hf_trainer.py")


@pytest.mark.parametrize("nproc", [1, 2])
def test_hf_trainer_example_runs_and_prints_a_nonzero_grad_norm(nproc):
    """examples/python/hf_trainer.py as its docstring says to run it: plain python (a process
    group of one) and torchrun --nproc_per_node 2."""
    if nproc == 1:
        cmd = [sys.executable, HF_TRAINER, "--steps", "3"]
    else:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        if not os.path.exists(torchrun):
            pytest.skip("torchrun not installed beside %s" % sys.executable)
        if not _lib.has("sg_comm_create_xport"):
            pytest.skip("libshardgrad without the torch.distributed transport")
        cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(_free_port()),
               HF_TRAINER, "--steps", "3"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "%d rank%s, GPT2LMHeadModel" % (nproc, "" if nproc == 1 else "s") in r.stdout
    norms = [float(line.split()[-1]) for line in r.stdout.splitlines()
             if line.startswith("step ")]
    assert len(norms) == 3 and min(norms) > 0
