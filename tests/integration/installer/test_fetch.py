"""The fetch and check phases against a real HTTP server on 127.0.0.1 and real git repositories."""
from __future__ import annotations

import subprocess

import pytest

from installer.cache import Cache
from installer.errors import ChecksumError, DownloadError, OfflineError
from installer.sources import Fetcher, tar_commit_id
from tests.integration.installer.localserver import make_tarball, sha256

pytestmark = pytest.mark.integration

BODY = make_tarball("lib-1.0", {"configure": b"#!/bin/sh\n", "src/a.c": b"int a;\n" * 1000})


def _src(server, path="/lib-1.0.tar.gz", body=BODY):
    server.files[path] = body
    return {"url": server.url(path), "filename": "lib-1.0.tar.gz", "sha256": sha256(body)}


def _fetcher(tmp_path, mirror=None):
    return Fetcher(Cache(tmp_path / "cache"), mirror, retries=3, backoff=0.01)


def _leftovers(tmp_path):
    return list((tmp_path / "cache" / "tmp").iterdir())


def test_download_then_cache_hit_with_the_network_gone(server, tmp_path):
    src = _src(server)
    first = _fetcher(tmp_path).fetch("lib", src)
    assert not first.cached and first.path.read_bytes() == BODY
    server.stop()
    second = _fetcher(tmp_path).fetch("lib", src)
    assert second.cached and second.path == first.path
    assert _fetcher(tmp_path).check(second, src)["checked"] == ["sha256"]


def test_corrupted_cache_entry_is_refetched(server, tmp_path):
    src = _src(server)
    f = _fetcher(tmp_path).fetch("lib", src)
    f.path.write_bytes(b"rot")
    again = _fetcher(tmp_path).fetch("lib", src)
    assert not again.cached and again.path.read_bytes() == BODY
    assert server.hits["/lib-1.0.tar.gz"] == 2


def test_tampered_archive_is_refused_with_both_hashes(server, tmp_path):
    src = _src(server)
    server.files["/lib-1.0.tar.gz"] = BODY + b"evil"
    with pytest.raises(ChecksumError) as e:
        _fetcher(tmp_path).fetch("lib", src)
    line = e.value.line()
    assert (
        f"expected sha256 {src['sha256']}" in line
        and f"got sha256 {sha256(BODY + b'evil')}" in line
    )
    assert _leftovers(tmp_path) == [] and not (tmp_path / "cache" / "sha256").exists()


def test_404_is_not_retried(server, tmp_path):
    src = _src(server)
    server.status["/lib-1.0.tar.gz"] = 404
    with pytest.raises(DownloadError, match="HTTP 404"):
        _fetcher(tmp_path).fetch("lib", src)
    assert server.hits["/lib-1.0.tar.gz"] == 1
    assert _leftovers(tmp_path) == []


def test_503_is_retried_then_served(server, tmp_path):
    src = _src(server)
    server.fail_first["/lib-1.0.tar.gz"] = 2
    f = _fetcher(tmp_path).fetch("lib", src)
    assert f.path.read_bytes() == BODY and server.hits["/lib-1.0.tar.gz"] == 3


def test_interrupted_transfer_is_cleaned_up_and_retried(server, tmp_path):
    src = _src(server)
    server.truncate_first["/lib-1.0.tar.gz"] = 1
    f = _fetcher(tmp_path).fetch("lib", src)
    assert f.path.read_bytes() == BODY and server.hits["/lib-1.0.tar.gz"] == 2
    assert _leftovers(tmp_path) == []


def test_always_interrupted_transfer_fails_and_leaves_nothing(server, tmp_path):
    src = _src(server)
    server.truncate_first["/lib-1.0.tar.gz"] = 99
    with pytest.raises(OfflineError, match="3 attempts"):
        _fetcher(tmp_path).fetch("lib", src)
    assert _leftovers(tmp_path) == []


def test_unreachable_without_mirror_is_offline(tmp_path):
    src = {"url": "http://127.0.0.1:9/lib.tar.gz", "filename": "lib.tar.gz", "sha256": "0" * 64}
    with pytest.raises(OfflineError) as e:
        _fetcher(tmp_path).fetch("lib", src)
    assert "python -m installer mirror" in e.value.line() and e.value.exit_code == 5


def test_fallback_url_serves_when_the_first_is_unreachable(server, tmp_path):
    src = _src(server)
    src = dict(src, url="http://127.0.0.1:9/gone.tar.gz", fallback_urls=[src["url"]])
    assert _fetcher(tmp_path).fetch("lib", src).path.read_bytes() == BODY


def test_mirror_directory_is_checked_like_a_download(server, tmp_path):
    src = _src(server)
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / "lib-1.0.tar.gz").write_bytes(BODY[:-1] + b"X")
    server.stop()
    with pytest.raises(ChecksumError) as e:
        _fetcher(tmp_path, str(mirror)).fetch("lib", src)
    assert "expected sha256" in e.value.line() and "got sha256" in e.value.line()
    (mirror / "lib-1.0.tar.gz").write_bytes(BODY)
    assert _fetcher(tmp_path, str(mirror)).fetch("lib", src).origin == str(
        mirror / "lib-1.0.tar.gz"
    )


