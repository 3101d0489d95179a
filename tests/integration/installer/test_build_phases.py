"""The build phases on small real projects — one each for autotools (autoreconf, configure with
--enable flags, libtool), meson (pkg-config dependency on a header-only component) and cmake,
and a cmake one built only as far as the pkg-config modules asked for (hello-parts) —
through the whole installer: extract, configure, build, install, verify, prefix switch. Then what
must not hurt an install: a re-run, a failing step, Ctrl-C/SIGTERM/SIGKILL mid-phase, a second
installer. The projects live in projects/; their archives are made here and served from a local
mirror together with the build tools' wheels (pip download from PyPI, once per session)."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import filelock
import pytest

from installer import buildcompare
from installer import prefix as prefixmod
from installer.runner import stop_leftovers

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]


def _cmd(world, prefix, *extra):
    return [
        sys.executable,
        "-m",
        "installer",
        "--platform",
        "cpu",
        "--recipes",
        str(world["recipes"]),
        "--mirror",
        str(world["mirror"]),
        "--cache-dir",
        str(world["cache"]),
        "--prefix",
        str(prefix),
        "--system-packages",
        "check",
        *extra,
    ]


def _install(world, prefix, *extra, timeout=600):
    return subprocess.run(
        _cmd(world, prefix, *extra), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _overlay(tmp_path, text):
    p = tmp_path / "overlay.toml"
    p.write_text(text)
    return str(p)


@pytest.fixture(scope="module")
def installed(world, tmp_path_factory):
    prefix = tmp_path_factory.mktemp("inst") / "kv"
    r = _install(world, prefix)
    assert r.returncode == 0, r.stderr
    return prefix


def test_projects_build_install_and_verify(installed):
    build = installed.resolve()
    assert installed.is_symlink() and build.parent.name == "kv.builds"
    manifest = json.loads((installed / "manifest.json").read_text())
    assert manifest["complete"] is True
    for phase in (
        "fetch",
        "check",
        "system-packages",
        "build-tools",
        "extract",
        "configure",
        "build",
        "install",
        "verify",
    ):
        assert manifest["phases"][phase]["status"] == "done", phase
    steps = manifest["phases"]["configure"]["components"]["hello-autotools"]["steps"]
    configure = next(s for s in steps if s["step"] == "configure")
    assert (
        "--enable-shout" in configure["argv"]
        and Path(configure["log"]).name == "hello-autotools.configure.log"
    )
    assert (build / "logs" / "hello-autotools.configure.log").exists()
    levels = manifest["verification"]["levels"]
    assert levels["built"]["status"] == "passed"
    assert levels["loaded"] == {
        "status": "skipped",
        "reason": "this recipe builds no UCX",
        "checks": [],
    }
    assert levels["moved"]["status"] == "skipped"
    # the flags reached the builds: autotools --enable-shout, meson found the headers through
    # pkg-config
    assert ctypes.CDLL(str(build / "hello-autotools/lib/libhowdy.so")).howdy() == 2
    assert ctypes.CDLL(str(build / "hello-cmake/lib/libhello.so")).hello_cmake() == 42
    out = subprocess.run([str(installed / "hello-meson/bin/greet")], capture_output=True, text=True)
    assert out.stdout.strip() == "greet 7"
    assert (installed / "env.sh").read_text().startswith("# kvstack cpu build")


def test_only_the_pkgconfig_modules_asked_for_and_what_they_require_are_built(installed):
    """hello-parts asks for hello_greet, which requires hello_base; hello_unused is never compiled.
    Headers come from the top directory's install rules; the CMake package, which names every
    library, is not left behind."""
    build = installed.resolve()
    parts = build / "hello-parts"
    assert sorted(p.relative_to(parts).as_posix() for p in parts.rglob("*") if p.is_file()) == [
        "include/hello/greet.h", "lib/libhello_base.a", "lib/libhello_greet.a",
        "lib/pkgconfig/hello_base.pc", "lib/pkgconfig/hello_greet.pc"]
    # the build's compile lines (its source and build trees are gone with the finished build)
    assert "hello_greet" in (build / "logs" / "hello-parts.cmake-build.log").read_text()
    assert "unused" not in (build / "logs" / "hello-parts.cmake-build.log").read_text()
    closure = (build / "logs" / "hello-parts.pkgconfig-closure.log").read_text()
    assert (
        "1 modules asked for, 2 with what they require, 2 libraries to build: hello_base "
        "hello_greet"
        in closure
    )
    env = {**os.environ, "PKG_CONFIG_PATH": str(parts / "lib" / "pkgconfig")}
    libs = subprocess.run(
        ["pkg-config", "--static", "--libs", "hello_greet"], env=env, capture_output=True, text=True
    )
    assert libs.stdout.split()[-3:] == ["-lhello_greet", "-lhello_base", "-lm"], libs.stderr


def test_a_pkgconfig_module_the_project_lacks_is_one_line(world, installed, tmp_path):
    before = installed.resolve()
    r = _install(
        world,
        installed,
        "--recipe-overlay",
        _overlay(tmp_path, '[components.hello-parts]\npkgconfig_modules = ["hello_greeting"]\n'),
    )
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "pkg-config module 'hello_greeting' is not among the 3 .pc files" in last, r.stderr[
        -2000:
    ]
    assert "pkgconfig_modules" in last
    assert installed.resolve() == before


def test_rerun_with_nothing_changed_does_no_work(world, installed):
    logs_before = {p: p.stat().st_mtime_ns for p in installed.resolve().joinpath("logs").iterdir()}
    r = _install(world, installed)
    assert r.returncode == 0, r.stderr
    assert "is up to date" in r.stdout
    assert {
        p: p.stat().st_mtime_ns for p in installed.resolve().joinpath("logs").iterdir()
    } == logs_before


def test_failing_step_shows_its_log_and_keeps_the_previous_install(world, installed, tmp_path):
    before = installed.resolve()
    r = _install(world, installed, "--recipe-overlay",
                 _overlay(tmp_path, "[components.hello-cmake.defines]\nHELLO_FAIL = true\n"))
    assert r.returncode == 8, r.stderr
    assert "hello-cmake: failing on purpose" in r.stderr          # the tail of the step's log
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("build failed: hello-cmake: step cmake-configure failed")
    assert "log: " in last and last.split("log: ")[1].split(";")[0].endswith(
        "hello-cmake.cmake-configure.log"
    )
    assert installed.resolve() == before and prefixmod.is_complete(before)


def test_a_build_that_fails_after_ignored_packages_names_them(world, installed, tmp_path):
    """--system-packages ignore goes on without a package (as a host without libtool would); the
    build's failure then names what was missing and ignored, not only the step's tail."""
    overlay = _overlay(tmp_path, '[system_packages.debian]\nkvstack-no-such-package = "a test"\n\n'
                                 '[components.hello-cmake.defines]\nHELLO_FAIL = true\n')
    cmd = _cmd(world, installed, "--recipe-overlay", overlay)
    cmd[cmd.index("--system-packages") + 1] = "ignore"
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 8, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("build failed: hello-cmake: step cmake-configure failed"), last
    assert last.endswith("; missing and ignored (--system-packages ignore): "
                         "kvstack-no-such-package"), last


def _wait_for(path_glob: str, root: Path, proc: subprocess.Popen, timeout: float = 300) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hits = list(root.glob(path_glob))
        if hits:
            return hits[0]
        if proc.poll() is not None:
            raise AssertionError(
                f"the installer ended ({proc.returncode}) before {path_glob} appeared: "
                f"{proc.stderr.read()[-2000:]}"
            )
        time.sleep(0.1)
    raise AssertionError(f"{path_glob} never appeared under {root}")


def _sleeping(pgid: int) -> bool:
    for pid in _group(pgid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "sleep":
                return True
        except OSError:  # cmake's short-lived compiler checks come and go
            pass
    return False


def _group(pgid: int) -> list[int]:
    """The live processes of one process group (a build step runs in its own)."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":  # zombies are gone, only unreaped
                    out.append(int(proc.name))
            except (OSError, ValueError, IndexError):
                pass
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_interrupted_install_leaves_the_previous_one_working(world, installed, tmp_path, sig):
    before = installed.resolve()
    # a build of its own per signal (the variable only makes the build id differ)
    slow = _overlay(tmp_path, f'[components.hello-cmake.defines]\nHELLO_SLOW = true\n\n'
                              f'[runtime.env]\nKVSTACK_TEST_SIGNAL = "{int(sig)}"\n')
    plan = json.loads(
        subprocess.run(
            _cmd(world, installed, "--recipe-overlay", slow, "--dry-run", "--json"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    logs = Path(plan["work_dir"]) / "logs"
    proc = subprocess.Popen(
        _cmd(world, installed, "--recipe-overlay", slow),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        log = _wait_for("hello-cmake.cmake-configure.log", logs, proc)
        marker = _wait_for("running-step.hello-cmake.pid", logs, proc)
        pgid = int(marker.read_text())
        deadline = time.monotonic() + 180
        while (
            not _sleeping(pgid) and time.monotonic() < deadline
        ):  # cmake is inside its `sleep 600`
            time.sleep(0.1)
        assert _sleeping(pgid)
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.3)
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        # the step's supervising shell heard of the installer's death (PR_SET_PDEATHSIG) and took
        # its whole process group down, cmake and the `sleep` it started with it, on its own:
        deadline = time.monotonic() + 30
        while _group(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _group(pgid) == [], [Path(f"/proc/{p}/cmdline").read_bytes() for p in _group(pgid)]
        assert pgid not in stop_leftovers(log.parent)  # the next run finds nothing of it to stop
    else:
        assert proc.returncode == 130, err
        assert err.strip().splitlines()[-1].startswith("interrupted: stopped")
    assert _group(pgid) == []  # nothing of the build step is left running
    assert installed.resolve() == before and prefixmod.is_complete(before)
    out = subprocess.run([str(installed / "hello-meson/bin/greet")], capture_output=True, text=True)
    assert out.stdout.strip() == "greet 7"
    log.unlink()
    again = _install(world, installed)
    assert again.returncode == 0 and "is up to date" in again.stdout


def _sleeps_under(root: Path) -> list[int]:
    """Processes `sleep 600` (hello-cmake's HELLO_SLOW) whose working directory is under root."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and (proc / "cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", b"600"]
                and Path(os.readlink(proc / "cwd")).is_relative_to(root)
            ):
                out.append(int(proc.name))
        except OSError:
            pass
    return out


def test_a_failing_component_stops_the_one_building_beside_it(world, installed, tmp_path):
    before = installed.resolve()
    # hello-cmake sleeps in its configure while hello-autotools, beside it, fails its configure
    overlay = _overlay(
        tmp_path,
        '[components.hello-cmake.defines]\nHELLO_SLOW = true\n\n'
        '[components.hello-autotools]\nconfigure_args = ["--enable-fail"]\n',
    )
    plan = json.loads(
        subprocess.run(
            _cmd(world, installed, "--recipe-overlay", overlay, "--dry-run", "--json"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    r = _install(world, installed, "--recipe-overlay", overlay)
    assert r.returncode == 8, r.stderr
    assert "hello-autotools: failing on purpose" in r.stderr  # the failing step's log tail
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("build failed: hello-autotools: step configure failed")
    assert last.split("log: ")[1].split(";")[0].endswith("hello-autotools.configure.log")
    work = Path(plan["work_dir"])
    failed = json.loads((work / "manifest.failed.json").read_text())
    assert failed["phases"]["configure"]["components"]["hello-cmake"]["status"] == "stopped"
    assert failed["components"]["at_once"] == 5   # every component of the world
    assert not list((work / "logs").glob("running-step.*.pid"))
    assert _sleeps_under(work) == []    # hello-cmake's configure was stopped, its sleep with it
    assert installed.resolve() == before and prefixmod.is_complete(before)


def test_side_by_side_and_one_at_a_time_give_the_same_bytes(world, installed, tmp_path):
    """The same build id into the same prefix, built one component after another and then side by
    side from nothing but the cache directory (sources, autogen.sh's outputs, autoconf results):
    every installed file has the same bytes."""
    prefix = tmp_path / "kv"
    r = _install(world, prefix, "--component-jobs", "1")
    assert r.returncode == 0, r.stderr
    first = json.loads((prefix / "manifest.json").read_text())
    assert first["components"]["at_once"] == 1
    serial = tmp_path / "serial"
    # a finished build keeps no source or build tree: the second build starts from nothing
    assert not Path(first["kvstack_plan"]["work_dir"]).exists()
    assert Path(first["kvstack_plan"]["work_dir"]).parent == prefix.resolve()
    os.rename(prefix.resolve(), serial)         # out of the way
    prefix.unlink()
    r = _install(world, prefix)
    assert r.returncode == 0, r.stderr
    second = json.loads((prefix / "manifest.json").read_text())
    assert second["components"]["at_once"] == 5 and second["build_id"] == first["build_id"]
    # configure answered from the autoconf results the first build kept, and changed no byte
    steps = {
        s["step"]: s
        for s in second["phases"]["configure"]["components"]["hello-autotools"]["steps"]
    }
    assert steps["autoconf-cache"]["result"].startswith("cached results from ")
    # autogen.sh's outputs too, kept by the build that first ran it
    assert steps["autogen-cache"]["result"].startswith("autogen.sh's outputs from ")
    assert steps["autogen"]["skipped"] == "configure exists"
    assert steps["autogen-cache-keep"]["result"] == "nothing to keep"
    assert "(cached)" in Path(steps["configure"]["log"]).read_text()
    same = buildcompare.compare(serial, prefix)
    assert same.identical, buildcompare.render(same, serial, prefix)
    assert {
        "hello-autotools/lib/libhowdy.so.0.0.0",
        "hello-cmake/lib/libhello.so",
        "hello-meson/bin/greet",
        "hello-parts/lib/libhello_greet.a",
    } <= set(same.same)
    # the CLI says the same; and of a build of the same recipe into another prefix, why it differs
    cli = [sys.executable, "-m", "installer", "compare"]
    r = subprocess.run([*cli, str(serial), str(prefix)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("same bytes: "), r.stdout + r.stderr
    r = subprocess.run(
        [*cli, str(serial), str(installed)], cwd=ROOT, capture_output=True, text=True
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "differs: hello-meson/bin/greet: ELF sections " in r.stdout
    assert "holds the install directory of one build but not the other's" in r.stdout


def test_second_installer_is_refused_while_one_holds_the_prefix(world, installed):
    with filelock.FileLock(str(prefixmod.lock_path(installed))):
        r = _install(world, installed)
    assert r.returncode == 10
    assert "another installer is working on" in r.stderr


@pytest.fixture
def tiny_disk(tmp_path):
    """A real file system (tmpfs) with 8 KiB left, to install onto; needs root (CI runs as root)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    st = os.statvfs(mnt)
    (mnt / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 8192))
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_is_one_clear_line(world, tiny_disk):
    """A build step's own write fails (make install: exit 8 from the step) or the installer's:
    either is the host's (exit 11), said as such, and the half-built files are removed."""
    plan = json.loads(subprocess.run(_cmd(world, tiny_disk / "kv", "--dry-run", "--json"), cwd=ROOT,
                                     capture_output=True, text=True, check=True).stdout)
    r = _install(world, tiny_disk / "kv")
    assert r.returncode == 11, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "Traceback" not in r.stderr
    assert last.startswith("host error: no space left on device during "), last
    assert "removed the unfinished build" in last and "still points to nothing" in last
    assert not (tiny_disk / "kv").exists()
    assert not Path(plan["install_dir"]).exists()
    assert not [d for d in (Path(plan["work_dir"]) / "build").glob("*")]


@pytest.fixture
def small_disk(tmp_path):
    """A real file system (tmpfs, 32 MiB) with room for the small projects' sources and builds;
    needs root (CI runs as root)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_disk_that_fills_during_a_step_keeps_the_log_it_names(world, small_disk, tmp_path):
    """hello-cmake's configure writes until the file system is full (as UCX's autogen did): the
    unfinished build is removed, and the step's log the line names is kept beside the builds."""
    prefix = small_disk / "kv"
    fill = _overlay(tmp_path, "[components.hello-cmake.defines]\nHELLO_FILL = true\n")
    plan = json.loads(
        subprocess.run(
            _cmd(world, prefix, "--recipe-overlay", fill, "--dry-run", "--json"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    r = _install(world, prefix, "--recipe-overlay", fill, "--component-jobs", "1")
    assert r.returncode == 11, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("host error: no space left on device during "), last
    kept = Path(plan["install_dir"] + ".failed-logs")
    assert f"its logs kept in {kept}" in last and not Path(plan["install_dir"]).exists()
    step_log = kept / "hello-cmake.cmake-configure.log"
    assert f"log: {step_log}" in last, last
    assert "No space left on device" in step_log.read_text()
