"""The autoconf cache key and its entries, with this host's real compilers and package database."""
from __future__ import annotations

import os
import shutil

import pytest

from installer import configcache

pytestmark = pytest.mark.skipif(configcache._package_state() is None or not shutil.which("cc"),
                                reason="needs a dpkg/rpm host with a C compiler")
ARGV = ["/work/src/ucx/configure", "--prefix=/opt/a.builds/cpu-111/ucx", "--without-java", "--enable-mt"]
ENV = {"PATH": os.environ["PATH"], "LC_ALL": "C"}


def test_key_ignores_the_prefix_and_the_source_path_but_not_flags_env_or_source():
    k = configcache.key(ARGV, "pin-a", ENV)
    assert k == configcache.key(["/elsewhere/configure", "--prefix=/opt/b.builds/cpu-222/ucx", *ARGV[2:]], "pin-a", ENV)
    assert k != configcache.key([*ARGV, "--with-verbs"], "pin-a", ENV)
    assert k != configcache.key(ARGV, "pin-b", ENV)
    assert k != configcache.key(ARGV, "pin-a", {**ENV, "CFLAGS": "-O1"})
    assert k != configcache.key(ARGV, "pin-a", {**ENV, "PATH": "/nonexistent"})  # no compilers there


def test_a_with_dir_is_part_of_the_key(tmp_path):
    (tmp_path / "include").mkdir()
    argv = [*ARGV, f"--with-cuda={tmp_path}"]
    before = configcache.key(argv, "pin", ENV)
    (tmp_path / "include" / "cuda.h").write_text("/* a newer toolkit */\n")
    assert configcache.key(argv, "pin", ENV) != before


def test_restore_points_configure_at_a_cache_file_and_keep_stores_it(tmp_path):
    cache, build = tmp_path / "cache", tmp_path / "build"
    assert "no entry" in configcache.restore(cache, build, "k1")
    site = (build / configcache.SITE_FILE).read_text()
    assert f"cache_file={build / configcache.CACHE_FILE}\n" in site
    (build / configcache.CACHE_FILE).write_text("ac_cv_header_stdio_h=${ac_cv_header_stdio_h=yes}\n")
    assert "kept as" in configcache.save(cache, build, "k1")
    shutil.rmtree(build)
    assert "cached results from" in configcache.restore(cache, build, "k1")
    assert "ac_cv_header_stdio_h" in (build / configcache.CACHE_FILE).read_text()
    assert not list((cache / "autoconf").glob(".*.tmp"))


def test_no_key_means_no_cache_file(tmp_path):
    assert configcache.restore(tmp_path, tmp_path / "b", None).startswith("no cache")
    assert "cache_file" not in (tmp_path / "b" / configcache.SITE_FILE).read_text()
    assert configcache.save(tmp_path, tmp_path / "b", None) == "nothing to keep"
