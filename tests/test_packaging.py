"""A built wheel (as a Docker image or `pip install .` gets) holds every package the code imports."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_every_package(tmp_path):
    pytest.importorskip("setuptools")
    shutil.rmtree(ROOT / "build", ignore_errors=True)  # setuptools builds in-tree: no stale copies
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
                    str(ROOT)], check=True, cwd=tmp_path, timeout=300)
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    (wheel,) = tmp_path.glob("trellis-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = [d for d in ROOT.iterdir() if (d / "__init__.py").is_file() and d.name != "tests"]
    packages = sorted(str(p.parent.relative_to(ROOT)) for d in tops for p in d.rglob("__init__.py"))
    assert packages, "no packages found"
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert not missing, f"packages left out of the wheel: {missing}"
    assert "trellis/tulip/v1/tulip_pb2.py" in names  # the generated stubs travel too
    assert "presets/nmt_nfkc.charsmap.gz" in names  # the stand-in tokenizer's normalizer
