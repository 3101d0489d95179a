"""installer/extract.py on a Python without tarfile's data filter (Debian 12's own 3.11.2): the
same rules, checked by hand, before anything is written."""
import io
import tarfile

import pytest

from installer import extract as extractmod
from installer.errors import BuildError
from installer.sources import Fetched


def _tar(path, members):
    with tarfile.open(path, "w:gz") as tf:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            elif kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, data
                tf.addfile(info)
            elif kind == "dir":
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
    return Fetched(name="p", kind="archive", path=path, origin="test", cached=False)


@pytest.fixture(params=["filter", "no-filter"])
def python(request, monkeypatch):
    if request.param == "no-filter":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python has no tarfile data filter")
    return request.param


def test_good_archive_extracts_with_its_top_directory_stripped(tmp_path, python):
    f = _tar(
        tmp_path / "a.tar.gz",
        [
            ("p-1/", "dir", None),
            ("p-1/configure", "file", b"#!/bin/sh\n"),
            ("p-1/link", "sym", "configure"),
        ],
    )
    dest = extractmod.extract(f, tmp_path / "src")
    assert (dest / "configure").read_bytes() == b"#!/bin/sh\n" and (dest / "link").resolve() == (
        dest / "configure"
    )


@pytest.mark.parametrize("members", [
    [("p-1/../../evil", "file", b"x")],
    [("/abs/evil", "file", b"x")],
    [("p-1/esc", "sym", "../../../etc/passwd")],
    [("p-1/abs", "sym", "/etc/passwd")],
])
def test_escaping_members_are_refused_and_nothing_lands(tmp_path, python, members):
    f = _tar(tmp_path / "a.tar.gz", members)
    with pytest.raises(BuildError) as e:
        extractmod.extract(f, tmp_path / "work" / "src")
    assert "cannot extract" in e.value.line() and "\n" not in e.value.line()
    assert not (tmp_path / "evil").exists() and not (tmp_path / "work" / "src").exists()
    assert not (tmp_path / "work" / "src.part").exists()
