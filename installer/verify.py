"""The verify phase: three levels, each passed, failed or skipped with its reason.

built   the files are there, `ucx_info -b` shows the platform's defines and modules, ldd resolves
        every library and plugin;
loaded  `ucx_info -d` lists the platform's transports and memory domains (xpu with no Intel GPU:
        through the Level Zero null driver), kvruntime's transport policy makes the recipe's
        choice from that list, and NIXL's module loads its plugins;
moved   kvruntime's self-test moves KV blocks between two processes on this build, every byte
        checked: host memory always (no device needed), device memory where the device is here.
A level that cannot run here is reported as skipped with the reason, never as passed: the verdict
says "passed" only when all three ran and passed, and a build passes only once bytes have moved.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import envfile, hostcaps, prefix as prefixmod
from .buildsys.step import Step
from .detect import detect_platform
from .errors import PrefixError
from .extract import extract
from .runner import run_step

if TYPE_CHECKING:  # annotations only: plan imports nothing of verify, and verify needs no plan at run time
    from .plan import Plan
    from .sources import Fetched

REPO_ROOT = Path(__file__).resolve().parent.parent
NO_NIXL = "this recipe builds no NIXL"
POLICY_PROBE = r"""
import json, sys
from kvruntime.transports import describe, ucx_settings
device, offered = sys.argv[1], set(filter(None, sys.argv[2].split(",")))
added = ucx_settings(device, {}, offered)
print(json.dumps({"added": added, "why": describe(added, {}, device, offered)}))
"""
NIXL_PROBE = r"""
import importlib, json, sys
mod = sys.argv[1]
api = importlib.import_module(mod + "._api")
agent = api.nixl_agent("kvstack-verify", api.nixl_agent_config(backends=["UCX"]))
try:  # as engines import NIXL: kvstack's `nixl`, bound to this module (nixlpackage.py)
    import warnings; warnings.simplefilter("ignore", RuntimeWarning)  # another NIXL installed
    import nixl, nixl._api
    engine = {"file": nixl.__file__, "same": nixl._api is api}
except Exception as e:
    engine = {"file": None, "same": False, "error": f"{type(e).__name__}: {e}"}
print(json.dumps({"module": mod, "file": importlib.import_module(mod).__file__,
                  "plugins": sorted(agent.get_plugin_list()), "engine": engine,
                  "ucx_mem_types": sorted(agent.get_backend_mem_types("UCX"))}))
"""


def _check(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"check": name, "ok": bool(ok), "detail": detail}


def _not_here(name: str, reason: str) -> dict[str, Any]:
    """A check this host cannot run: neither passed nor failed (ok None), with the reason."""
    return {"check": name, "ok": None, "detail": "not checked here: " + reason}


def _level(checks: list[dict], skipped: str | None = None) -> dict[str, Any]:
    if skipped:
        return {"status": "skipped", "reason": skipped, "checks": checks}
    ran = [c for c in checks if c["ok"] is not None]
    return {"status": "passed" if ran and all(c["ok"] for c in ran) else "failed", "checks": checks}


def _run(cmd: list[str], env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError as e:
        return subprocess.CompletedProcess(cmd, 127, "", str(e))
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 124, "", f"timed out after {timeout}s")


def parse_build_info(text: str) -> dict[str, str]:
    """`ucx_info -b`: '#define NAME VALUE' lines."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"#define\s+(\S+)\s*(.*)$", line.strip())
        if m:
            out[m.group(1)] = m.group(2).strip().strip('"')
    return out


def parse_devices(text: str) -> dict[str, Any]:
    """`ucx_info -d`: transports, memory domains, and each memory domain's text."""
    transports, domains, section, current = [], [], {}, None
    for line in text.splitlines():
        m = re.match(r"#\s*Memory domain:\s*(\S+)", line)
        if m:
            current = m.group(1)
            domains.append(current)
            section[current] = ""
            continue
        m = re.match(r"#\s*Transport:\s*(\S+)", line)
        if m:
            transports.append(m.group(1))
        if current:
            section[current] += line + "\n"
    return {"transports": transports, "memory_domains": domains, "sections": section}


