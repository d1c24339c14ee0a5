"""What a built wheel ships: the product and the demo's minimal lab, never the test lab.

The wheel is built from a copy of the working tree (nothing is written into the checkout). With
the ``wheel`` package (or setuptools >= 70.1) pip builds a real wheel offline; without it,
setuptools' ``build_py`` writes the tree that ``bdist_wheel`` zips for a pure-Python project.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parent.parent

DEMO_LAB = ["mlxwatch/_lab/server.py", "mlxwatch/_lab/relaunch.py", "mlxwatch/_lab/tiny_model.py",
            "mlxwatch/_lab/fault_server.py", "mlxwatch/_lab/inject/sitecustomize.py"]
SHIM = ["mlxwatch/shim/boot/sitecustomize.py", "mlxwatch/shim/agent.py", "mlxwatch/shim/layout.py"]
EXAMPLE = "mlxwatch/data/mlxwatch.example.yaml"
TEST_ONLY = ("standin.py", "clients.py", "ports.py", "cli.py")  # the test lab's modules (tests/lab)


def _can_build_wheel() -> bool:
    version = tuple(int(p) for p in setuptools.__version__.split(".")[:2])
    return importlib.util.find_spec("wheel") is not None or version >= (70, 1)


def shipped_files(src: Path, out: Path) -> dict[str, bytes]:
    """Build ``src`` (a project tree) and return the package files it ships, by path."""
    work = out / "src"
    work.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(src / name, work / name)
    # symlinks=False: the example config in mlxwatch/data is a link, shipped as its content
    shutil.copytree(src / "mlxwatch", work / "mlxwatch", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if _can_build_wheel():
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out / "dist"), str(work)], check=True, capture_output=True, timeout=300)
        with zipfile.ZipFile(next((out / "dist").glob("mlxwatch-*.whl"))) as wheel:
            return {n: wheel.read(n) for n in wheel.namelist() if n.startswith("mlxwatch/")}
    lib = out / "lib"
    subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
                    "--build-lib", str(lib)], cwd=work, check=True, capture_output=True, timeout=300)
    return {p.relative_to(lib).as_posix(): p.read_bytes() for p in lib.rglob("*") if p.is_file()}


def test_the_wheel_ships_the_demo_lab_the_shim_and_the_example_but_no_test_helpers(tmp_path):
    files = shipped_files(ROOT, tmp_path)
    names = set(files)
    assert not [n for n in names if n.startswith("mlxwatch/lab/")], "the test lab is in the wheel"
    assert not [n for n in names if n.startswith("tests/") or n.rsplit("/", 1)[-1] in TEST_ONLY]
    assert not [n for n in names if b"def free_port" in files[n]]
    for name in DEMO_LAB + SHIM + [EXAMPLE]:
        assert name in names, f"{name} is missing from the wheel"
    assert files[EXAMPLE] == (ROOT / "mlxwatch.example.yaml").read_bytes()
