"""The platform tag a set of ELF files may carry (PEP 600, manylinux_2_X_ARCH): read from what
they need of the host, not assumed from the build machine. Each file's NEEDED libraries and the
versioned symbols it needs (ELF's .gnu.version_r: GLIBC_2.34, GLIBCXX_3.4.30, ...) come from its
own bytes; manylinux.toml says which libraries a host provides and which C++ runtime each
glibc's distributions ship. pip then refuses the wheel on a host too old for it, by tag, instead
of the import failing there on a missing symbol version."""
from __future__ import annotations

import re
import struct
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

POLICY = Path(__file__).with_name("manylinux.toml")
SHT_DYNAMIC, SHT_GNU_VERNEED, DT_NEEDED = 6, 0x6FFFFFFE, 1
_MACHINES = {62: "x86_64", 183: "aarch64"}
_VERSION = re.compile(r"^(GLIBC|GLIBCXX|CXXABI)_(\d+(?:\.\d+)*)$")


@dataclass
class Needs:
    """What one ELF file asks of the host."""

    arch: str
    libraries: list[str] = field(default_factory=list)   # DT_NEEDED, in order
    versions: dict[str, set[str]] = field(default_factory=dict)  # library -> symbol versions


def read_needs(path: Path) -> Needs:
    """NEEDED and version needs of a 64-bit little-endian ELF file (ValueError otherwise)."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    machine = struct.unpack_from("<H", data, 18)[0]
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def string(section: int, offset: int) -> str:
        start = sections[section][4] + offset
        return data[start:data.index(b"\0", start)].decode()

    needs = Needs(_MACHINES.get(machine, f"machine{machine}"))
    for _name, kind, _flags, _addr, off, size, link, info, _align, _entsize in sections:
        if kind == SHT_DYNAMIC:
            for at in range(off, off + size, 16):
                tag, value = struct.unpack_from("<qQ", data, at)
                if tag == 0:
                    break
                if tag == DT_NEEDED:
                    needs.libraries.append(string(link, value))
        elif kind == SHT_GNU_VERNEED:
            at = off
            for _ in range(info):
                _ver, count, file, aux, nxt = struct.unpack_from("<HHIII", data, at)
                names = needs.versions.setdefault(string(link, file), set())
                a = at + aux
                for _ in range(count):
                    _hash, _vflags, _other, name, anext = struct.unpack_from("<IHHII", data, a)
                    names.add(string(link, name))
                    a += anext
                at += nxt
    return needs


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


@dataclass(frozen=True)
class Verdict:
    platform: str   # manylinux_2_35_x86_64, or linux_x86_64 when no manylinux tag fits
    why: str        # what set it: the newest need, or what rules manylinux out


@dataclass(frozen=True)
class FromPip:
    """A library a wheel takes from another wheel it requires (manylinux.toml's [pip] table)."""
    library: str
    requirement: str   # PEP 508: nvidia-cuda-runtime==13.*
    directory: str     # where that wheel installs it, relative to site-packages


def from_pip(needs: list[Needs], bundled: set[str], policy_path: Path = POLICY) -> list[FromPip]:
    """The libraries these files need that neither the wheel nor the host has and a wheel on PyPI provides."""
    table = tomllib.loads(policy_path.read_text()).get("pip", {})
    needed = {lib for n in needs for lib in n.libraries} - bundled
    return [FromPip(lib, row["requirement"], row["directory"]) for lib, row in sorted(table.items()) if lib in needed]


def platform_tag(files: list[Path], bundled: set[str], policy_path: Path = POLICY) -> Verdict:
    """The tag for a wheel holding ``files``, whose own libraries are named ``bundled`` (with those
    it takes from the wheels it requires: `from_pip`)."""
    return decide([read_needs(p) for p in files], bundled, tomllib.loads(policy_path.read_text()))


def decide(needs: list[Needs], bundled: set[str], policy: dict) -> Verdict:
    """Pure: the verdict from the files' needs and manylinux.toml's contents."""
    arches = {n.arch for n in needs}
    if len(arches) != 1:
        return Verdict("linux_unknown", f"files for {sorted(arches) or 'no'} architectures")
    arch = arches.pop()
    linux = f"linux_{arch}"
    host = set(policy["system"]) | set(policy["drivers"])
    outside = sorted({lib for n in needs for lib in n.libraries} - bundled - host)
    if outside:
        return Verdict(linux, f"needs {', '.join(outside)} from the host, which manylinux does not "
                              "promise: bundle it or build on a host without it")
    newest = {"GLIBC": (2, 17), "GLIBCXX": (0,), "CXXABI": (0,)}
    for n in needs:
        for names in n.versions.values():
            for name in names:
                m = _VERSION.match(name)
                if m:
                    newest[m[1]] = max(newest[m[1]], _version(m[2]))
    glibc, why = newest["GLIBC"], f"GLIBC_{'.'.join(map(str, newest['GLIBC']))}"
    for kind in ("GLIBCXX", "CXXABI"):
        if newest[kind] == (0,):
            continue
        row = next((r for r in policy["cxx"] if _version(r[kind.lower()]) >= newest[kind]), None)
        need = f"{kind}_{'.'.join(map(str, newest[kind]))}"
        if row is None:
            return Verdict(linux, f"needs {need}, newer than the C++ runtime of any distribution "
                                  "manylinux.toml lists")
        if _version(row["glibc"]) > glibc:
            glibc, why = _version(row["glibc"]), f"{need} (first shipped with {row['distribution']})"
    return Verdict(f"manylinux_{glibc[0]}_{glibc[1]}_{arch}", why)
