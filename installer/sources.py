"""The fetch and check phases: every pinned source into the cache, verified before use.

Archives are streamed to a temporary file while hashed; a wrong sha256 removes the file and
fails with both hashes. HTTP 5xx and connection errors are retried with backoff, 4xx never.
`git archive` tarballs carry their commit id, which is checked against the recipe's `commit`.
Git sources are fetched at their commit into a bare repository and checked the same way.
Without a mirror, an archive's `url` then its `fallback_urls` are tried in turn: a location that
cannot be reached, answers 4xx or serves another file than the pin is passed over for the next.
A mirror (a directory or an http(s) URL) replaces the upstream URLs entirely: archives by their
`filename`, git sources as `<name>.git`.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

import requests

from .cache import CHUNK, Cache, sha256_file
from .errors import ChecksumError, DownloadError, InstallerError, OfflineError

log = logging.getLogger("kvstack.installer")

UPSTREAM_BASE = "KVSTACK_UPSTREAM_BASE"
CONNECT_TIMEOUT = 15
READ_TIMEOUT = 60


@dataclass
class Fetched:
    name: str
    kind: str
    path: Path
    origin: str
    cached: bool
    sha256: str | None = None
    commit: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "path": str(self.path),
            "origin": self.origin,
            "cached": self.cached,
            "sha256": self.sha256,
            "commit": self.commit,
        }


class Fetcher:
    def __init__(
        self,
        cache: Cache,
        mirror: str | None = None,
        *,
        retries: int = 4,
        backoff: float = 1.0,
        session: requests.Session | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.cache = cache
        self.mirror = mirror
        self.retries = retries
        self.backoff = backoff
        self.session = session or requests.Session()
        self.sleep = sleep

    # -- fetch ---------------------------------------------------------------------------------

    def fetch(self, name: str, src: dict[str, Any]) -> Fetched:
        if src.get("kind", "archive") == "git":
            return self._fetch_git(name, src)
        return self._fetch_archive(name, src)

    def _fetch_archive(self, name: str, src: dict[str, Any]) -> Fetched:
        want = src["sha256"]
        hit = self.cache.get(want)
        if hit:
            log.info("%s: cached (%s)", name, hit)
            return Fetched(name, "archive", hit, "cache", True, sha256=want)
        locations = self._archive_locations(src)
        unreachable: list[str] = []
        refused: list[InstallerError] = []  # a wrong file or a 4xx: the next may serve the pin
        for loc in locations:
            tmp = self.cache.temp_file()
            try:
                got = self._copy_from(loc, tmp)
            except _Unreachable as e:
                unreachable.append(f"{loc} ({e})")
                tmp.unlink(missing_ok=True)
                continue
            except DownloadError as e:
                tmp.unlink(missing_ok=True)
                refused.append(e)
                continue
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            if got != want:
                tmp.unlink(missing_ok=True)
                refused.append(ChecksumError(
                    f"{name}: {src['filename']} from {loc} does not match its pin",
                    expected=f"sha256 {want}", actual=f"sha256 {got}",
                    fix="the file was removed; if upstream really changed it, find out why before "
                        "you change the recipe's sha256"))
                continue
            path = self.cache.put(tmp, want)
            for e in refused:
                log.warning("%s: %s; taken from %s instead", name, e.line(), loc)
            log.info("%s: fetched %s (%d bytes)", name, loc, path.stat().st_size)
            return Fetched(name, "archive", path, loc, False, sha256=want)
        if refused:  # a wrong file before a 4xx: what was served matters more than what was not
            raise next((e for e in refused if isinstance(e, ChecksumError)), refused[0])
        if self.mirror:
            raise DownloadError(f"{name}: the mirror {self.mirror} cannot serve {src['filename']}: "
                                + "; ".join(unreachable),
                                fix="fill it on a connected host: python -m installer mirror DIR")
        raise OfflineError(
            f"{name}: no source location answered: " + "; ".join(unreachable),
            fix="check the network, or on a connected host run `python -m installer mirror DIR` "
            "and pass --mirror DIR here",
        )

    def _archive_locations(self, src: dict[str, Any]) -> list[str]:
        if self.mirror:
            return [_join(self.mirror, src["filename"])]
        return [upstream(url) for url in (src["url"], *src.get("fallback_urls", []))]

    def _copy_from(self, loc: str, dest: Path) -> str:
        """Copy one location into dest and return its sha256; _Unreachable when it cannot be had."""
        parsed = urlparse(loc)
        if parsed.scheme in ("http", "https"):
            return self._download(loc, dest)
        path = Path(parsed.path if parsed.scheme == "file" else loc)
        if not path.is_file():
            raise _Unreachable("no such file")
        h = hashlib.sha256()
        with open(path, "rb") as fin, open(dest, "wb") as fout:
            for chunk in iter(lambda: fin.read(CHUNK), b""):
                h.update(chunk)
                fout.write(chunk)
        return h.hexdigest()

    def _download(self, url: str, dest: Path) -> str:
        last = "no attempt"
        for attempt in range(1, self.retries + 1):
            if attempt > 1:
                delay = self.backoff * 2 ** (attempt - 2)
                log.info(
                    "retrying %s in %.1fs (attempt %d/%d): %s",
                    url,
                    delay,
                    attempt,
                    self.retries,
                    last,
                )
                self.sleep(delay)
            try:
                with self.session.get(
                    url, stream=True, timeout=(CONNECT_TIMEOUT, READ_TIMEOUT)
                ) as r:
                    if 400 <= r.status_code < 500:
                        raise DownloadError(
                            f"{url}: HTTP {r.status_code} {r.reason}",
                            fix="the file is not at that address: check the recipe's url, "
                            "or use --mirror",
                        )
                    if r.status_code >= 500:
                        last = f"HTTP {r.status_code}"
                        continue
                    h = hashlib.sha256()
                    size = 0
                    with open(dest, "wb") as f:
                        for chunk in r.iter_content(CHUNK):
                            h.update(chunk)
                            f.write(chunk)
                            size += len(chunk)
                    expected = r.headers.get("Content-Length")
                    if (
                        expected is not None
                        and r.headers.get("Content-Encoding") is None
                        and int(expected) != size
                    ):
                        last = f"transfer cut short ({size} of {expected} bytes)"
                        continue
                    return h.hexdigest()
            except (
                requests.ConnectionError,
                requests.Timeout,
                requests.exceptions.ChunkedEncodingError,
            ) as e:
                last = f"{e.__class__.__name__}: {_short(e)}"
                dest.unlink(missing_ok=True)
        dest.unlink(missing_ok=True)
        raise _Unreachable(f"{self.retries} attempts, last: {last}")

    def _fetch_git(self, name: str, src: dict[str, Any]) -> Fetched:
        commit, tag = src["commit"], src.get("tag")
        url = _join(self.mirror, f"{name}.git") if self.mirror else upstream(src["url"])
        repo = self.cache.git_dir(src["url"])
        if not repo.exists():
            tmp = repo.with_name(repo.name + ".part")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.parent.mkdir(parents=True, exist_ok=True)
            _git(["init", "--quiet", "--bare", str(tmp)])
            tmp.rename(repo)
        if _git(["cat-file", "-e", f"{commit}^{{commit}}"], repo, check=False).returncode == 0:
            log.info("%s: cached commit %s", name, commit)
            return Fetched(name, "git", repo, "cache", True, commit=commit)
        ref = f"refs/tags/{tag}" if tag else commit
        res = _git(["fetch", "--quiet", "--depth=1", "--no-tags", url, ref], repo, check=False)
        if res.returncode != 0:
            msg = (
                res.stderr.strip().splitlines()[-1]
                if res.stderr.strip()
                else f"git exit {res.returncode}"
            )
            if self.mirror:
                raise DownloadError(
                    f"{name}: cannot fetch {ref} from the mirror {url}: {msg}",
                    fix="fill it on a connected host: python -m installer mirror DIR",
                )
            raise OfflineError(
                f"{name}: cannot fetch {ref} from {url}: {msg}",
                fix="check the network, or pass --mirror DIR filled by `python -m installer "
                "mirror`",
            )
        got = _git(["rev-parse", "FETCH_HEAD^{commit}"], repo).stdout.strip()
        if got != commit:
            raise ChecksumError(
                f"{name}: {'tag ' + tag if tag else ref} at {url} is not the pinned commit",
                expected=f"commit {commit}",
                actual=f"commit {got}",
                fix="nothing was used; if the tag really moved, find out why before you change "
                "the recipe's commit",
            )
        _git(["update-ref", f"refs/kvstack/{commit}", commit], repo)
        log.info("%s: fetched %s at %s", name, url, commit)
        return Fetched(name, "git", repo, url, False, commit=commit)

    # -- check ---------------------------------------------------------------------------------

    def check(self, fetched: Fetched, src: dict[str, Any]) -> dict[str, Any]:
        """Re-verify what will be extracted against the pins; return the manifest record."""
        record = fetched.to_dict()
        if fetched.kind == "git":
            if _git(
                ["cat-file", "-e", f"{src['commit']}^{{commit}}"], fetched.path, check=False
            ).returncode:
                raise ChecksumError(
                    f"{fetched.name}: commit {src['commit']} is missing from {fetched.path}",
                    fix="delete that directory and fetch again",
                )
            record["checked"] = ["commit"]
            return record
        got = sha256_file(fetched.path)
        if got != src["sha256"]:
            fetched.path.unlink(missing_ok=True)
            raise ChecksumError(f"{fetched.name}: cached {src['filename']} changed on disk",
                                expected=f"sha256 {src['sha256']}", actual=f"sha256 {got}",
                                fix="the entry was removed; run again to fetch it anew")
        record["checked"] = ["sha256"]
        if "commit" in src:
            embedded = tar_commit_id(fetched.path)
            if embedded is not None and embedded != src["commit"]:
                raise ChecksumError(
                    f"{fetched.name}: {src['filename']} was made from another commit",
                    expected=f"commit {src['commit']}",
                    actual=f"commit {embedded}",
                    fix="the sha256 pin and the commit pin disagree: fix the recipe",
                )
            record["checked"].append(
                "commit" if embedded else "commit (not embedded in this archive)"
            )
            record["commit"] = src["commit"]
        return record


class _Unreachable(Exception):
    pass


def tar_commit_id(path: Path) -> str | None:
    """The commit id that `git archive` stores in the pax global header, if any."""
    try:
        with tarfile.open(path, "r:*") as tf:
            tf.next()
            comment = tf.pax_headers.get("comment", "")
    except (tarfile.TarError, OSError, EOFError):
        return None
    comment = comment.strip()
    return comment if len(comment) == 40 and all(c in "0123456789abcdef" for c in comment) else None


def upstream(url: str, base: str | None = None) -> str:
    """An upstream URL as fetched: unchanged, unless $KVSTACK_UPSTREAM_BASE (tests only: a local
    HTTP server standing for the upstream hosts) is set; then `https://HOST/PATH` is fetched
    from `BASE/HOST/PATH`, over real HTTP, by the same code."""
    base = os.environ.get(UPSTREAM_BASE) if base is None else base
    if not base:
        return url
    parsed = urlparse(url)
    return _join(base, parsed.netloc + parsed.path + (f"?{parsed.query}" if parsed.query else ""))


def _join(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + name


def _short(e: Exception) -> str:
    text = str(e)
    return text if len(text) < 160 else text[:157] + "..."


def _git(
    args: list[str], repo: Path | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    cmd = ["git"] + (["--git-dir", str(repo)] if repo else []) + args
    res = subprocess.run(cmd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise DownloadError(f"`{' '.join(cmd)}` failed: {res.stderr.strip()[-300:]}")
    return res
