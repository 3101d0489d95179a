"""The autoconf cache key and its entries, with this host's real compilers and package database."""
from __future__ import annotations

import os
import shutil

import pytest

from installer import configcache

pytestmark = pytest.mark.skipif(configcache._package_state() is None or not shutil.which("cc"),
                                reason="needs a dpkg/rpm host with a C compiler")
ARGV = [
    "/work/src/ucx/configure",
    "--prefix=/opt/a.builds/cpu-111/ucx",
    "--without-java",
    "--enable-mt",
]
ENV = {"PATH": os.environ["PATH"], "LC_ALL": "C"}


def test_key_ignores_the_prefix_and_the_source_path_but_not_flags_env_or_source():
    k = configcache.key(ARGV, "pin-a", ENV)
    assert k == configcache.key(
        ["/elsewhere/configure", "--prefix=/opt/b.builds/cpu-222/ucx", *ARGV[2:]], "pin-a", ENV
    )
    assert k != configcache.key([*ARGV, "--with-verbs"], "pin-a", ENV)
    assert k != configcache.key(ARGV, "pin-b", ENV)
    assert k != configcache.key(ARGV, "pin-a", {**ENV, "CFLAGS": "-O1"})
    assert k != configcache.key(
        ARGV, "pin-a", {**ENV, "PATH": "/nonexistent"}
    )  # no compilers there


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
    (build / configcache.CACHE_FILE).write_text(
        "ac_cv_header_stdio_h=${ac_cv_header_stdio_h=yes}\n"
    )
    assert "kept as" in configcache.save(cache, build, "k1")
    shutil.rmtree(build)
    assert "cached results from" in configcache.restore(cache, build, "k1")
    assert "ac_cv_header_stdio_h" in (build / configcache.CACHE_FILE).read_text()
    assert not list((cache / "autoconf").glob(".*.tmp"))


def test_no_key_means_no_cache_file(tmp_path):
    assert configcache.restore(tmp_path, tmp_path / "b", None).startswith("no cache")
    assert "cache_file" not in (tmp_path / "b" / configcache.SITE_FILE).read_text()
    assert configcache.save(tmp_path, tmp_path / "b", None) == "nothing to keep"


def test_autogen_outputs_are_kept_laid_over_a_fresh_tree_and_a_damaged_entry_is_made_again(
    tmp_path,
):
    """What autogen.sh wrote (files newer than the mark) is kept under the key and laid over the
    next fresh tree, whose configure then exists; an entry that cannot be read is removed and
    the next autogen.sh's outputs are kept in its place."""
    cache, key_ = tmp_path / "cache", "k" * 24
    src = tmp_path / "a"
    src.mkdir()
    (src / "configure.ac").write_text("AC_INIT\n")
    assert configcache.autogen_restore(cache, src, key_).startswith("no entry ")
    (src / "configure").write_text("#!/bin/sh\n")  # what "autogen.sh" writes
    assert configcache.autogen_keep(cache, src, key_).startswith(
        "1 files autogen.sh wrote kept as "
    )
    fresh = tmp_path / "b"
    fresh.mkdir()
    assert configcache.autogen_restore(cache, fresh, key_).startswith("autogen.sh's outputs from ")
    assert (fresh / "configure").read_text() == "#!/bin/sh\n"
    assert configcache.autogen_keep(cache, fresh, key_) == "nothing to keep"
    entry = next((cache / "autogen").iterdir())
    entry.write_bytes(b"not a tar")
    damaged = tmp_path / "c"
    damaged.mkdir()
    said = configcache.autogen_restore(cache, damaged, key_)
    assert "could not be used" in said and said.endswith(
        "autogen.sh runs and what it writes is kept"
    )
    (damaged / "configure").write_text("#!/bin/sh\n")
    assert configcache.autogen_keep(cache, damaged, key_).startswith(
        "1 files autogen.sh wrote kept as "
    )
    again = tmp_path / "d"
    again.mkdir()
    assert configcache.autogen_restore(cache, again, key_).startswith("autogen.sh's outputs from ")
