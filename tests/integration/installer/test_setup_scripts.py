"""README's set-up command on a stock Debian/Ubuntu Python: the distribution's python3 refuses
pip installs (PEP 668), so ci/setup.sh makes a virtual environment and runs the installer
from it. Uses this Debian host's own /usr/bin/python3 (skipped where there is none)."""

import os
import pathlib
import subprocess

import pytest

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[3]
STOCK = pathlib.Path("/usr/bin/python3")


def _externally_managed() -> bool:
    out = subprocess.run(
        [str(STOCK), "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
        capture_output=True,
        text=True,
    )
    return (
        out.returncode == 0 and (pathlib.Path(out.stdout.strip()) / "EXTERNALLY-MANAGED").exists()
    )


@pytest.mark.skipif(not STOCK.exists(), reason="no distribution python3 at /usr/bin/python3")
def test_install_command_works_with_the_distributions_python(tmp_path):
    if _externally_managed():  # the premise: pip into the stock python is refused
        refused = subprocess.run([str(STOCK), "-m", "pip", "install", "--dry-run", "six"],
                                 capture_output=True, text=True)
        assert refused.returncode != 0 and "externally-managed" in refused.stderr
    env = {**os.environ, "PYTHON": str(STOCK), "KVSTACK_VENV": str(tmp_path / "venv")}
    run = subprocess.run(["bash", "ci/setup.sh", "--platform", "cpu", "--dry-run"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--without-cuda" in run.stdout and "verification must prove" in run.stdout
    assert (tmp_path / "venv" / "bin" / "python").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the script as another user")
def test_no_venv_module_and_no_sudo_says_the_exact_command():
    """A python whose venv module is missing (a stand-in script: the real one is installed on
    this host), run by an unprivileged user without sudo: one line with the command to run."""
    import shutil
    import tempfile

    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="kvstack-novenv-"))  # readable by nobody
    request_cleanup = lambda: shutil.rmtree(tmp_path, ignore_errors=True)  # noqa: E731
    fake = tmp_path / "python3"
    fake.write_text('#!/bin/sh\n[ "$1 $2" = "-m venv" ] && exit 1\nexec /usr/bin/python3 "$@"\n'
                    if STOCK.exists() else "")
    fake.chmod(0o755)
    tmp_path.chmod(0o777)
    script = ROOT / "ci" / "venv.sh"
    run = subprocess.run(["bash", "-c", f". {script}; kvstack_venv"], cwd=tmp_path, user=65534,
                         group=65534, capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake),
                              "KVSTACK_VENV": str(tmp_path / "v")})
    try:
        assert run.returncode == 1, run.stderr
        assert "sudo apt-get install python3-venv" in run.stderr
        assert not (tmp_path / "v").exists()
    finally:
        request_cleanup()
