"""The wheel file format (PEP 427 / the binary distribution format spec): the tag of a wheel
whose extension modules were built for one CPython, its file name, the dist-info files (METADATA,
WHEEL, RECORD) and the zip itself. Pure except for `write`, which writes the zip."""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import PrefixError

# `_bindings.cpython-311-x86_64-linux-gnu.so`: CPython's EXT_SUFFIX names the interpreter, its ABI
# flags (d: debug, t: free-threaded) and the platform triplet the module was compiled for.
_EXT = re.compile(
    r"\.cpython-(?P<ver>3\d+)(?P<flags>[dt]*)-(?P<arch>[A-Za-z0-9_]+)-linux-(?:gnu|musl)\w*\.so$"
)
_ABI3 = re.compile(r"\.abi3\.so$")
EPOCH = (1980, 1, 1, 0, 0, 0)  # zip's earliest date: the same files give the same wheel bytes


@dataclass(frozen=True)
class Tag:
    interpreter: str   # cp311
    abi: str           # cp311, cp313t, abi3
    platform: str      # linux_x86_64

    def __str__(self) -> str:
        return f"{self.interpreter}-{self.abi}-{self.platform}"


def tag_for_extensions(names: list[str], python_version: str) -> Tag:
    """The tag of a wheel holding these extension modules, built for `python_version` ("3.11").
    Every module must agree; a module for another Python than the build's is refused."""
    want = "cp" + python_version.replace(".", "")
    tags = set()
    for name in names:
        m = _EXT.search(name)
        if m:
            interp = "cp" + m["ver"]
            if interp != want:
                raise PrefixError(
                    f"extension module {name} is for {interp}, the build's Python is "
                    f"{python_version}",
                    fix="rebuild with --python naming the interpreter the wheel is for",
                )
            tags.add(Tag(interp, interp + m["flags"], "linux_" + m["arch"]))
        elif _ABI3.search(name):
            raise PrefixError(
                f"extension module {name} has no platform in its name (abi3)",
                fix="kvstack wheels NIXL's meson build, whose modules carry CPython's full suffix",
            )
    if not tags:
        raise PrefixError(
            "no CPython extension module (name.cpython-3XY-ARCH-linux-gnu.so) to take the wheel's "
            "tag from",
            fix="point --prefix at a build with NIXL's Python module",
        )
    if len(tags) > 1:
        raise PrefixError(
            f"extension modules disagree on their tag: {', '.join(sorted(map(str, tags)))}",
            fix="rebuild the prefix",
        )
    return tags.pop()


def distribution_filename(name: str) -> str:
    """A name as wheel file names and dist-info directories spell it (runs of -_. become _)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_name(name: str, version: str, tag: Tag) -> str:
    return f"{distribution_filename(name)}-{version}-{tag}.whl"


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def record(entries: list[tuple[str, bytes]], record_path: str) -> bytes:
    """RECORD for these (archive path, content) entries; RECORD lists itself with no hash."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    for path, data in entries:
        w.writerow([path, record_hash(data), len(data)])
    w.writerow([record_path, "", ""])
    return out.getvalue().encode()


def wheel_text(tag: Tag, generator: str) -> bytes:
    return (
        f"Wheel-Version: 1.0\nGenerator: {generator}\nRoot-Is-Purelib: false\nTag: {tag}\n"
    ).encode()


def metadata_text(
    name: str, version: str, summary: str, requires: list[str], python_version: str
) -> bytes:
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", f"Summary: {summary}",
             f"Requires-Python: =={python_version}.*", *(f"Requires-Dist: {r}" for r in requires)]
    return ("\n".join(lines) + "\n").encode()


@dataclass
class Entry:
    path: str        # inside the wheel, / separated
    data: bytes
    executable: bool = False


def write(dest: Path, entries: list[Entry], dist_info: str) -> None:
    """The wheel at dest: entries in order, then RECORD (hashing every entry) as the last file."""
    record_path = f"{dist_info}/RECORD"
    body = record([(e.path, e.data) for e in entries], record_path)
    with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for e in [*entries, Entry(record_path, body)]:
            info = zipfile.ZipInfo(e.path, date_time=EPOCH)
            info.external_attr = (0o100755 if e.executable else 0o100644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, e.data)
