"""What the package installs, and what a checkout puts on sys.path.

- `import kernels` is PyPI's package (transformers imports it), never this checkout's:
  the top-level kernels/ holds the spec and no Python, so with the repository root on
  sys.path (`python -m`, pytest from the root) it is at most a namespace portion, which
  never shadows a regular package.
- The sdist, and the wheel built from it, hold every module under gateeng/ and the C++
  sources the CPU plans build on first use.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ROOT / "kernels"            # (the venv may live in the checkout too)


def run_from_root(code: str, **env) -> dict:
    """Runs `python -c code` with the checkout's root as cwd, so sys.path[0] is the root
    (as under `python -m` or pytest from there); `code` prints one JSON line."""
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, **env})
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


WHERE = """
import importlib.util, json, sys
spec = importlib.util.find_spec("kernels")
print(json.dumps(None if spec is None else {
    "origin": spec.origin if spec.has_location else None,
    "locations": list(spec.submodule_search_locations or []),
    "path0": sys.path[0]}))
"""


def test_the_checkout_has_no_python_in_kernels():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert not list((ROOT / "kernels").glob("*.py"))
    assert not (ROOT / "kernels.py").exists()


def test_a_regular_kernels_package_wins_over_the_checkout(tmp_path):
    # A stand-in for PyPI's `kernels`, on sys.path *after* the checkout's root.
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    where = run_from_root(WHERE, PYTHONPATH=str(tmp_path))
    assert where["path0"] in ("", str(ROOT))
    assert where["origin"] == str(tmp_path / "kernels" / "__init__.py")


def test_import_kernels_from_the_root_is_never_the_checkouts():
    where = run_from_root(WHERE)
    if where is None:
        return                                      # PyPI's kernels is not installed
    if where["origin"] is None:                     # not installed: only a namespace portion
        assert where["locations"] == [str(OURS)]
    else:
        assert not Path(where["origin"]).resolve().is_relative_to(OURS), where
        assert str(OURS) not in where["locations"], where


def test_transformers_imports_its_kernels_from_the_root():
    pytest.importorskip("transformers")
    seen = run_from_root("""
import json, sys
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
from transformers.utils import import_utils
available = import_utils.is_kernels_available()
import transformers.integrations.hub_kernels
print(json.dumps({"available": available, "modules": {
    name: [getattr(m, "__file__", None), list(getattr(m, "__path__", []))]
    for name, m in sys.modules.items() if name == "kernels" or name.startswith("kernels.")}}))
""")
    for name, (file, path) in seen["modules"].items():
        if file is None:
            # Without PyPI's kernels, transformers' last-resort import finds the checkout's
            # folder as an empty namespace and counts it as not installed.
            assert (name, path, seen["available"]) == ("kernels", [str(OURS)], False)
        else:
            assert not Path(file).resolve().is_relative_to(OURS), (name, file)


def copy_source(dest: Path) -> Path:
    """The files an sdist is built from: pyproject, README and the two source folders."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    for name in ("gateeng", "kernels"):
        shutil.copytree(ROOT / name, dest / name, ignore=skip)
    return dest


def build(kind: str, src: Path, out: Path) -> Path:
    res = subprocess.run([sys.executable, "-c",
                          f"from setuptools import build_meta as b; print(b.build_{kind}({str(out)!r}))"],
                         cwd=src, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return out / res.stdout.strip().splitlines()[-1]


def test_the_sdist_and_its_wheel_hold_every_module_and_the_cpp_sources(tmp_path):
    pytest.importorskip("setuptools")
    src = copy_source(tmp_path / "src")
    sdist = build("sdist", src, tmp_path / "dist")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    wheel = build("wheel", unpacked, tmp_path / "wheel")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {p.relative_to(src).as_posix() for p in (src / "gateeng").rglob("*")
              if p.suffix in (".py", ".cpp")}
    assert {"gateeng/kernels/cpu_ops.cpp", "gateeng/kernels/ref_ops.cpp",
            "gateeng/train/policy.py", "gateeng/v1/engine_pb2.py"} <= wanted
    assert wanted - names == set()
    assert not [n for n in names if n.split("/")[0] == "kernels"]

    # Installed alone (the wheel's files first on sys.path, not the checkout), the
    # package finds its C++ sources.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    res = subprocess.run([sys.executable, "-c", """
import gateeng.kernels, gateeng.train
from gateeng.plans import cpu_ops, reference_ops
print(gateeng.kernels.__file__, cpu_ops.SOURCE.is_file(), reference_ops.SOURCE.is_file())"""],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == [str(site / "gateeng" / "kernels" / "__init__.py"), "True", "True"]
