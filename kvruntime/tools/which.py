"""`python -m kvruntime which`: which NIXL and which UCX this Python loads when it imports NIXL as
engines do (`import nixl`): the module's file (and, for kvstack's `nixl`, the backend and build
it is bound to), the UCX library NIXL's UCX backend brought into the process, the UCX modules
(libuct_*) that library loaded and, where its `ucx_info` is beside it (a kvstack build; a wheel
carries none), the transports that `ucx_info -d` lists. Read from the process itself
(/proc/self/maps after an agent with the UCX backend is up), not from PATH: a wrong UCX shows."""
from __future__ import annotations

import importlib
import os
import re
import subprocess


def mapped_files(maps: str = "/proc/self/maps") -> list[str]:
    with open(maps) as f:
        rows = [ln.split() for ln in f]
    return sorted({r[-1] for r in rows if len(r) >= 6 and "/" in r[-1]})


def ucx_of(files: list[str]) -> dict:
    """libucp's file (a build's libucp.so.0, a wheel's libucp-<hash>.so.0) and the transport
    modules (libuct_<name>.so) among a process's mapped files."""
    ucp = [f for f in files if re.fullmatch(r"libucp([-.][^/]*)?\.so(\.\d+)*", os.path.basename(f))]
    modules = sorted({m[1] for f in files
                      if (m := re.fullmatch(r"libuct_(\w+?)\.so(\.\d+)*", os.path.basename(f)))})
    return {"ucp": ucp, "modules": modules}


def transports_beside(ucp: str, timeout: float = 20.0) -> tuple[str | None, list[str]]:
    """(ucx_info used, the transports `ucx_info -d` lists) for the UCX whose libucp is `ucp`:
    the ucx_info of its install (<lib>/../bin), run on that library; (None, []) without one."""
    lib = os.path.dirname(os.path.realpath(ucp))
    tool = os.path.join(os.path.dirname(lib), "bin", "ucx_info")
    if not os.access(tool, os.X_OK):
        return None, []
    env = {**os.environ,
           "LD_LIBRARY_PATH": lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")}
    try:
        out = subprocess.run([tool, "-d"], capture_output=True, text=True, timeout=timeout, env=env,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.TimeoutExpired):
        return tool, []
    return tool, sorted({ln.split(":", 1)[1].strip() for ln in out.splitlines()
                         if ln.lstrip("# \t").startswith("Transport:")})


def which(module: str = "nixl") -> dict:
    """Import `module` as an engine does, bring up an agent with the UCX backend, and say what
    was loaded. Raises ImportError (or NIXL's own error) when that fails."""
    nixl = importlib.import_module(module)
    api = importlib.import_module(f"{module}._api")
    api.nixl_agent(f"kvruntime-which-{os.getpid()}", api.nixl_agent_config(backends=["UCX"]))
    ucx = ucx_of(mapped_files())
    info = {"module": module, "file": getattr(nixl, "__file__", None), "api": api.__file__,
            "kvstack": getattr(nixl, "__kvstack__", None), **ucx, "ucx_info": None,
            "transports": []}
    if len(ucx["ucp"]) == 1:
        info["ucx_info"], info["transports"] = transports_beside(ucx["ucp"][0])
    return info


def render(info: dict) -> list[str]:
    about = info.get("kvstack")
    if about:
        what = (f"kvstack's, bound to {about.get('backend')} ({about.get('backend_file')}), "
                f"{about.get('platform')} build {about.get('build_id')}")
    else:
        what = f"not kvstack's; its _api is {info['api']}"
    lines = [f"{info['module']}: {info['file']} ({what})"]
    if about and about.get("unused"):
        lines.append("  also installed, not used: "
                     + ", ".join(f"{n} ({p})" for n, p in about["unused"].items()))
    ucp = info["ucp"]
    lines.append(f"UCX: {ucp[0]}" if len(ucp) == 1 else
                 f"UCX: {len(ucp)} libucp loaded ({', '.join(ucp) or 'none'}): "
                 f"{'two UCXs in one process' if ucp else 'NIXL loaded no UCX'}")
    lines.append(f"  UCX modules loaded (libuct_*): {', '.join(info['modules']) or 'none'}")
    lines.append(f"  transports (ucx_info -d, {info['ucx_info']}): {', '.join(info['transports'])}"
                 if info["ucx_info"] else "  transports: no ucx_info beside that libucp (a "
                 "wheel's UCX): the modules above are what it can use")
    return lines
