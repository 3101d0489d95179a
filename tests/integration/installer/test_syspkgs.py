"""System packages, asked of the real dpkg database."""
from __future__ import annotations

import pytest

from installer import syspkgs
from installer.errors import SystemPackagesError

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(syspkgs.distro_family() != "debian", reason="needs a Debian/Ubuntu host")]


def test_installed_packages_are_not_missing(tmp_path):
    rec = syspkgs.ensure({"debian": {"dpkg": "always there"}}, mode="install", log_path=tmp_path / "l")
    assert rec["missing"] == [] and rec["installed"] == []


def test_missing_package_as_non_root_prints_the_exact_command(tmp_path):
    table = {"debian": {"dpkg": "x", "kvstack-no-such-package": "y"}}
    with pytest.raises(SystemPackagesError) as e:
        syspkgs.ensure(table, mode="install", log_path=tmp_path / "l", is_root=False)
    line = e.value.line()
    assert "missing system packages: kvstack-no-such-package (not running as root; looked for" in line
    assert "sudo apt-get update && apt-get install -y --no-install-recommends kvstack-no-such-package" in line
    assert e.value.exit_code == 7


def test_ignore_only_warns(tmp_path):
    rec = syspkgs.ensure({"debian": {"kvstack-no-such-package": "y"}}, mode="ignore", log_path=tmp_path / "l",
                         is_root=True)
    assert rec["missing"] == ["kvstack-no-such-package"] and rec["ignored"] is True


def test_check_never_runs_apt(tmp_path):
    with pytest.raises(SystemPackagesError, match="--system-packages check was given"):
        syspkgs.ensure({"debian": {"kvstack-no-such-package": "y"}}, mode="check", log_path=tmp_path / "l",
                       is_root=True)
    assert not (tmp_path / "l").exists()


def test_os_release_families(tmp_path):
    (tmp_path / "u").write_text('ID=ubuntu\nID_LIKE=debian\n')
    (tmp_path / "f").write_text('ID="fedora"\n')
    assert syspkgs.distro_family(tmp_path / "u") == "debian"
    assert syspkgs.distro_family(tmp_path / "f") is None


def test_a_usable_tool_on_path_counts_without_its_package(tmp_path, monkeypatch):
    """A cmake from pip (the GPU image has one) is a cmake: check must not call it missing.
    The tool is a real executable on PATH that answers --version; its Debian package name is
    one dpkg has never heard of."""
    tool = tmp_path / "bin" / "kvstack-fake-cmake"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho 'cmake version 3.31.0'\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}:{__import__('os').environ['PATH']}")
    monkeypatch.setitem(syspkgs.TOOLS, "kvstack-cmake-from-pip", ("kvstack-fake-cmake",))
    rec = syspkgs.ensure({"debian": {"kvstack-cmake-from-pip": "x"}}, mode="check",
                         log_path=tmp_path / "l", is_root=False)
    assert rec["missing"] == []


def test_the_message_says_what_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.setitem(syspkgs.TOOLS, "kvstack-no-such-tool-pkg", ("kvstack-no-such-tool",))
    with pytest.raises(SystemPackagesError) as e:
        syspkgs.ensure({"debian": {"kvstack-no-such-tool-pkg": "x"}}, mode="check",
                       log_path=tmp_path / "l", is_root=True)
    assert "looked for kvstack-no-such-tool-pkg (dpkg, or kvstack-no-such-tool on PATH)" in \
        e.value.line()
