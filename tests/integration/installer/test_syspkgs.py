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
    assert "missing system packages: kvstack-no-such-package (not running as root)" in line
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


def _tool_dir(tmp_path, name):
    """A real executable named `name` in its own directory (a copy of /bin/true), standing for a
    tool installed outside dpkg, as pip's cmake is on the GPU image."""
    import shutil
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    shutil.copy("/bin/true", d / name)
    return str(d)


def test_a_tool_on_path_counts_though_dpkg_lacks_its_package(tmp_path):
    provides = {"kvstack-no-such-package": ("kvstack-tool",)}
    path = _tool_dir(tmp_path, "kvstack-tool")
    rec = syspkgs.ensure({"debian": {"kvstack-no-such-package": "y"}}, mode="check", log_path=tmp_path / "l",
                         path=path, provides=provides)
    assert rec["missing"] == [] and rec["provided_by_path"] == {"kvstack-no-such-package": f"{path}/kvstack-tool"}


def test_missing_tool_message_lists_what_was_looked_for(tmp_path):
    provides = {"kvstack-no-such-package": ("kvstack-tool", "kvstack-tool2")}
    with pytest.raises(SystemPackagesError) as e:
        syspkgs.ensure({"debian": {"kvstack-no-such-package": "y"}}, mode="check", log_path=tmp_path / "l",
                       path=str(tmp_path), provides=provides)
    assert "looked for: kvstack-no-such-package (dpkg or kvstack-tool/kvstack-tool2 on PATH)" in e.value.line()