def built(spec: dict, build_dir: Path, env: dict[str, str], with_table: dict[str, Any],
          components: list[str]) -> dict[str, Any]:
    checks = []
    files = [build_dir / f for f in spec.get("files", [])]
    has_ucx, has_nixl = "ucx" in components and "ucx" in spec, "nixl" in components and "nixl" in spec
    ucx_info = build_dir / "ucx" / "bin" / "ucx_info"
    if has_ucx:
        files += [ucx_info, build_dir / "ucx" / "lib" / "libucp.so"]
    if has_nixl:
        files += [build_dir / "nixl" / "lib" / "libnixl.so", build_dir / "nixl" / "lib" / "plugins"]
    for f in files:
        checks.append(_check(f"file {f.relative_to(build_dir)}", f.exists(), "present" if f.exists() else "missing"))
    if has_nixl:
        module = envfile.nixl_module(build_dir, spec["nixl"]["module"])
        checks.append(_check(f"python module {spec['nixl']['module']}", module is not None,
                             module or "not found under nixl/lib/python3*/*-packages"))
    if has_ucx:
        checks += _ucx_build_info(spec["ucx"], ucx_info, env, with_table)
    libs = []
    for pattern in ("*/lib/*.so", "*/lib/ucx/*.so", "*/lib/plugins/*.so"):
        libs += sorted(build_dir.glob(pattern))
    site = envfile.nixl_site_packages(build_dir)
    if site:
        libs += sorted(site.rglob("*.so"))
    unresolved = []
    for lib in libs:
        r = _run(["ldd", str(lib)], env)
        unresolved += [f"{lib.name}: {l.strip()}" for l in r.stdout.splitlines() if "not found" in l]
    if libs:
        checks.append(_check(f"ldd resolves {len(libs)} libraries", not unresolved,
                             "; ".join(unresolved[:5]) or "all resolved"))
    return _level(checks)


def _ucx_build_info(ucx: dict, ucx_info: Path, env: dict[str, str], with_table: dict[str, Any]) -> list[dict]:
    checks = []
    res = _run([str(ucx_info), "-b"], env)
    info = parse_build_info(res.stdout) if res.returncode == 0 else {}
    if res.returncode:
        checks.append(_check("ucx_info -b", False, (res.stderr or res.stdout)[-300:]))
    defines = list(ucx["defines"])
    if with_table.get("verbs") not in (None, False):
        defines.append("HAVE_IB")  # configure drops verbs silently when headers are missing
    for d in defines:
        checks.append(_check(f"define {d}", info.get(d) == "1", f"{d} = {info.get(d, 'undefined')}"))
    for d in ucx.get("absent_defines", []):
        checks.append(_check(f"define {d} absent", info.get(d) in (None, "0"), f"{d} = {info.get(d, 'undefined')}"))
    for var, wanted in ucx["modules"].items():
        have = [m for m in info.get(var, "").split(":") if m]
        for w in wanted:
            checks.append(_check(f"{var} has {w}", w in have, f"{var} = {':'.join(have) or '(empty)'}"))
    return checks


