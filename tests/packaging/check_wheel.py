"""Checks a built torchleaf wheel's contents (run by wheel_test.sh).

Usage: check_wheel.py WHEEL
"""

import email.parser
import os
import re
import site
import subprocess
import sys
import tempfile
import zipfile

wheel = sys.argv[1]
names = zipfile.ZipFile(wheel).namelist()
errors = []


def need(pattern, what):
    if not any(re.fullmatch(pattern, n) for n in names):
        errors.append(f"missing {what} ({pattern})")


need(r"torchleaf/__init__\.py", "the Python package")
need(r"torchleaf/_C\.cpython-[^/]+\.so", "the extension torchleaf._C")
need(r"torchleaf/lib/libtorchleaf\.so", "libtorchleaf")
need(r"torchleaf/include/torchleaf/torchleaf\.h", "the umbrella C++ header")
need(r"torchleaf/include/torchleaf/leaf\.h", "the C++ headers")
for f in ("torchleafConfig", "torchleafConfigVersion", "torchleafTargets", "torchleafTargets-release"):
    need(rf"torchleaf/share/cmake/torchleaf/{f}\.cmake", "the CMake package")

for n in names:
    top = n.split("/")[0]
    if top != "torchleaf" and not top.endswith(".dist-info"):
        errors.append(f"unexpected top-level entry {n}")
    if re.search(r"(^|/)(tests?|testing)(/|$)|test_|gtest|testleaves|__pycache__|\.o$", n):
        errors.append(f"test or build artifact in the wheel: {n}")

zf = zipfile.ZipFile(wheel)
# Nothing may point back at the build machine: not at the torch the wheel was
# built against (exported link paths, RUNPATH), not at the source tree.
here = os.path.dirname(os.path.abspath(__file__))
build_paths = {os.path.dirname(os.path.dirname(here)), os.path.realpath(sys.prefix), sys.prefix}
build_paths |= {os.path.realpath(p) for p in site.getsitepackages()}
with tempfile.TemporaryDirectory() as tmp:
    for n in names:
        if n.endswith(".cmake"):
            text = zf.read(n).decode()
            errors += [f"{n} names the build path {p}" for p in build_paths if p in text]
        elif n.endswith(".so"):
            path = zf.extract(n, tmp)
            dyn = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
            for line in dyn.splitlines():
                if "RPATH" in line or "RUNPATH" in line:
                    entries = line.split("[", 1)[1].rstrip("]").split(":")
                    errors += [f"{n}: absolute RUNPATH entry {e}" for e in entries if not e.startswith("$ORIGIN")]

meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
msg = email.parser.Parser().parsestr(zf.read(meta).decode())
runtime = [r for r in msg.get_all("Requires-Dist") or [] if "extra ==" not in r]
if len(runtime) != 1 or sorted(runtime[0].replace(" ", "").removeprefix("torch").split(",")) != ["<2.16", ">=2.13"]:
    errors.append(f"runtime dependencies {runtime}, expected only torch>=2.13,<2.16")

if errors:
    print("\n".join(["wheel check FAILED:"] + errors + ["entries:"] + names))
    sys.exit(1)
print(f"{len(names)} entries; runtime dependencies: {runtime}")
