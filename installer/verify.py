"""The verify phase: three levels, each passed, failed or skipped with its reason.

built   the files are there, `ucx_info -b` shows the platform's defines and modules, ldd resolves
        every library and plugin;
loaded  `ucx_info -d` lists the platform's transports and memory domains (xpu with no Intel GPU:
        through the Level Zero null driver), and NIXL's module loads its plugins;
moved   kvruntime's self-test moves KV blocks between two processes on this build, every byte
        checked.
A level that cannot run here is reported as skipped with the reason, never as passed.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from . import envfile

REPO_ROOT = Path(__file__).resolve().parent.parent
NIXL_PROBE = r"""
import importlib, json, sys
mod = sys.argv[1]
api = importlib.import_module(mod + "._api")
agent = api.nixl_agent("kvstack-verify", api.nixl_agent_config(backends=["UCX"]))
print(json.dumps({"module": mod, "file": importlib.import_module(mod).__file__,
                  "plugins": sorted(agent.get_plugin_list()),
                  "ucx_mem_types": sorted(agent.get_backend_mem_types("UCX"))}))
"""


def _check(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"check": name, "ok": bool(ok), "detail": detail}


def _level(checks: list[dict], skipped: str | None = None) -> dict[str, Any]:
    if skipped:
        return {"status": "skipped", "reason": skipped, "checks": checks}
    return {"status": "passed" if checks and all(c["ok"] for c in checks) else "failed", "checks": checks}


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
    for t in want_transports:
        checks.append(_check(f"transport {t}", t in dev["transports"], f"listed: {', '.join(sorted(set(dev['transports'])))}"))
    for m in want_domains:
        checks.append(_check(f"memory domain {m}", m in dev["memory_domains"], f"listed: {', '.join(dev['memory_domains'])}"))
    if lz:
        text = dev["sections"].get("ze_cpy", "")
        marked = [l.strip("# ").strip() for l in text.splitlines() if lz["mark"] in l]
        checks.append(_check(f"ze_cpy shows {lz['mark']!r}", bool(marked),
                             (note + "; " if note else "") + (marked[0] if marked else "no such line in ze_cpy")))
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
    else:
        checks.append(_check("NIXL module", False, "no NIXL Python module in this build"))
    return _level(checks)


def moved(build_dir: Path, env: dict[str, str], python: str, kv_buffer: str, platform: str, has_device: bool,
          components: list[str], timeout: int = 600) -> dict[str, Any]:
    if "nixl" not in components:
        return _level([], skipped="this recipe builds no NIXL")
    if kv_buffer == "device" and not has_device:
        return _level([], skipped=f"no {platform} device on this host: KV for this platform lives in device memory, "
                                  f"so moving it needs one (run `python -m installer verify` there)")
    if not (REPO_ROOT / "kvruntime" / "__main__.py").exists():
        return _level([], skipped=f"kvruntime is not in this checkout ({REPO_ROOT})")
    renv = envfile.apply({"PYTHONPATH": str(REPO_ROOT)}, env)
    cmd = [python, "-m", "kvruntime", "selftest", "--json"]
    r = _run(cmd, renv, timeout=timeout)
    try:
        result = json.loads(r.stdout)
    except ValueError:
        return _level([_check("kvruntime selftest", False, f"exit {r.returncode}: {(r.stderr or r.stdout)[-400:]}")])
    checks = []
    for mode in result.get("modes", []):
        name = mode.get("mode") or f"{mode.get('layout')}/{mode.get('op')}"
        status = mode.get("status", "passed" if mode.get("ok") else "failed")
        if status == "skipped":
            continue
        checks.append(_check(f"moved {name}", status == "passed" and mode.get("digest_ok") is True,
                             f"{mode.get('bytes', '?')} bytes in {mode.get('descriptors', '?')} descriptors, "
                             f"{mode.get('gbps')} GB/s, {mode.get('digests_checked', 0)} block digests checked"
                             + (f"; {mode['error']}" if mode.get("error") else "")))
    if not checks:
        return _level([], skipped=f"selftest ran no mode on this host: {result.get('reason', 'no mode available')}")
    level = _level(checks)
    level["selftest"] = result
    return level