def loaded(spec: dict, build_dir: Path, env: dict[str, str], python: str, platform: str,
           null_driver: Path | None, has_device: bool, components: list[str]) -> dict[str, Any]:
    checks = []
    if "ucx" not in components or "ucx" not in spec:
        return _level([], skipped="this recipe builds no UCX")
    denv = dict(env)
    note = None
    lz = spec.get("level_zero")
    if lz and not has_device:
        if null_driver is None:
            return _level([], skipped="no Intel GPU here and no Level Zero null driver was built")
        denv = envfile.apply({"LD_LIBRARY_PATH": str(null_driver), "ZE_ENABLE_NULL_DRIVER": "1"}, env)
        note = f"Level Zero null driver from {null_driver}"
    want_transports = list(spec["ucx"]["transports"])
    want_domains = list(spec["ucx"]["memory_domains"])
    if platform == "cuda" and not has_device:
        return _level([], skipped="no NVIDIA GPU on this host: ucx_info -d cannot show cuda transports")
    res = _run([str(build_dir / "ucx" / "bin" / "ucx_info"), "-d"], denv)
    dev = parse_devices(res.stdout)
    if res.returncode:
        checks.append(_check("ucx_info -d", False, (res.stderr or res.stdout)[-300:]))
    # UCX offers cma only where process_vm_writev works (a container without CAP_SYS_PTRACE):
    # whether it was built is the built level's check (uct_MODULES); here it cannot be seen
    no_cma = hostcaps.cross_memory_denied() if "cma" in want_transports + want_domains else None
    for t in want_transports:
        if t == "cma" and no_cma and t not in dev["transports"]:
            checks.append(_not_here(f"transport {t}", no_cma))
            continue
        checks.append(_check(f"transport {t}", t in dev["transports"], f"listed: {', '.join(sorted(set(dev['transports'])))}"))
    for m in want_domains:
        if m == "cma" and no_cma and m not in dev["memory_domains"]:
            checks.append(_not_here(f"memory domain {m}", no_cma))
            continue
        checks.append(_check(f"memory domain {m}", m in dev["memory_domains"], f"listed: {', '.join(dev['memory_domains'])}"))
    if lz:
        text = dev["sections"].get("ze_cpy", "")
        marked = [l.strip("# ").strip() for l in text.splitlines() if lz["mark"] in l]
        checks.append(_check(f"ze_cpy shows {lz['mark']!r}", bool(marked),
                             (note + "; " if note else "") + (marked[0] if marked else "no such line in ze_cpy")))
    if "policy" in spec and res.returncode == 0:
        checks.append(_policy(spec["policy"], dev["transports"], env, python))
    if "nixl" not in components or "nixl" not in spec:
        return _level(checks)
    module = envfile.nixl_module(build_dir, spec["nixl"]["module"])
    if module:
        r = _run([python, "-c", NIXL_PROBE, module], env, timeout=120)
        try:
            probe = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            probe = None
        if probe is None:
            checks.append(_check(f"{module} creates a UCX agent", False, (r.stderr or r.stdout)[-400:]))
        else:
            for p in spec["nixl"]["plugins"]:
                checks.append(_check(f"NIXL plugin {p}", p in probe["plugins"], f"plugins: {probe['plugins']}"))
            checks.append(_check("NIXL UCX memory types", bool(probe["ucx_mem_types"]),
                                 f"{probe['ucx_mem_types']} ({probe['file']})"))
            engine = probe.get("engine", {})
            said = engine.get("error") or f"nixl: {engine.get('file')}"
            if not engine.get("same"):  # an install before kvstack wrote it: the next adds it
                said += "; install again (python -m installer ...) to write kvstack's nixl package"
            checks.append(_check(f"import nixl is {module}", engine.get("same") is True, said))
    else:
        checks.append(_check("NIXL module", False, "no NIXL Python module in this build"))
    return _level(checks)


def _kvruntime_env(env: dict[str, str], python: str) -> dict[str, str] | None:
    """The environment in which ``python`` imports kvruntime: this checkout's, else an installed
    one (the container image's runtime stage carries no checkout); None when neither."""
    if (REPO_ROOT / "kvruntime" / "__main__.py").exists():
        return envfile.apply({"PYTHONPATH": str(REPO_ROOT)}, env)
    if _run([python, "-c", "import kvruntime"], env, timeout=60).returncode == 0:
        return env
    return None


def _policy(want: dict, offered: list[str], env: dict[str, str], python: str) -> dict[str, Any]:
    """kvruntime's UCX choice for the recipe's device kind, made from the transports this build's
    own `ucx_info -d` just listed, as a process with no UCX_* of its own would make it."""
    name = f"kvruntime's UCX_TLS for {want['device']} memory on one node"
    renv = _kvruntime_env(env, python)
    if renv is None:
        return _not_here(name, f"kvruntime is neither in this checkout ({REPO_ROOT}) nor importable by {python}")
    r = _run([python, "-c", POLICY_PROBE, want["device"], ",".join(offered)], renv, timeout=60)
    try:
        got = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return _check(name, False, f"exit {r.returncode}: {(r.stderr or r.stdout)[-300:]}")
    tls = got["added"].get("UCX_TLS", "")
    return _check(name, tls == want["ucx_tls"], f"{'UCX_TLS=' + tls if tls else 'UCX_TLS left to UCX'}, "
                  f"expected {want['ucx_tls'] or 'left to UCX'}; " + "; ".join(got["why"]))


