"""Comm.from_torch (issue 16 item 1): a script written for torch.distributed, unchanged, under
mpirun and under torchrun --nproc_per_node 2 (gloo, CPU); hybrid sharding over its splits under
torchrun --nproc_per_node 4.

Runtime: ~20 s per launcher on 2 busy cores (each rank imports torch), ~40 s for the 4 ranks."""

import json
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import shardgrad as sg  # noqa: E402
from shardgrad import _lib  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
HELPER = os.path.join(HERE, "torch_dist_helper.py")
MPI_ENV = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMP_NUM_THREADS="1")


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(out, kind):
    with open(out) as f:
        res = json.load(f)
    print("%s: %d ranks, global loss %s, max |param - DDP + torch.optim.AdamW| %.2g"
          % (res["kind"], res["world"], ["%.4f" % v for v in res["losses"]],
             res["max_diff_vs_torch"]))
    assert res["kind"] == kind and res["world"] == 2
    assert res["ranks_equal"]
    assert res["max_diff_vs_torch"] <= res["tol"]
    assert res["losses"][-1] < res["losses"][0]


def test_from_torch_needs_a_process_group():
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(sg.InvalidStateError, match="init_process_group"):
        sg.Comm.from_torch()


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_from_torch_under_mpirun_uses_mpi(tmp_path):
    if not sg.has_backend("mpi"):
        pytest.skip("libshardgrad built without MPI")
    out = str(tmp_path / "mpi.json")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), **MPI_ENV)
    r = subprocess.run(["mpirun", "-np", "2", "-x", "MASTER_ADDR", "-x", "MASTER_PORT",
                        "-x", "PYTHONPATH", "-x", "SHARDGRAD_LIBRARY", sys.executable, HELPER, out],
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    _check(out, "mpi")


def _torchrun(tmp_path, nproc, *mode, need_xport=True):
    """HELPER under torchrun --nproc_per_node nproc: (the completed process, its JSON path)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun not installed beside %s" % sys.executable)
    if need_xport and not _lib.has("sg_comm_create_xport"):
        pytest.skip("libshardgrad without the torch.distributed transport")
    out = str(tmp_path / ("%s.json" % (mode[0] if mode else "torchrun")))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([torchrun, "--nproc_per_node", str(nproc), "--master_port",
                        str(_free_port()), HELPER, out] + list(mode), env=env,
                       capture_output=True, text=True, timeout=240)
    return r, out


def test_from_torch_under_torchrun(tmp_path):
    r, out = _torchrun(tmp_path, 2, need_xport=False)
    if not _lib.has("sg_comm_create_xport"):
        # without the torch.distributed transport: a clear refusal that names the way out
        assert r.returncode != 0
        assert "torch.distributed transport" in r.stderr and "mpirun" in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stdout + r.stderr
    _check(out, "torch")


def test_hybrid_under_torchrun_4_ranks(tmp_path):
    """torchrun --nproc_per_node 4: Comm.from_torch().split_nodes(2) as 2 nodes x 2 ranks over
    the gloo group, ShardedAdamW(node, replica_comm=replica) against flat ShardedAdamW and DDP +
    torch.optim.AdamW, each within TOL (only the order of the ranks' sums differs)."""
    r, out = _torchrun(tmp_path, 4, "hybrid")
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out) as f:
        res = json.load(f)
    print(res)
    assert res["kind"] == "torch" and res["world"] == 4 and res["sizes"] == [2, 2]
    assert res["host_sizes"] == [4, 1]  # by host name: one machine, one node
    assert res["ranks_equal"]
    for k in ("hybrid_vs_flat", "hybrid_vs_torch", "flat_vs_torch"):
        assert res[k] <= res["tol"], (k, res[k])
    assert res["losses"][-1] < res["losses"][0]


def test_torchrun_peer_process_dies(tmp_path):
    """Rank 1 exits after building its optimizer: rank 0's step fails within the timeout (5 s)
    with CommError (gloo saw the connection close) or TimeoutError, and closing works."""
    r, out = _torchrun(tmp_path, 2, "dead")
    assert os.path.exists(out), r.stdout + r.stderr
    with open(out) as f:
        res = json.load(f)
    print(res)
    assert res["error"] in ("CommError", "ShardgradTimeoutError"), res
    assert res["seconds"] < 30, res
