"""Test setup: import the package from this checkout and find a built libshardgrad.

SHARDGRAD_LIBRARY wins when set (scripts/test.sh points it at build/libshardgrad.so);
otherwise the newest libshardgrad.so under <repo>/build*/ is used.
"""

import glob
import os
import sys

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


def pytest_report_header(config):
    return "shardgrad library: %s" % os.environ.get("SHARDGRAD_LIBRARY", "(search path)")
