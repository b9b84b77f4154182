"""The version is written once, in include/shardgrad.h: the loaded library, shardgrad.__version__
and (when the package is installed) its metadata all say what the header says."""

import os
import re

import shardgrad

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def header_version():
    with open(os.path.join(REPO, "include", "shardgrad.h"), encoding="utf-8") as f:
        text = f.read()
    parts = [re.search(r"^#define SG_VERSION_%s (\d+)$" % p, text, re.M) for p in
             ("MAJOR", "MINOR", "PATCH")]
    assert all(parts), "include/shardgrad.h lacks a SG_VERSION_ line"
    return tuple(int(m.group(1)) for m in parts)


def test_library_and_package_say_the_header_version():
    v = header_version()
    assert shardgrad.version() == v
    assert shardgrad.__version__ == "%d.%d.%d" % v


def test_unknown_attribute_still_raises():
    try:
        shardgrad.no_such_attribute
    except AttributeError as ex:
        assert "no_such_attribute" in str(ex)
    else:
        raise AssertionError("shardgrad.no_such_attribute did not raise")
