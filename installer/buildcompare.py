"""Do two builds hold the same bytes? Compares two install directories (`P.builds/<build id>/`)
file by file — libraries, modules, headers, pkg-config files, symbolic links — and for each file
that differs says where (the ELF sections whose bytes differ) and, where it can tell, why: a path
of the build that is not the same in the other one (the install directory, which RUNPATHs and
compiled-in module paths hold; the work directory under the cache, which __FILE__ and debug
information hold).

What is the record of a run rather than its output is left out: manifest.json (times, host),
logs/, and the per-component stamps in .kvstack/."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .elf import MAGIC, sections
from .errors import UsageError

SKIPPED = ("manifest.json", "logs", ".kvstack")


@dataclass
class Comparison:
    same: list[str] = field(default_factory=list)
    differ: dict[str, str] = field(default_factory=dict)   # file -> where and why
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not (self.differ or self.only_a or self.only_b)

    def to_dict(self) -> dict:
        return {"identical": self.identical, "same": len(self.same), "differ": self.differ,
                "only_a": self.only_a, "only_b": self.only_b}


def compare(a: Path, b: Path) -> Comparison:
    for d in (a, b):
        if not d.is_dir():
            raise UsageError(
                f"{d} is not a directory",
                fix="give two build directories (P.builds/<build id>) or prefixes",
            )
    a, b = a.resolve(), b.resolve()
    paths = _build_paths(a) + _build_paths(b)
    files_a, files_b = _files(a), _files(b)
    out = Comparison(
        only_a=sorted(set(files_a) - set(files_b)), only_b=sorted(set(files_b) - set(files_a))
    )
    for rel in sorted(set(files_a) & set(files_b)):
        pa, pb = a / rel, b / rel
        if pa.is_symlink() or pb.is_symlink():
            la = os.readlink(pa) if pa.is_symlink() else None
            lb = os.readlink(pb) if pb.is_symlink() else None
            if la == lb:
                out.same.append(rel)
            else:
                out.differ[rel] = f"symbolic link {la!r} vs {lb!r}"
            continue
        da, db = pa.read_bytes(), pb.read_bytes()
        if da == db:
            out.same.append(rel)
        else:
            out.differ[rel] = _why(da, db, paths)
    return out


def render(c: Comparison, a: Path, b: Path) -> str:
    lines = [f"{'same bytes' if c.identical else 'NOT the same bytes'}: {a} vs {b}",
             f"  {len(c.same)} files identical"]
    lines += [f"  differs: {rel}: {why}" for rel, why in c.differ.items()]
    lines += [f"  only in the first: {rel}" for rel in c.only_a]
    lines += [f"  only in the second: {rel}" for rel in c.only_b]
    return "\n".join(lines)


def _files(root: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d not in SKIPPED]
            filenames = [f for f in filenames if f not in SKIPPED]
        for name in filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]:
            out.append(str(rel_dir / name))
    return out


def _build_paths(build: Path) -> list[tuple[str, bytes]]:
    """The paths a build may have compiled in, from its manifest: install and work directory."""
    try:
        m = json.loads((build / "manifest.json").read_text())
    except (OSError, ValueError):
        return [("the install directory", str(build).encode())]
    plan = m.get("kvstack_plan", {})
    out = [("the install directory", str(m.get("install_dir", build)).encode())]
    if plan.get("work_dir"):
        out.append(("the work directory", plan["work_dir"].encode()))
    return out


def _why(da: bytes, db: bytes, paths: list[tuple[str, bytes]]) -> str:
    where = ""
    if da[:4] == MAGIC and db[:4] == MAGIC:
        sa, sb = _sections(da), _sections(db)
        diff = [n for n in sa if n in sb and sa[n] != sb[n]] + sorted(set(sa) ^ set(sb))
        where = f"ELF sections {', '.join(diff)}" if diff else "ELF headers or layout"
    else:
        first = (
            next(i for i, (x, y) in enumerate(zip(da, db)) if x != y)
            if len(da) == len(db)
            else min(len(da), len(db))
        )
        where = f"{len(da)} vs {len(db)} bytes, first difference at byte {first}"
    held = sorted(
        {
            what
            for what, p in paths
            if (p in da) != (p in db) or (p in da and p in db and da.count(p) != db.count(p))
        }
    )
    own = [what for what, p in paths if p in da or p in db]
    if held:
        return f"{where}; holds {' and '.join(held)} of one build but not the other's"
    if own:
        return f"{where}; holds {' and '.join(sorted(set(own)))}, which differ between the builds"
    return where


def _sections(data: bytes) -> dict[str, bytes]:
    """Section name -> contents, for little-endian ELF64 (what these builds are); {} otherwise."""
    return {sec.name: data[sec.offset:sec.offset + sec.size] for sec in sections(data)}
