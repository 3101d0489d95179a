"""kvstack's `nixl` package (installer/nixl_alias.py, written by installer/nixlpackage.py) over
fake NIXL backends: pure-Python packages shaped like NIXL's (`_api`, `_bindings`, `logging`), each
import in a fresh interpreter without site-packages (the real ones would add this venv's NIXLs),
so what `import nixl` binds, refuses and warns about is seen as an engine would see it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from installer import envfile, nixlpackage
from installer.errors import PrefixError

API = "class nixl_agent:\n    pass\nclass nixl_agent_config:\n    pass\nLOADS = []\n"


def _backend(site: Path, name: str, init: str = "") -> Path:
    pkg = site / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(init)
    (pkg / "_api.py").write_text(API + f"from {name} import _bindings\n")
    (pkg / "_bindings.py").write_text("import sys\nsys.modules[__name__].HITS = 1\n")
    (pkg / "logging.py").write_text("def get_logger(name):\n    return name\n")
    (pkg / "_kvstack_preload.py").write_text("")  # the wheel's: never aliased
    return pkg


def _site(tmp_path: Path, backend: str = "nixl_cpu") -> Path:
    site = tmp_path / "site"
    _backend(site, backend)
    nixlpackage.write(site, backend, "cpu", "cpu-0123456789ab")
    return site


def _py(code: str, *paths: Path, warnings_are_errors: bool = True) -> subprocess.CompletedProcess:
    flags = ["-W", "error::RuntimeWarning"] if warnings_are_errors else []
    env = {"PYTHONPATH": ":".join(map(str, paths)), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-S", *flags, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)


def _error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0, r.stdout
    return r.stderr.strip().splitlines()[-1]


def test_nixl_and_its_submodules_are_the_backends_own(tmp_path):
    site = _site(tmp_path)
    code = ("import json, sys, nixl, nixl_cpu\n"
            "from nixl._api import nixl_agent, nixl_agent_config\n"
            "import nixl._bindings, nixl.logging\n"
            "print(json.dumps({'api': nixl._api is nixl_cpu._api, 'bindings': nixl._bindings is "
            "nixl_cpu._bindings, 'logging': nixl.logging is nixl_cpu.logging, 'agent': nixl_agent "
            "is nixl_cpu._api.nixl_agent and nixl.nixl_agent is nixl_agent, 'one_bindings': "
            "sorted(n for n in sys.modules if n.endswith('_bindings')), 'preload': "
            "'nixl._kvstack_preload' in sys.modules, 'about': nixl.__kvstack__}))")
    r = _py(code, site)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["api"] and out["bindings"] and out["logging"] and out["agent"], out
    # the module object twice under two names, never a second copy
    assert out["one_bindings"] == ["nixl._bindings", "nixl_cpu._bindings"] and not out["preload"]
    assert out["about"]["backend"] == "nixl_cpu" and out["about"]["build_id"] == "cpu-0123456789ab"
    assert out["about"]["backend_file"] == str((site / "nixl_cpu").resolve())


def test_another_backend_imported_first_is_refused_in_one_line(tmp_path):
    site, other = _site(tmp_path), tmp_path / "pypi"
    _backend(other, "nixl_cu12")
    line = _error_line(_py("import nixl_cu12, nixl", site, other))
    assert line.startswith("ImportError: kvstack's nixl (")
    assert "nixl_cu12 is already imported" in line
    assert str(other / "nixl_cu12" / "__init__.py") in line
    assert "pip uninstall nixl-cu12 nixl" in line


def test_other_nixls_installed_are_named_in_one_warning(tmp_path):
    site, other = _site(tmp_path), tmp_path / "pypi"
    _backend(other, "nixl_cu12")
    (other / "nixl").mkdir()
    (other / "nixl" / "__init__.py").write_text("raise ImportError('PyPI meta: not reached')\n")
    r = _py("import nixl, sys; print(nixl._api.__name__, 'nixl_cu12' in sys.modules)", site, other,
            warnings_are_errors=False)
    assert r.returncode == 0 and r.stdout.split() == ["nixl_cpu._api", "False"], r.stderr
    warned = [ln for ln in r.stderr.splitlines() if "RuntimeWarning" in ln]
    assert len(warned) == 1, r.stderr
    assert f"nixl_cu12 ({(other / 'nixl_cu12').resolve()})" in warned[0]
    assert f"nixl ({(other / 'nixl').resolve()})" in warned[0]
    assert "to keep one NIXL, uninstall them (pip uninstall nixl nixl-cu12)" in warned[0]


def test_a_second_copy_of_the_backend_first_on_the_path_is_refused(tmp_path):
    site, first = _site(tmp_path), tmp_path / "first"
    _backend(first, "nixl_cpu")
    line = _error_line(_py("import nixl", first, site))
    assert "two nixl_cpu are installed" in line
    assert f"{(site / 'nixl_cpu').resolve()} (this build's)" in line
    assert f"{(first / 'nixl_cpu').resolve()} (first on sys.path)" in line


def _torch(where: Path, cuda: str) -> Path:
    (where / "torch").mkdir(parents=True)
    (where / "torch" / "__init__.py").write_text("raise SystemExit('torch must not be imported')\n")
    version = f"__version__ = '2.9.0'\ncuda: Optional[str] = {cuda}\n"  # as torch writes it
    (where / "torch" / "version.py").write_text(version)
    return where


@pytest.mark.parametrize("cuda, ok", [("'12.8'", False), ("'13.0'", True), ("None", True)])
def test_a_cuda_backend_under_a_torch_for_another_cuda_major(tmp_path, cuda, ok):
    site = tmp_path / "site"
    _backend(site, "nixl_cu13")
    nixlpackage.write(site, "nixl_cu13", "cuda", "cuda-1")
    r = _py("import nixl; print(nixl._api.__name__)", site, _torch(tmp_path / "t", cuda))
    if ok:
        assert r.returncode == 0 and r.stdout.strip() == "nixl_cu13._api", r.stderr
    else:
        line = _error_line(r)
        assert "backend nixl_cu13 is for CUDA 13, but torch here" in line
        assert str(tmp_path / "t" / "torch" / "version.py") in line and "built for CUDA 12" in line


def test_a_backend_that_does_not_load_here_says_which_and_what_to_do(tmp_path):
    site = tmp_path / "site"
    _backend(site, "nixl_xpu", init="raise ImportError('libze_loader.so.1: cannot open')\n")
    nixlpackage.write(site, "nixl_xpu", "xpu", "xpu-1")
    line = _error_line(_py("import nixl", site))
    assert "xpu build xpu-1" in line and "backend nixl_xpu does not import here" in line
    assert "libze_loader.so.1" in line and "made for this host's platform" in line


def test_a_package_whose_directory_is_not_on_the_path_says_so(tmp_path):
    site = _site(tmp_path)
    code = (f"import importlib.util as u, sys\n"
            f"s = u.spec_from_file_location('nixl', {str(site / 'nixl' / '__init__.py')!r})\n"
            f"m = u.module_from_spec(s); sys.modules['nixl'] = m; s.loader.exec_module(m)")
    line = _error_line(_py(code))
    assert f"nixl_cpu is beside it in {site}, which is not on sys.path" in line


def test_a_submodule_that_does_not_load_here_is_one_line_too(tmp_path):
    site = _site(tmp_path)
    broken = "raise ImportError('libnixl.so: no such file')\n"
    (site / "nixl_cpu" / "_bindings.py").write_text(broken)
    line = _error_line(_py("import nixl", site))
    assert "nixl_cpu._api does not import here (libnixl.so: no such file)" in line


@pytest.mark.parametrize("name", ["nixl", "nixl_cpu; import os", "nixl_cu", "os", "nixl_cpu\n"])
def test_only_nixls_module_names_are_written(tmp_path, name):
    with pytest.raises(PrefixError):
        nixlpackage.write(tmp_path, name, "cpu", "x")
    assert not (tmp_path / "nixl").exists()


def test_a_foreign_nixl_package_is_never_overwritten(tmp_path):
    (tmp_path / "nixl").mkdir()
    (tmp_path / "nixl" / "__init__.py").write_text("# NIXL's meta package\n")
    with pytest.raises(PrefixError, match="is not kvstack's nixl package"):
        nixlpackage.write(tmp_path, "nixl_cpu", "cpu", "x")
    assert (tmp_path / "nixl" / "__init__.py").read_text() == "# NIXL's meta package\n"
    (tmp_path / "b").mkdir()
    nixlpackage.write(tmp_path / "b", "nixl_cpu", "cpu", "old")
    nixlpackage.write(tmp_path / "b", "nixl_xpu", "xpu", "new")  # ours: replaced
    assert "'backend': 'nixl_xpu'" in (tmp_path / "b" / "nixl" / "__init__.py").read_text()


def test_the_builds_module_is_never_taken_to_be_the_nixl_package(tmp_path):
    site = tmp_path / "nixl" / "lib" / "python3.11" / "site-packages"
    _backend(site, "nixl_cpu")
    (site / "nixl_cpu" / "_bindings.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    nixlpackage.write(site, "nixl_cpu", "cpu", "x")
    assert envfile.nixl_site_packages(tmp_path) == site
    assert envfile.nixl_module(tmp_path, "nixl*") == "nixl_cpu"


def _plan(tmp_path: Path, python: str = sys.executable):
    from types import SimpleNamespace
    install_dir = tmp_path / "P.builds" / "cpu-1"
    site = install_dir / "nixl" / "lib" / "python3.11" / "site-packages"
    _backend(site, "nixl_cpu")
    (site / "nixl_cpu" / "_bindings.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    return SimpleNamespace(install_dir=install_dir, verify={"nixl": {"module": "nixl_cpu"}},
                           platform="cpu", build_id="cpu-1", prefix=tmp_path / "P",
                           target=SimpleNamespace(python=python)), site


def test_the_install_writes_the_package_beside_the_builds_module(tmp_path):
    from installer import install
    plan, site = _plan(tmp_path)
    assert install._write_nixl_package(plan) == str(site / "nixl" / "__init__.py")
    assert "'backend': 'nixl_cpu'" in (site / "nixl" / "__init__.py").read_text()
    plan.verify = {}  # a UCX-only build: nothing written
    (site / "nixl" / "__init__.py").unlink()
    assert install._write_nixl_package(plan) is None
    assert not (site / "nixl" / "__init__.py").exists()


def test_a_finished_build_without_the_package_gains_it_once(tmp_path):
    from installer import install
    plan, site = _plan(tmp_path)
    assert install._ensure_nixl_package(plan) == str(site / "nixl" / "__init__.py")
    assert install._ensure_nixl_package(plan) is None  # there now: left alone


def test_the_install_says_when_the_target_python_finds_another_nixl_first(tmp_path, caplog):
    from installer import install
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = subprocess.run([py, "-c", where], capture_output=True, text=True,
                             check=True).stdout.strip()
    plan, _ = _plan(tmp_path, py)
    install._warn_other_nixl(plan)
    assert not caplog.records  # no nixl there at all
    (Path(purelib) / "nixl").mkdir()
    (Path(purelib) / "nixl" / "__init__.py").write_text("# PyPI's meta package\n")
    install._warn_other_nixl(plan)
    [record] = caplog.records
    said = record.getMessage()
    assert f"imports another nixl first ({purelib}/nixl/__init__.py)" in said
    assert f"{py} -m pip uninstall nixl nixl-cu12 nixl-cu13" in said and "/P/env.sh" in said
