"""Test setup: import the package from this checkout and find a built libshardgrad.

SHARDGRAD_LIBRARY wins when set (scripts/test.sh points it at build/libshardgrad.so);
otherwise the newest libshardgrad.so under <repo>/build*/ is used.
"""

import glob
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.dirname(HERE)
REPO = os.path.dirname(PYDIR)

for p in (PYDIR, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)


def _find_build_library():
    cands = [os.path.join(REPO, "build", "libshardgrad.so")]
    cands += sorted(glob.glob(os.path.join(REPO, "build*", "libshardgrad.so")),
                    key=os.path.getmtime, reverse=True)
    for c in cands:
        if os.path.exists(c):
            return c
    return None


if not os.environ.get("SHARDGRAD_LIBRARY"):
    lib = _find_build_library()
    if lib:
        os.environ["SHARDGRAD_LIBRARY"] = lib

# Subprocesses (mpirun helpers) import the package the same way.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [PYDIR, HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one intra-op thread for a module's tests, restored after it: rank threads on two
    cores, one intra-op thread each, keep the runs predictable. A torch test module asks for it
    with pytestmark = pytest.mark.usefixtures("one_torch_thread")."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_report_header(config):
    return "shardgrad library: %s" % os.environ.get("SHARDGRAD_LIBRARY", "(search path)")