def test_missing_file_in_mirror(tmp_path):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    src = {"url": "http://127.0.0.1:9/x.tar.gz", "filename": "x.tar.gz", "sha256": "0" * 64}
    with pytest.raises(DownloadError, match="mirror .* cannot serve x.tar.gz"):
        _fetcher(tmp_path, str(mirror)).fetch("x", src)


def test_git_archive_commit_is_checked(git_repo, tmp_path, server):
    out = tmp_path / "lib-v1.tar.gz"
    subprocess.run(
        [
            "git",
            "--git-dir",
            str(git_repo["path"]),
            "-c",
            "tar.tar.gz.command=gzip -cn",
            "archive",
            "--format=tar.gz",
            "--prefix=lib-1/",
            "-o",
            str(out),
            "v1",
        ],
        check=True,
    )
    assert tar_commit_id(out) == git_repo["first"]
    body = out.read_bytes()
    src = dict(_src(server, "/lib-v1.tar.gz", body), commit=git_repo["first"])
    fetcher = _fetcher(tmp_path)
    f = fetcher.fetch("lib", src)
    assert fetcher.check(f, src)["checked"] == ["sha256", "commit"]
    with pytest.raises(ChecksumError, match="another commit") as e:
        fetcher.check(f, dict(src, commit=git_repo["second"]))
    assert git_repo["first"] in e.value.line() and git_repo["second"] in e.value.line()


def test_git_source_at_its_pin(git_repo, tmp_path):
    src = {"kind": "git", "url": git_repo["url"], "tag": "v1", "commit": git_repo["first"]}
    fetcher = _fetcher(tmp_path)
    f = fetcher.fetch("lib", src)
    assert f.commit == git_repo["first"] and fetcher.check(f, src)["checked"] == ["commit"]
    assert fetcher.fetch("lib", src).cached


def test_git_tag_that_moved_is_refused(git_repo, tmp_path):
    git_repo["git"]("tag", "-f", "v1", git_repo["second"])
    git_repo["git"]("push", "-q", "-f", str(git_repo["path"]), "refs/tags/v1")
    src = {"kind": "git", "url": git_repo["url"], "tag": "v1", "commit": git_repo["first"]}
    with pytest.raises(ChecksumError) as e:
        _fetcher(tmp_path).fetch("lib", src)
    line = e.value.line()
    assert (
        f"expected commit {git_repo['first']}" in line
        and f"got commit {git_repo['second']}" in line
    )


def test_git_source_by_commit_alone(git_repo, tmp_path):
    src = {"kind": "git", "url": git_repo["url"], "commit": git_repo["second"]}
    assert _fetcher(tmp_path).fetch("lib", src).commit == git_repo["second"]


def test_fallback_url_serves_when_the_first_answers_404_or_another_file(server, tmp_path, caplog):
    """asio's first location (SourceForge's /download) may answer a 404 or an HTML page instead of
    the archive: the pinned file from the next location is taken, and what happened is logged."""
    src = _src(server)
    server.status["/gone.tar.gz"] = 404
    server.files["/page.html"] = b"<html>your download will start shortly</html>"
    for first in ("/gone.tar.gz", "/page.html"):
        f = Fetcher(Cache(tmp_path / first.strip("/")), None).fetch(
            "lib", dict(src, url=server.url(first), fallback_urls=[src["url"]]))
        assert f.path.read_bytes() == BODY and f.origin == src["url"]
    assert "HTTP 404" in caplog.text and "does not match its pin" in caplog.text


def test_a_wrong_file_everywhere_is_refused_with_its_hashes(server, tmp_path):
    src = _src(server)
    server.files["/page.html"] = b"<html></html>"
    server.status["/gone.tar.gz"] = 404
    with pytest.raises(ChecksumError) as e:
        _fetcher(tmp_path).fetch("lib", dict(src, url=server.url("/gone.tar.gz"),
                                             fallback_urls=[server.url("/page.html")]))
    assert f"from {server.url('/page.html')} does not match its pin" in e.value.line()


def test_upstream_base_fetches_every_url_from_a_local_server(server, tmp_path, monkeypatch):
    """KVSTACK_UPSTREAM_BASE (tests only): https://HOST/PATH is fetched from BASE/HOST/PATH."""
    server.files["/github.com/o/lib/archive/v1.tar.gz"] = BODY
    src = {"url": "https://github.com/o/lib/archive/v1.tar.gz", "filename": "lib-1.0.tar.gz",
           "sha256": sha256(BODY)}
    monkeypatch.setenv("KVSTACK_UPSTREAM_BASE", server.url(""))
    f = _fetcher(tmp_path).fetch("lib", src)
    assert f.origin == server.url("/github.com/o/lib/archive/v1.tar.gz")
    assert f.path.read_bytes() == BODY