def moved(build_dir: Path, env: dict[str, str], python: str, platform: str, components: list[str],
          timeout: int = 600) -> dict[str, Any]:
    """Host memory always moves (no device needed); the platform's device memory where this host
    has the device, else those modes are shown as not checked here."""
    if "nixl" not in components:
        return _level([], skipped=NO_NIXL)
    renv = _kvruntime_env(env, python)
    if renv is None:
        return _level([], skipped=f"kvruntime is neither in this checkout ({REPO_ROOT}) nor importable by {python}")
    # every memory kind and engine this host offers, over this build; the mixed-TP pairs test
    # kvruntime's head arithmetic, not the stack (`python -m kvruntime selftest` runs them)
    cmd = [python, "-m", "kvruntime", "selftest", "--json", "--tp-pairs", "none"]
    r = _run(cmd, renv, timeout=timeout)
    try:
        result = json.loads(r.stdout)
    except ValueError:
        return _level([_check("kvruntime selftest", False, f"exit {r.returncode}: {(r.stderr or r.stdout)[-400:]}")])
    checks = []
    used = result.get("nixl_module_file") or ""
    fresh = os.path.realpath(used).startswith(os.path.realpath(build_dir) + os.sep)
    checks.append(_check("the self-test used this build's NIXL", fresh,
                         f"{result.get('nixl_module')} from {used or 'an unknown file'}"))
    for mode in result.get("modes", []):
        name = mode.get("mode") or f"{mode.get('layout')}/{mode.get('op')}"
        status = mode.get("status", "passed" if mode.get("ok") else "failed")
        if status == "skipped":
            # the platform's device modes on a host without that device: shown, never counted
            if name.startswith(f"{platform}/"):
                checks.append(_not_here(f"moved {name}", mode.get("reason") or "no such device here"))
            continue
        checks.append(_check(f"moved {name}", status == "passed" and mode.get("digest_ok") is True,
                             f"{mode.get('bytes', '?')} bytes in {mode.get('descriptors', '?')} descriptors, "
                             f"{mode.get('gbps')} GB/s, {mode.get('digests_checked', 0)} block digests checked"
                             + (f"; {mode['error']}" if mode.get("error") else "")))
    if not any(c["ok"] is not None for c in checks[1:]):
        return _level(checks, skipped=f"selftest ran no mode on this host: {result.get('reason', 'no mode available')}")
    level = _level(checks)
    level["selftest"] = result
    return level


# -- the three levels for a plan being installed, or for an installed prefix ------------------

def verify_build(plan: "Plan", renv: dict[str, str], fetched: "dict[str, Fetched] | None",
                 build_env: dict[str, str] | None, log_dir: Path) -> dict[str, Any]:
    env = envfile.apply(renv, dict(os.environ))
    has_device = detect_platform()[0] == plan.platform
    null_driver = None
    lz = plan.verify.get("level_zero")
    if lz and not has_device and "ucx" in [c.name for c in plan.components]:
        null_driver = _null_driver(plan, fetched, build_env, log_dir)
    with_table = plan.recipe.components.get("ucx", {}).get("with", {})
    return report_levels(plan.verify, plan.platform, plan.install_dir, env, plan.target.python, with_table,
                         null_driver, has_device, [c.name for c in plan.components])


def report_levels(spec, platform, build_dir, env, python, with_table, null_driver, has_device, components):
    levels = {"built": built(spec, build_dir, env, with_table, components)}
    levels["loaded"] = loaded(spec, build_dir, env, python, platform, null_driver, has_device, components)
    if levels["built"]["status"] == "failed" or levels["loaded"]["status"] == "failed":
        levels["moved"] = {"status": "skipped", "reason": "an earlier level failed", "checks": []}
    else:
        levels["moved"] = moved(build_dir, env, python, platform, components)
    return {"ok": passes(levels), "levels": levels, "has_device": has_device}


