"""pip and the wheel's distribution name: a kvstack wheel is the distribution `nixl` with kvstack's
local version (installer/wheel.py names it so, through the same wheelformat calls as here), so in
one environment pip replaces PyPI's `nixl` meta package with it, and it with PyPI's, file for
file, instead of writing one's nixl/ over the other's. Offline: both wheels are made here, with
kvstack's real `nixl` package in ours and a stand-in for PyPI's."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from installer import nixlpackage, wheel, wheelformat

pytestmark = pytest.mark.integration
TAG = wheelformat.Tag("py3", "none", "any")
MANIFEST = {"build_id": "cpu-0123456789ab", "recipe": {"components": {"nixl": {"source": "nixl"}},
                                                         "sources": {"nixl": {"tag": "v1.4.0"}}}}


def _wheel(out: Path, version: str, files: dict[str, bytes]) -> Path:
    name = nixlpackage.PACKAGE
    dist_info = f"{wheelformat.distribution_filename(name)}-{version}.dist-info"
    entries = [wheelformat.Entry(p, d) for p, d in files.items()] + [
        wheelformat.Entry(f"{dist_info}/METADATA",
                          wheelformat.metadata_text(name, version, "t", [], "3")),
        wheelformat.Entry(f"{dist_info}/WHEEL", wheelformat.wheel_text(TAG, "test"))]
    dest = out / wheelformat.wheel_name(name, version, TAG)
    wheelformat.write(dest, entries, dist_info)
    return dest


def _pip(py: Path, *args: str) -> None:
    r = subprocess.run([str(py), "-m", "pip", "--disable-pip-version-check", "-q", *args,
                        "--no-index", "--no-deps"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_kvstack_wheel_and_pypis_nixl_replace_each_other(tmp_path):
    r = subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "v")], capture_output=True,
                       text=True, timeout=120)
    if r.returncode:
        pytest.skip(f"no venv with pip here: {r.stderr.strip()[-200:]}")
    py = tmp_path / "v" / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True).stdout.strip())
    pypi = _wheel(tmp_path, "1.5.1", {"nixl/__init__.py": b"# PyPI's meta package\n",
                                      "nixl/_api.py": b"", "nixl_meta_utils.py": b""})
    ours = _wheel(tmp_path, wheel.version(MANIFEST), {
        "nixl/__init__.py": nixlpackage.source("nixl_cpu", "cpu", MANIFEST["build_id"]).encode(),
        "nixl_cpu/__init__.py": b""})
    assert ours.name == "nixl-1.4.0+kvstack.cpu.0123456789ab-py3-none-any.whl"
    _pip(py, "install", str(pypi))
    _pip(py, "install", str(ours))
    assert nixlpackage.is_kvstack(site / "nixl")
    assert not (site / "nixl" / "_api.py").exists() and not (site / "nixl_meta_utils.py").exists()
    _pip(py, "install", str(pypi))  # PyPI's again (an engine pinning it): ours goes whole
    assert not nixlpackage.is_kvstack(site / "nixl") and not (site / "nixl_cpu").exists()
