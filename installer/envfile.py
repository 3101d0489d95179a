"""env.sh: what a shell (or a process the installer starts) needs to use a build: library and
plugin paths, NIXL's Python module, and the platform's UCX settings."""
from __future__ import annotations

import glob
import os
import shlex
from pathlib import Path

from .plan import Plan


def nixl_site_packages(build_dir: Path) -> Path | None:
    """Where meson installed NIXL's Python module: the directory above the package holding
    `_bindings*.so` (lib/python3.X/site-packages, or lib/python3/dist-packages for Debian's)."""
    hits = sorted(
        glob.glob(
            str(build_dir / "nixl" / "lib" / "python3*" / "*-packages" / "nixl*" / "_bindings*.so")
        )
    )
    return Path(hits[0]).parent.parent if hits else None


def nixl_module(build_dir: Path, pattern: str) -> str | None:
    site = nixl_site_packages(build_dir)
    if site is None:
        return None
    # NIXL's own module holds _bindings; kvstack's `nixl` beside it (nixlpackage.py) does not
    mods = sorted(p.name for p in site.glob(pattern)
                  if (p / "__init__.py").exists() and any(p.glob("_bindings*.so")))
    return mods[0] if mods else None


def runtime_env(plan: Plan, build_dir: Path) -> dict[str, str]:
    """Variables env.sh sets, as absolute values (prepended to what is already there). Components
    later in the build order come first: NIXL's libraries before UCX's."""
    comps = [build_dir / c.name for c in reversed(plan.components)]
    env = {"KVSTACK_HOME": str(build_dir)}
    bins = [str(c / "bin") for c in comps if (c / "bin").is_dir()]
    libs = [str(c / "lib") for c in comps if any((c / "lib").glob("*.so*"))]
    if bins:
        env["PATH"] = os.pathsep.join(bins)
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs)
    if (build_dir / "nixl" / "lib" / "plugins").is_dir():
        env["NIXL_PLUGIN_DIR"] = str(build_dir / "nixl" / "lib" / "plugins")
    site = nixl_site_packages(build_dir)
    if site:
        env["PYTHONPATH"] = str(site)
    module = (
        nixl_module(build_dir, plan.verify["nixl"]["module"]) if "nixl" in plan.verify else None
    )
    if module:
        env["KVRUNTIME_NIXL_MODULE"] = module
    # how kvruntime moves KV here by default: through host staging (tpu), else registered directly
    env["KVRUNTIME_KV_BUFFER"] = "host_staged" if plan.kv_buffer == "host_staged" else "device"
    env.update(plan.runtime_env)
    return env


PREPENDED = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH")


def apply(env: dict[str, str], base: dict[str, str]) -> dict[str, str]:
    out = dict(base)
    for k, v in env.items():
        out[k] = v + os.pathsep + base[k] if k in PREPENDED and base.get(k) else v
    return out


def render(plan: Plan, env: dict[str, str]) -> str:
    lines = [f"# kvstack {plan.platform} build {plan.build_id}: `. {env['KVSTACK_HOME']}/env.sh`",
             "# Written by python -m installer; the build it describes never changes."]
    for k, v in env.items():
        if k in PREPENDED:
            lines.append(f'export {k}={shlex.quote(v)}"${{{k}:+:${k}}}"')
        else:
            lines.append(f"export {k}={shlex.quote(v)}")
    return "\n".join(lines) + "\n"


POLICY_CHECK = "kvruntime's UCX_TLS"  # verify's loaded-level check of the transport policy


def policy_comment(report: dict) -> str:
    """env.sh's note of the transport choice the loaded level saw kvruntime make on this build's
    own `ucx_info -d` (xpu: ze_ipc, or the ze_copy fallback and why), and of what verification
    proved of RDMA here; "" when it shows neither."""
    levels = report.get("levels", {})
    lines = []
    for check in levels.get("loaded", {}).get("checks", []):
        if check["check"].startswith(POLICY_CHECK) and check["ok"]:
            lines += [
                f"# {check['check']}, from this build's ucx_info -d when it was verified: "
                f"{check['detail']}",
                "# Each process chooses again from the ucx_info on its PATH (`python -m kvruntime "
                "selftest` prints its choice).",
            ]
    rdma = [
        c
        for c in levels.get("moved", {}).get("checks", [])
        if "RDMA" in c["check"] or "rdmap" in c["check"]
    ]
    if rdma:
        lines.append(
            "# RDMA when this build was verified: "
            + "; ".join(
                f"{c['check']}: "
                f"{'passed' if c['ok'] else 'FAILED' if c['ok'] is False else 'not proven here'}"
                for c in rdma
            )
        )
        lines.append(
            "# Between hosts each process chooses its wire (RDMA device, nearest NIC, GPUDirect) "
            "and says why: `python -m kvruntime policy`."
        )
    return "".join(line + "\n" for line in lines)
