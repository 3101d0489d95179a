"""System packages, asked of the real dpkg database."""
from __future__ import annotations

from pathlib import Path

import pytest

from installer import syspkgs
from installer.errors import SystemPackagesError

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(syspkgs.distro_family() != "debian", reason="needs a Debian/Ubuntu host"),
]


def test_installed_packages_are_not_missing(tmp_path):
    rec = syspkgs.ensure(
        {"debian": {"dpkg": "always there"}}, mode="install", log_path=tmp_path / "l"
    )
    assert rec["missing"] == [] and rec["installed"] == []


def test_missing_package_as_non_root_prints_the_exact_command(tmp_path):
    table = {"debian": {"dpkg": "x", "kvstack-no-such-package": "y"}}
    with pytest.raises(SystemPackagesError) as e:
        syspkgs.ensure(table, mode="install", log_path=tmp_path / "l", is_root=False)
    line = e.value.line()
    assert "missing system packages: kvstack-no-such-package (not running as root)" in line
    assert (
        "sudo apt-get update && apt-get install -y --no-install-recommends kvstack-no-such-package"
        in line
    )
    assert e.value.exit_code == 7


def test_ignore_only_warns(tmp_path):
    rec = syspkgs.ensure(
        {"debian": {"kvstack-no-such-package": "y"}},
        mode="ignore",
        log_path=tmp_path / "l",
        is_root=True,
    )
    assert rec["missing"] == ["kvstack-no-such-package"] and rec["ignored"] is True


def test_check_never_runs_apt(tmp_path):
    with pytest.raises(SystemPackagesError, match="--system-packages check was given"):
        syspkgs.ensure(
            {"debian": {"kvstack-no-such-package": "y"}},
            mode="check",
            log_path=tmp_path / "l",
            is_root=True,
        )
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
    rec = syspkgs.ensure(
        {"debian": {"kvstack-no-such-package": "y"}},
        mode="check",
        log_path=tmp_path / "l",
        path=path,
        provides=provides,
    )
    assert rec["missing"] == [] and rec["provided_by_path"] == {
        "kvstack-no-such-package": f"{path}/kvstack-tool"
    }


def test_missing_tool_message_lists_what_was_looked_for(tmp_path):
    provides = {"kvstack-no-such-package": ("kvstack-tool", "kvstack-tool2")}
    with pytest.raises(SystemPackagesError) as e:
        syspkgs.ensure(
            {"debian": {"kvstack-no-such-package": "y"}},
            mode="check",
            log_path=tmp_path / "l",
            path=str(tmp_path),
            provides=provides,
        )
    assert (
        "looked for: kvstack-no-such-package (dpkg or kvstack-tool/kvstack-tool2 on PATH)"
        in e.value.line()
    )


def _tools(tmp_path, *names):
    d = None
    for n in names:
        d = _tool_dir(tmp_path, n)
    return d or str(tmp_path)


def test_libtoolize_without_its_macros_for_aclocal_is_missing_libtool(tmp_path):
    """A libtoolize on PATH (a copy of /bin/true, as a conda one would be) while aclocal finds no
    libtool.m4: named before building, not automake's "LIBTOOL is undefined" after. One fake: this
    host's aclocal has libtool.m4, so a script that prints an empty directory stands for it."""
    path = _tools(tmp_path, "libtoolize")
    empty = tmp_path / "aclocal-dir"
    empty.mkdir()
    (Path(path) / "aclocal").write_text(f"#!/bin/sh\necho {empty}\n")
    (Path(path) / "aclocal").chmod(0o755)
    provides = {"kvstack-no-libtool": syspkgs.PROVIDES["libtool"]}
    syspkgs.MACROS["kvstack-no-libtool"] = "libtool.m4"
    try:
        table = {"debian": {"kvstack-no-libtool": "y"}}
        with pytest.raises(SystemPackagesError) as e:
            syspkgs.ensure(
                table, mode="check", log_path=tmp_path / "l", path=path, provides=provides
            )
        assert ("looked for: kvstack-no-libtool (dpkg or libtoolize on PATH with libtool.m4 for "
                "aclocal)") in e.value.line()
        (empty / "libtool.m4").write_text("dnl\n")  # the macros where aclocal looks: present
        rec = syspkgs.ensure(table, mode="check", log_path=tmp_path / "l", path=path,
                             provides=provides)
        assert rec["provided_by_path"] == {"kvstack-no-libtool": f"{path}/libtoolize"}
    finally:
        del syspkgs.MACROS["kvstack-no-libtool"]


def test_a_distribution_without_a_list_has_its_tools_looked_for_on_path(tmp_path, caplog):
    """No package list for this distribution (no dpkg, no apt): the recipe's tools are looked for
    on PATH; check names the missing ones before building, ignore only warns."""
    table = {"debian": {"make": "x", "cmake": "y", "libnuma-dev": "z"}}
    path = _tools(tmp_path, "make")
    with pytest.raises(SystemPackagesError) as e:
        syspkgs.ensure(table, mode="check", log_path=tmp_path / "l", family="other", path=path)
    assert e.value.line().startswith(
        "system packages: missing build tools: cmake; looked for: cmake (cmake on PATH)")
    assert e.value.exit_code == 7
    rec = syspkgs.ensure(table, mode="ignore", log_path=tmp_path / "l", family="other", path=path)
    assert rec["missing"] == ["cmake"] and rec["ignored"] is True
    assert "libraries and headers unchecked: libnuma-dev" in caplog.text
