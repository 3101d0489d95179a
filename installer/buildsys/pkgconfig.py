"""A CMake project built only as far as its consumer needs: the pkg-config modules the consumer
asks for (NIXL asks Abseil for nine), every module they require, and the static libraries those
name. Read from the .pc files the project writes at configure time, so nothing is listed by hand
and a new release of the project brings its own closure."""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import BuildError

TARGETS_FILE = (
    "kvstack-targets"  # archive paths, relative to the build directory, for the build step
)
_REQUIRES = re.compile(r"^Requires(?:\.private)?:(.*)$", re.MULTILINE)
_LIBS = re.compile(r"^Libs(?:\.private)?:(.*)$", re.MULTILINE)


@dataclass(frozen=True)
class Closure:
    modules: dict[str, Path]  # module -> its .pc file in the build tree
    archives: dict[str, Path]  # library name (as in -lNAME) -> the archive that builds it, relative


def pc_files(build_dir: Path) -> dict[str, Path]:
    return {p.stem: p for p in build_dir.rglob("*.pc") if "CMakeFiles" not in p.parts}


def closure(build_dir: Path, roots: list[str], archive_outputs: list[str]) -> Closure:
    """roots and all they require, through Requires and Requires.private (static archives need
    both); archive_outputs: the build's outputs (`ninja -t targets all`), to find lib<name>.a."""
    pcs = pc_files(build_dir)
    modules: dict[str, Path] = {}
    libs: list[str] = []
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in modules:
            continue
        if name not in pcs:
            raise BuildError(
                f"pkg-config module {name!r} is not among the {len(pcs)} .pc files the configure "
                f"step wrote under {build_dir}",
                fix="check pkgconfig_modules in the recipe against this release of the project",
            )
        modules[name] = pcs[name]
        text = pcs[name].read_text()
        for line in _REQUIRES.findall(text):
            todo += [item.split()[0] for item in line.split(",") if item.strip()]
        for line in _LIBS.findall(text):
            libs += [f[2:] for f in line.split() if f.startswith("-l")]
    by_file = {Path(out).name: out for out in archive_outputs}
    archives = {
        lib: Path(by_file[f"lib{lib}.a"]) for lib in dict.fromkeys(libs) if f"lib{lib}.a" in by_file
    }
    return Closure(modules, archives)


def ninja_outputs(build_dir: Path, env: dict[str, str]) -> list[str]:
    r = subprocess.run(["ninja", "-C", str(build_dir), "-t", "targets", "all"], env=env,
                       capture_output=True, text=True)
    if r.returncode:
        raise BuildError(f"ninja -t targets in {build_dir} failed: {r.stderr.strip()[-300:]}",
                         fix="pkgconfig_modules needs CMake's Ninja generator")
    # "out: rule"; the phony aliases CMake adds (libX.a: phony) name no file
    pairs = [line.rsplit(": ", 1) for line in r.stdout.splitlines() if ": " in line]
    return [out for out, rule in pairs if rule.strip() != "phony"]


def plan_targets(build_dir: Path, roots: list[str], env: dict[str, str]) -> str:
    """After configure: write the archives to build, and say what the closure holds."""
    c = closure(build_dir, roots, ninja_outputs(build_dir, env))
    (build_dir / TARGETS_FILE).write_text("".join(f"{p}\n" for p in c.archives.values()))
    return (f"{len(roots)} modules asked for, {len(c.modules)} with what they require, "
            f"{len(c.archives)} libraries to build: {' '.join(sorted(c.archives))}")


def install(build_dir: Path, install_dir: Path, roots: list[str], env: dict[str, str]) -> str:
    """The closure's archives and .pc files, beside what the project's top-level install rules
    put there (headers). The project's CMake package files are removed: they name every library
    the project has, and only the closure was built; consumers here use pkg-config."""
    c = closure(build_dir, roots, ninja_outputs(build_dir, env))
    lib, pc = install_dir / "lib", install_dir / "lib" / "pkgconfig"
    pc.mkdir(parents=True, exist_ok=True)
    for archive in c.archives.values():
        shutil.copy2(build_dir / archive, lib / archive.name)
    for name, path in c.modules.items():
        shutil.copy2(path, pc / f"{name}.pc")
    removed = lib / "cmake"
    shutil.rmtree(removed, ignore_errors=True)
    return (
        f"installed {len(c.archives)} libraries and {len(c.modules)} .pc files; removed {removed}"
    )
