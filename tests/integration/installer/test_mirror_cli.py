"""`python -m installer mirror` fills a mirror from a real HTTP server on 127.0.0.1; with the
server gone, installs fetch from the mirror; tampering and being offline fail with their own
exit codes and one clear line. Upstream (GitHub) is unreachable here, so the recipe's sources
are replaced by an overlay with small local archives."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from installer import recipe
from installer.cache import Cache
from installer.sources import Fetcher
from tests.integration.installer.localserver import make_tarball, sha256

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def overlay(server, tmp_path):
    lines = []
    for name, src in recipe.load("cpu").sources.items():
        body = make_tarball(f"{name}-x", {"README": f"{name}\n".encode()})
        path = f"/{src['filename']}"
        server.files[path] = body
        lines += [f"[sources.{name}]", f'url = "{server.url(path)}"', "fallback_urls = []",
                  f'sha256 = "{sha256(body)}"', f'commit = "{"0" * 40}"', ""]
    o = tmp_path / "local-sources.toml"
    o.write_text("\n".join(lines))
    return o


def _cli(*args, env_extra=None):
    env = dict(os.environ, KVSTACK_CACHE_DIR="/nonexistent-use-flag", **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "installer", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_mirror_filled_then_used_offline(server, overlay, tmp_path):
    m = tmp_path / "mirror"
    r = _cli("mirror", str(m), "--platform", "cpu", "--recipe-overlay", str(overlay), "--no-wheels",
             "--cache-dir", str(tmp_path / "c1"))
    assert r.returncode == 0, r.stderr
    rec = recipe.load("cpu", [overlay])
    names = {s["filename"] for s in rec.sources.values()}
    assert names <= {p.name for p in m.iterdir()}
    sums = dict(reversed(line.split()) for line in (m / "SHA256SUMS").read_text().splitlines())
    assert {f: sums[f] for f in names} == {s["filename"]: s["sha256"] for s in rec.sources.values()}
    server.stop()
    fetcher = Fetcher(Cache(tmp_path / "c2"), str(m))
    for name, src in rec.sources.items():
        f = fetcher.fetch(name, src)
        assert not f.cached and f.origin == str(m / src["filename"])
        fetcher.check(f, src)


def test_tampered_mirror_file_fails_the_install_with_both_hashes(server, overlay, tmp_path):
    m = tmp_path / "mirror"
    assert (
        _cli(
            "mirror",
            str(m),
            "--platform",
            "cpu",
            "--recipe-overlay",
            str(overlay),
            "--no-wheels",
            "--cache-dir",
            str(tmp_path / "c1"),
        ).returncode
        == 0
    )
    ucx = recipe.load("cpu", [overlay]).sources["ucx"]
    (m / ucx["filename"]).write_bytes(b"not the file")
    r = _cli("--platform", "cpu", "--recipe-overlay", str(overlay), "--mirror", str(m),
             "--cache-dir", str(tmp_path / "c2"), "--prefix", str(tmp_path / "p"))
    assert r.returncode == 6, r.stderr
    assert (
        f"expected sha256 {ucx['sha256']}" in r.stderr
        and f"got sha256 {sha256(b'not the file')}" in r.stderr
    )
    assert not (tmp_path / "p").exists()


def test_offline_without_mirror_says_what_to_do(server, overlay, tmp_path):
    server.stop()
    r = _cli(
        "--platform",
        "cpu",
        "--recipe-overlay",
        str(overlay),
        "--cache-dir",
        str(tmp_path / "c"),
        "--prefix",
        str(tmp_path / "p"),
    )
    assert r.returncode == 5, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("offline: ") and "--mirror DIR" in last


def test_dry_run_json_parses_and_fetches_nothing(server, overlay, tmp_path):
    r = _cli("--platform", "xpu", "--dry-run", "--json", "--cache-dir", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["platform"] == "xpu" and "level-zero" in plan["sources"]
    assert not (tmp_path / "c").exists() and sum(server.hits.values()) == 0


@pytest.mark.parametrize(
    "args,code,needle",
    [
        (["--platform", "arm"], 2, "invalid choice: 'arm'"),
        (["--jobs", "-3", "--dry-run"], 2, "--jobs must be at least 1"),
        (
            ["--platform", "cpu", "--recipe-overlay", "/nonexistent.toml", "--dry-run"],
            3,
            "does not exist",
        ),
        (["--python", "/nonexistent/python", "--dry-run"], 2, "does not run"),
    ],
)
def test_bad_arguments_get_one_line_and_their_exit_code(args, code, needle, tmp_path):
    r = _cli(*args, "--cache-dir", str(tmp_path / "c"))
    assert r.returncode == code, r.stderr
    assert (
        needle in r.stderr
        and len(r.stderr.strip().splitlines()) == 1
        and "Traceback" not in r.stderr
    )
