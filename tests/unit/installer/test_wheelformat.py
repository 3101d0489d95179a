"""The wheel format's pure parts: the tag taken from NIXL's extension modules, RECORD's hashes,
and a written wheel that pip's own reader (the stdlib zip + csv, as pip does) accepts."""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import zipfile

import pytest

from installer import wheelformat
from installer.errors import PrefixError
from installer.wheelformat import Entry, Tag


@pytest.mark.parametrize(
    "names, py, tag",
    [
        (
            ["_bindings.cpython-311-x86_64-linux-gnu.so", "_utils.cpython-311-x86_64-linux-gnu.so"],
            "3.11",
            "cp311-cp311-linux_x86_64",
        ),
        (["_bindings.cpython-312-aarch64-linux-gnu.so"], "3.12", "cp312-cp312-linux_aarch64"),
        (["_bindings.cpython-313t-x86_64-linux-gnu.so"], "3.13", "cp313-cp313t-linux_x86_64"),
        (["_bindings.cpython-311d-x86_64-linux-gnu.so"], "3.11", "cp311-cp311d-linux_x86_64"),
        (
            ["_bindings.cpython-311-x86_64-linux-musl.so", "libnixl.so"],
            "3.11",
            "cp311-cp311-linux_x86_64",
        ),
    ],
)
def test_tag_comes_from_the_extension_suffix(names, py, tag):
    assert str(wheelformat.tag_for_extensions(names, py)) == tag


def test_a_module_for_another_python_is_refused():
    with pytest.raises(PrefixError, match="is for cp312, the build's Python is 3.11"):
        wheelformat.tag_for_extensions(["_bindings.cpython-312-x86_64-linux-gnu.so"], "3.11")


def test_no_extension_module_is_refused():
    with pytest.raises(PrefixError, match="no CPython extension module"):
        wheelformat.tag_for_extensions(["libnixl.so"], "3.11")


def test_modules_that_disagree_are_refused():
    with pytest.raises(PrefixError, match="disagree"):
        wheelformat.tag_for_extensions(
            ["a.cpython-311-x86_64-linux-gnu.so", "b.cpython-311d-x86_64-linux-gnu.so"], "3.11"
        )


def test_abi3_is_refused_with_a_reason():
    with pytest.raises(PrefixError, match="abi3"):
        wheelformat.tag_for_extensions(["_bindings.abi3.so"], "3.11")


def test_names():
    tag = Tag("cp311", "cp311", "linux_x86_64")
    assert wheelformat.wheel_name("kvstack-nixl-cpu", "1.4.0+cpu.9cd985e552e4", tag) == \
        "kvstack_nixl_cpu-1.4.0+cpu.9cd985e552e4-cp311-cp311-linux_x86_64.whl"
    assert wheelformat.distribution_filename("Kvstack.Nixl--cpu") == "kvstack_nixl_cpu"


def test_record_hash_is_urlsafe_base64_sha256_without_padding():
    data = b"\xff" * 100
    want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")
    assert wheelformat.record_hash(data) == "sha256=" + want
    assert "=" not in want and "+" not in want and "/" not in want


def test_record_lists_every_entry_and_itself_without_hash():
    text = wheelformat.record(
        [("a/b.py", b"x = 1\n"), ("a,b.txt", b"")], "d-1.dist-info/RECORD"
    ).decode()
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0] == ["a/b.py", wheelformat.record_hash(b"x = 1\n"), "6"]
    assert rows[1] == ["a,b.txt", wheelformat.record_hash(b""), "0"]  # a comma in a name is quoted
    assert rows[2] == ["d-1.dist-info/RECORD", "", ""]


def test_written_wheel_matches_its_record(tmp_path):
    entries = [
        Entry("pkg/__init__.py", b"print('hi')\n"),
        Entry("pkg.libs/libx.so", b"\x7fELF...", executable=True),
        Entry(
            "d-1.dist-info/WHEEL",
            wheelformat.wheel_text(Tag("cp311", "cp311", "linux_x86_64"), "t"),
        ),
    ]
    dest = tmp_path / "d-1-cp311-cp311-linux_x86_64.whl"
    wheelformat.write(dest, entries, "d-1.dist-info")
    with zipfile.ZipFile(dest) as zf:
        names = zf.namelist()
        assert names[-1] == "d-1.dist-info/RECORD"
        rows = list(csv.reader(io.StringIO(zf.read("d-1.dist-info/RECORD").decode())))
        assert [r[0] for r in rows] == names
        for path, digest, size in rows[:-1]:
            data = zf.read(path)
            assert (digest, int(size)) == (wheelformat.record_hash(data), len(data))
        assert zf.getinfo("pkg.libs/libx.so").external_attr >> 16 == 0o100755
        assert zf.getinfo("pkg/__init__.py").external_attr >> 16 == 0o100644
        assert b"Tag: cp311-cp311-linux_x86_64\n" in zf.read("d-1.dist-info/WHEEL")
    first = dest.read_bytes()
    wheelformat.write(dest, entries, "d-1.dist-info")
    assert dest.read_bytes() == first  # same files, same bytes