def passes(levels: dict[str, Any]) -> bool:
    """No level failed, and bytes have moved: host memory needs no device, so only a recipe without
    NIXL (a UCX-only build) may pass without the moved level. A skipped level is never a pass."""
    must_pass = ["built"] + (["moved"] if levels["moved"].get("reason") != NO_NIXL else [])
    return (all(v["status"] != "failed" for v in levels.values())
            and all(levels[name]["status"] == "passed" for name in must_pass))


def _null_driver(plan: "Plan", fetched, build_env, log_dir: Path) -> Path | None:
    """Build the Level Zero null driver (cmake target ze_null) and keep it in the build, so a
    later `installer verify` finds it too."""
    lz = plan.verify["level_zero"]
    dest = plan.install_dir / "verify" / "ze_null"
    if any(dest.glob("libze_null.so*")):
        return dest
    if not fetched or build_env is None:
        return None
    src = plan.work_dir / "src" / "level-zero"
    build = plan.work_dir / "build" / "level-zero"
    extract(fetched[lz["null_driver_source"]], src)
    shutil.rmtree(build, ignore_errors=True)
    steps = [Step("configure", "ze-null-configure", ("cmake", "-S", str(src), "-B", str(build), "-G", "Ninja",
                                                      "-DCMAKE_BUILD_TYPE=Release")),
             Step("build", "ze-null-build", ("cmake", "--build", str(build), "--target", lz["cmake_target"],
                                             "-j", str(plan.jobs)))]
    for s in steps:
        run_step(s, component="level-zero", env=build_env, log_dir=log_dir, actions={})
    dest.mkdir(parents=True, exist_ok=True)
    for lib in build.rglob("libze_null.so*"):
        shutil.copy2(lib, dest / lib.name, follow_symlinks=False)
    return dest


def verify_prefix(prefix: Path) -> dict[str, Any]:
    """`installer verify`: re-run the levels on an installed build, from its manifest."""
    build_dir = prefixmod.current(prefix)
    if build_dir is None or not prefixmod.is_complete(build_dir):
        raise PrefixError(f"{prefix} holds no finished kvstack build", fix="install first: python -m installer")
    manifest = json.loads((build_dir / prefixmod.COMPLETE).read_text())
    recipe = manifest["recipe"]
    platform = manifest["platform"]
    env = envfile.apply(manifest["env"], dict(os.environ))
    has_device = detect_platform()[0] == platform
    nd = build_dir / "verify" / "ze_null"
    report = report_levels(recipe["verify"], platform, build_dir, env, manifest["python"]["path"],
                           recipe["components"].get("ucx", {}).get("with", {}),
                           nd if nd.exists() else None, has_device, list(recipe["components"]))
    report["build_dir"] = str(build_dir)
    return report


def render_verification(report: dict[str, Any]) -> str:
    lines = []
    for level, v in report["levels"].items():
        lines.append(f"{level:7} {v['status']}" + (f" ({v['reason']})" if v.get("reason") else ""))
        for c in v["checks"]:
            mark = "skip" if c["ok"] is None else "ok  " if c["ok"] else "FAIL"
            lines.append(f"   {mark} {c['check']}: {c['detail']}")
    lines.append(verdict(report))
    return "\n".join(lines)


def verdict(report: dict[str, Any]) -> str:
    """The last line: "passed" only when every level ran and passed; otherwise what passed and
    what did not run, so a level that could not run here is never read as a pass."""
    if not report["ok"]:
        return "verification FAILED"
    levels = report["levels"]
    not_run = [f"{name} ({v.get('reason', 'not run')})" for name, v in levels.items() if v["status"] != "passed"]
    unchecked = [c for v in levels.values() for c in v["checks"] if c["ok"] is None]
    # checks a level could not make here (the platform's device memory, cma in a container)
    tail = (f"; {len(unchecked)} checks not made here, e.g. {unchecked[0]['check']} "
            f"({unchecked[0]['detail'].removeprefix('not checked here: ')})" if unchecked else "")
    if not not_run:
        return "verification passed" + tail
    passed = [name for name, v in levels.items() if v["status"] == "passed"]
    return f"verification passed for {', '.join(passed)} only; not run here: {'; '.join(not_run)}" + tail
