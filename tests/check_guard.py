#!/usr/bin/env python3
"""Every public function that takes an engine enters its guard first (issue 14, item 12).

Lists the functions of include/shardgrad.h whose first parameter is an sg_engine *, finds each
one's definition under src/, and fails unless its first statement is SG_ENGINE_GUARD(e, "name")
(sg_engine_destroy: sg__guard_enter on the engine). A new public engine function without the
guard would let a second thread in unnoticed."""

import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
header = open(os.path.join(root, "include", "shardgrad.h")).read()
header = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
names = sorted(set(re.findall(r"SG_API\s+[\w\s\*]*?\b(sg_\w+)\s*\(\s*(?:const\s+)?sg_engine\s*\*",
                              header)))
sources = {}
for d, _, fs in os.walk(os.path.join(root, "src")):
    for f in fs:
        if f.endswith(".c"):
            p = os.path.join(d, f)
            sources[p] = open(p).read()
bad = []
for n in names:
    found = None
    for p, s in sources.items():
        m = re.search(r"^(?:sg_status|void)\s+%s\s*\(\s*sg_engine\s*\*\s*(\w+)[^;{]*\{\s*" % n, s,
                      re.M)
        if m:
            found = (p, m.group(1), s[m.end():m.end() + 300])
            break
    if not found:
        bad.append("%s: no definition found under src/" % n)
        continue
    p, var, body = found
    if n == "sg_engine_destroy":
        ok = "sg__guard_enter(&%s->guard" % var in body
    else:
        ok = body.startswith('SG_ENGINE_GUARD(%s, "%s");' % (var, n))
    if not ok:
        bad.append("%s (%s): the first statement is not SG_ENGINE_GUARD(%s, \"%s\")"
                   % (n, os.path.relpath(p, root), var, n))
print("%d public engine functions checked" % len(names))
for b in bad:
    print("FAIL " + b)
sys.exit(1 if bad or len(names) < 30 else 0)
