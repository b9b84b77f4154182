"""The Python package's layers (issue 25 item 5), read from the source: no module imports one
that imports it back (directly or around a longer circle), and the ctypes layer knows no
tensor framework: outside shardgrad/torch/ no module imports torch or shardgrad.torch, except
the package's front door (__init__.py), which attaches Comm.from_torch and
Engine.param_tensor/grad_tensor and imports shardgrad.torch inside them, on their first call.
Every import counts, the ones inside functions too (that is how a circle hides). Then, at run
time, `import shardgrad` loads no torch, and every module imports."""

import ast
import importlib
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PKG_DIR = os.path.join(os.path.dirname(HERE), "shardgrad")


def _modules():
    """{dotted name: path} of every module of the package."""
    out = {}
    for root, _, files in os.walk(PKG_DIR):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), os.path.dirname(PKG_DIR))
                name = rel[:-3].replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = \
                    os.path.join(root, f)
    return out


def _imports(name, path, modules):
    """[(imported module, at module level)] of `name`: `from X import y` counts as X.y when
    that is a module of the package, else as X; relative imports resolved."""
    tree = ast.parse(open(path).read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                sub = base + "." + a.name
                out.append((sub if sub in modules else base, id(node) in top))
    return out


def _graph():
    modules = _modules()
    return modules, {m: _imports(m, p, modules) for m, p in modules.items()}


def test_every_import_of_the_package_names_one_of_its_modules():
    """A relative import left pointing at the old place (`from .core import` in a module that
    moved one folder down) would fail only when that code runs."""
    modules, graph = _graph()
    bad = ["%s imports %s" % (m, t) for m in sorted(modules) for t, _ in graph[m]
           if (t == "shardgrad" or t.startswith("shardgrad.")) and t not in modules]
    assert not bad, "; ".join(bad)


def test_no_module_imports_one_that_imports_it_back():
    modules, graph = _graph()
    edges = {m: sorted({t for t, _ in graph[m] if t in modules and t != m}) for m in modules}
    state, path = {}, []

    def visit(m):  # depth first: a module met again while on the path closes a circle
        state[m] = "open"
        path.append(m)
        for t in edges[m]:
            if state.get(t) == "open":
                circle = path[path.index(t):] + [t]
                pytest.fail("import circle: " + " -> ".join(circle))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = "done"

    for m in sorted(modules):
        if m not in state:
            visit(m)
    assert "shardgrad.torch.optim" in modules and "shardgrad.core" in modules


def _is_torch(target):
    return target == "torch" or target.startswith("torch.") or \
        target == "shardgrad.torch" or target.startswith("shardgrad.torch.")


def test_the_ctypes_layer_imports_no_torch():
    modules, graph = _graph()
    bad = []
    for m in sorted(modules):
        if m == "shardgrad.torch" or m.startswith("shardgrad.torch."):
            continue
        for target, top_level in graph[m]:
            if not _is_torch(target):
                continue
            front_door_ok = (m == "shardgrad" and target.startswith("shardgrad.torch.")
                             and not top_level)
            if not front_door_ok:
                bad.append("%s imports %s" % (m, target))
    assert not bad, "; ".join(bad)


def test_import_shardgrad_loads_no_torch():
    code = ("import sys, shardgrad, shardgrad.core, shardgrad.config, shardgrad.plan, "
            "shardgrad.tracing\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(PKG_DIR)))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_every_module_imports():
    modules = _modules()
    torch_ok = importlib.util.find_spec("torch") is not None
    for m in sorted(modules):
        if _is_torch(m) and not torch_ok:
            continue
        importlib.import_module(m)
    if torch_ok:  # the names users import from the package, where they import them
        from shardgrad.torch import (GradNorm, ShardedAdamW, ShardGrad,  # noqa: F401
                                     comm_from_torch, default_bucket_bytes,
                                     patch_clip_grad_norm, sg_dtype, torch_dtype)
        import shardgrad as sg
        assert callable(sg.Comm.from_torch) and callable(sg.Engine.param_tensor)
        assert callable(sg.Engine.grad_tensor)
