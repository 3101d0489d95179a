"""README's test command from a clone with no ../shared beside it: ci/pinned-builds.sh takes the
three builds' sources from the recipes' upstream URLs, each checked against its pin, by the
installer's own fetch over real HTTP. GitHub is unreachable here, so a local server on 127.0.0.1
stands for the upstream hosts (KVSTACK_UPSTREAM_BASE: https://HOST/PATH is fetched from
http://127.0.0.1:PORT/HOST/PATH) and serves the mirror's archives, byte-identical to the pins, at
their recipe URLs. One fake: asio's release tarball is not on this host, so the server serves the
mirror's asio headers at asio's URL and the mirror's overlay pins them (its README says why)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from installer import plan as planmod
from installer import recipe
from installer.cache import Cache
from installer.sources import upstream

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]
MIRROR = Path(os.environ.get("KVSTACK_MIRROR") or ROOT.parent / "shared" / "mirror")
BUILDS = [("cpu", None), ("xpu", None), ("xpu", "ze-ipc")]


@pytest.fixture
def clone(tmp_path):
    """The checkout's files as git tracks them, in a directory with nothing beside it."""
    if not (MIRROR / "SHA256SUMS").is_file() or not (MIRROR / "asio-overlay.toml").is_file():
        pytest.skip(f"no kvstack source mirror at {MIRROR} to serve the pinned archives from")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout
    dest = tmp_path / "alone" / "kvstack"
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    assert not (dest.parent.parent / "shared").exists() and not (dest.parent / "shared").exists()
    return dest


def _plans(overlay: Path):
    for platform, variant in BUILDS:
        rec = recipe.load(platform, [overlay], variant=variant)
        yield planmod.make_plan(
            rec,
            prefix=Path("/nonexistent/kv"),
            cache_dir=Path("/nonexistent/c"),
            jobs=1,
            component_jobs=None,
            target=planmod.Target.probe(sys.executable),
            platform_reason="test",
        )


def _serve_pins(server, overlay: Path) -> dict[str, dict]:
    """Each source of the three builds at its recipe URL's path; {path: source}."""
    served = {}
    for plan in _plans(overlay):
        for name in plan.used_sources():
            src = plan.sources[name]
            path = upstream(src["url"], base="/")
            server.files[path] = (MIRROR / src["filename"]).read_bytes()
            served[path] = src
    return served


def _pinned_sources(clone: Path, server, overlay: Path):
    env = {k: v for k, v in os.environ.items() if k != "KVSTACK_MIRROR"}
    env.update(KVSTACK_UPSTREAM_BASE=server.url(""), PY=sys.executable)
    cmd = ["bash", "ci/pinned-builds.sh", "--fetch-only", "--recipe-overlay", str(overlay)]
    return subprocess.run(cmd, cwd=clone, env=env, capture_output=True, text=True, timeout=600)


def test_a_clone_without_a_mirror_fetches_every_pin_from_upstream(clone, server):
    overlay = MIRROR / "asio-overlay.toml"
    served = _serve_pins(server, overlay)
    ze_ipc = "/github.com/openucx/ucx/archive/b8d6012325b5fe026a94be537009f486ed2b9d40.tar.gz"
    assert ze_ipc in served
    nixl = "/github.com/ai-dynamo/nixl/archive/refs/tags/v1.4.0.tar.gz"
    good = server.files[nixl]
    server.files[nixl] = good[:-1] + bytes([good[-1] ^ 1])  # upstream serves another file: refused
    r = _pinned_sources(clone, server, overlay)
    assert r.returncode == 6, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"checksum mismatch: nixl: nixl-1.4.0.tar.gz from {server.url(nixl)} does not match "
        "its pin")
    server.files[nixl] = good
    r = _pinned_sources(clone, server, overlay)
    assert r.returncode == 0, r.stdout + r.stderr
    said = "sources from the recipes' upstream URLs (no KVSTACK_MIRROR, no ../shared/mirror)"
    assert r.stdout.count(said) == 3
    cache = Cache(clone / "_work" / "pinned" / "cache")
    assert [p for p, src in served.items() if not cache.get(src["sha256"])] == []
    assert set(server.hits) == set(served) and server.hits[nixl] == 2  # once each, nixl twice
    assert not (clone / "_work" / "pinned" / "venv").exists()  # --fetch-only built nothing
