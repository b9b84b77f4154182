"""shardgrad's safetensors files against the `safetensors` package (issue 14, items 6 and 11).

- sg_export with names in many scripts (accents, CJK, emoji, quotes, control characters) is
  read by the `safetensors` package, with the same names and values.
- A name that is not well-formed UTF-8 (a Python str with a lone surrogate) is refused by
  add_param with InvalidArgumentError naming UTF-8, and the engine keeps working.
- The reader follows the reference: for a table of hand-made files, sg_import accepts exactly
  the files that safetensors.numpy.load accepts (for files naming the engine's parameter).

Skipped where the `safetensors` package is not installed (the project's venv has it)."""

import json
import struct

import numpy as np
import pytest

import shardgrad as sg

st_numpy = pytest.importorskip("safetensors.numpy")

NAMES = ["café.weight", "日本語.bias", "emoji😀", "quote\"back\\slash", "tab\there",
         "\U0010ffff", "plain.layer.0"]


def _engine(names_sizes):
    comm = sg.Comm.local(1)[0]
    e = sg.Engine(comm, timeout_ms=30000)
    for n, k in names_sizes:
        e.add_param(n, k)
    e.finalize()
    return comm, e


def test_export_with_unicode_names_reads_in_safetensors(tmp_path):
    comm, e = _engine([(n, 3 + i) for i, n in enumerate(NAMES)])
    try:
        for i in range(len(NAMES)):
            e.set_param(i, np.arange(3 + i, dtype=np.float32) * (i + 1))
        path = str(tmp_path / "u.safetensors")
        e.export(path)
        d = st_numpy.load_file(path)
        assert sorted(d) == sorted(NAMES)
        for i, n in enumerate(NAMES):
            np.testing.assert_array_equal(d[n], np.arange(3 + i, dtype=np.float32) * (i + 1))
    finally:
        e.close()
        comm.close()


def test_names_that_are_not_utf8_are_refused():
    comm = sg.Comm.local(1)[0]
    e = sg.Engine(comm)
    try:
        for bad in ["lone\ud800surrogate", "\udcff", "__metadata__"]:
            with pytest.raises(sg.InvalidArgumentError, match="UTF-8|reserved"):
                e.add_param(bad, 4)
        assert e.add_param("ok", 4) == 0
        e.finalize()
    finally:
        e.close()
        comm.close()


F32 = {"dtype": "F32", "shape": [1]}


def _file(header, data_len, raw=None):
    h = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + bytes(data_len)


# (label, bytes): each file names tensor "a" (F32, one element) unless it is broken.
CASES = [
    ("plain", _file({"a": dict(F32, data_offsets=[0, 4])}, 4)),
    ("metadata strings", _file({"__metadata__": {"k": "v"}, "a": dict(F32, data_offsets=[0, 4])}, 4)),
    ("metadata null", _file({"__metadata__": None, "a": dict(F32, data_offsets=[0, 4])}, 4)),
    ("extra key", _file({"a": dict(F32, data_offsets=[0, 4], x=[1])}, 4)),
    ("out of order", _file({"b": dict(F32, data_offsets=[4, 8]), "a": dict(F32, data_offsets=[0, 4])}, 8)),
    ("empty tensor", _file({"a": dict(F32, data_offsets=[0, 4]),
                            "z": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}}, 4)),
    ("other dtypes", _file({"a": dict(F32, data_offsets=[0, 4]),
                            "i": {"dtype": "I64", "shape": [2], "data_offsets": [4, 20]}}, 20)),
    ("overlap", _file({"a": dict(F32, data_offsets=[0, 4]), "b": dict(F32, data_offsets=[0, 4])}, 4)),
    ("trailing bytes", _file({"a": dict(F32, data_offsets=[0, 4])}, 8)),
    ("gap", _file({"a": dict(F32, data_offsets=[4, 8])}, 8)),
    ("past the end", _file({"a": dict(F32, data_offsets=[0, 4])}, 2)),
    ("metadata number", _file({"__metadata__": {"k": 1}, "a": dict(F32, data_offsets=[0, 4])}, 4)),
    ("metadata object", _file({"__metadata__": {"k": {"x": "y"}}, "a": dict(F32, data_offsets=[0, 4])}, 4)),
    ("metadata string", _file({"__metadata__": "s", "a": dict(F32, data_offsets=[0, 4])}, 4)),
    ("backwards", _file({"a": {"dtype": "F32", "shape": [0], "data_offsets": [4, 0]}}, 4)),
    ("unknown dtype", _file({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 4]}}, 4)),
    ("size mismatch", _file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, 4)),
    ("not utf-8", _file(None, 8, raw=b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                    b'"\xff":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}')),
    ("trailing characters", _file(None, 4, raw=b'{"a":{"dtype":"F32","shape":[1],'
                                              b'"data_offsets":[0,4]}}x')),
    ("header too large", struct.pack("<Q", 100_000_001) + b"{}"),
    ("header past the file", struct.pack("<Q", 1000) + b"{}"),
]


@pytest.mark.parametrize("label,blob", CASES, ids=[c[0] for c in CASES])
def test_reader_agrees_with_the_reference(tmp_path, label, blob):
    try:
        st_numpy.load(blob)
        reference_ok = True
    except Exception:
        reference_ok = False
    path = str(tmp_path / "x.safetensors")
    with open(path, "wb") as f:
        f.write(blob)
    comm, e = _engine([("a", 1)])
    try:
        try:
            e.import_(path)
            ours_ok = True
        except sg.CorruptError as ex:
            ours_ok = False
            assert "malformed" not in str(ex) or label == "trailing characters", str(ex)
        assert ours_ok == reference_ok, (label, reference_ok)
    finally:
        e.close()
        comm.close()
