"""The verify phase: three levels, each passed, failed or skipped with its reason.

built   the files are there, `ucx_info -b` shows the platform's defines and modules, ldd resolves
        every library and plugin;
loaded  `ucx_info -d` lists the platform's transports and memory domains (xpu with no Intel GPU:
        through the Level Zero null driver), kvruntime's transport policy makes the recipe's
        choice from that list, and NIXL's module loads its plugins;
moved   kvruntime's self-test moves KV blocks between two processes on this build, every byte
        checked: host memory always (no device needed), device memory where the device is here;
        and where the target Python has transformers, `kvruntime demo`: a small model's prompt
        prefilled in one process, continued in another, tokens identical to one process's.
A level that cannot run here is reported as skipped with the reason, never as passed: the verdict
says "passed" only when all three ran and passed, and a build passes only once bytes have moved.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import envfile, hostcaps, ibmock, wheeldeps
from . import prefix as prefixmod
from .buildsys.step import Step
from .detect import detect_platform
from .errors import PrefixError
from .extract import extract
from .runner import run_step, run_supervised, start_supervised, stop_supervised

if (
    TYPE_CHECKING
):  # annotations only: plan imports nothing of verify, and verify needs no plan at run time
    from .plan import Plan
    from .sources import Fetched

REPO_ROOT = Path(__file__).resolve().parent.parent
NO_NIXL = "this recipe builds no NIXL"
POLICY_PROBE = r"""
import json, sys
from kvruntime.nixl.transports import describe, ucx_settings
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

# One process, two NIXL agents: the owner's host buffer READ by the reader, every byte compared.
# ibmock shows its devices to one process only, so this is the verbs path's proof without an HCA.
RDMA_MOVE_PROBE = r"""
import importlib, json, sys, time
import numpy as np
mod, size = sys.argv[1], int(sys.argv[2])
api = importlib.import_module(mod + "._api")
cfg = api.nixl_agent_config(backends=["UCX"])
owner = api.nixl_agent("kvstack-rdma-owner", cfg)
reader = api.nixl_agent("kvstack-rdma-reader", cfg)
src = np.random.default_rng(41).integers(0, 256, size, dtype=np.uint8)
dst = np.zeros(size, dtype=np.uint8)
def descs(agent, arr, reg):
    if reg:
        return agent.get_reg_descs([(arr.ctypes.data, arr.nbytes, 0, "")], "DRAM")
    return agent.get_xfer_descs([(arr.ctypes.data, arr.nbytes, 0)], "DRAM")
owner.register_memory(descs(owner, src, True))
reader.register_memory(descs(reader, dst, True))
name = reader.add_remote_agent(owner.get_agent_metadata())
handle = reader.initialize_xfer("READ", descs(reader, dst, False), descs(owner, src, False), name)
state, deadline = reader.transfer(handle), time.monotonic() + 60
while state not in ("DONE", "ERR") and time.monotonic() < deadline:
    state = reader.check_xfer_state(handle)
# on a line of its own, flushed: UCX writes its protocol tables to the same stdout unbuffered
result = {"state": state, "bit_exact": bool((src == dst).all()), "bytes": size}
print("\nKVSTACK-RESULT " + json.dumps(result), flush=True)
"""
RDMA_MOVE_BYTES = 4 << 20
_RESULT = re.compile(r"KVSTACK-RESULT (\{[^\n]*\})")
# a lane in the Config column of UCX_PROTO_INFO's tables: transport/device (ud_verbs/rdmap0:1,
# cma/memory, tcp/lo)
_LANE = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_.\-]+(?::\d+)?)")
# a table's title row: "ucp_context_1 intra-node cfg#1" (scope self, intra-node or inter-node)
_TABLE_TITLE = re.compile(r"^\S+ (self|intra-node|inter-node) cfg#\d+$")
# memory kinds other than host in a table's operation ("into cuda/dev[0] memory from host")
_DEVICE_MEMORY = re.compile(r"\b(?:into|from|to) (?!host )\S+ memory\b")
NO_HCA = (
    "no RDMA device on this host (`ibv_devices` lists none): UCX's fake device proved the verbs "
    "path in one process; between processes and hosts the RDMA data path is not proven on this host"
)


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
        if not (os.sep in cmd[0] or shutil.which(cmd[0], path=env.get("PATH"))):
            raise FileNotFoundError(f"No such file or directory: {cmd[0]!r}")
        return run_supervised(cmd, env, timeout)
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
    has_ucx, has_nixl = (
        "ucx" in components and "ucx" in spec,
        "nixl" in components and "nixl" in spec,
    )
    ucx_info = build_dir / "ucx" / "bin" / "ucx_info"
    if has_ucx:
        files += [ucx_info, build_dir / "ucx" / "lib" / "libucp.so"]
    if has_nixl:
        files += [build_dir / "nixl" / "lib" / "libnixl.so", build_dir / "nixl" / "lib" / "plugins"]
    for f in files:
        checks.append(
            _check(
                f"file {f.relative_to(build_dir)}",
                f.exists(),
                "present" if f.exists() else "missing",
            )
        )
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
    unresolved, host_rdma = [], set()
    rdma_core = set(wheeldeps.load().rdma_core)  # the host's to provide, never the build's
    for lib in libs:
        r = _run(["ldd", str(lib)], env)
        for line in r.stdout.splitlines():
            if "not found" in line:
                soname = line.split("=>")[0].strip()
                if soname in rdma_core:
                    host_rdma.add(lib.name)
                else:
                    unresolved.append(f"{lib.name}: {line.strip()}")
    if libs:
        checks.append(_check(f"ldd resolves {len(libs) - len(host_rdma)} libraries", not unresolved,
                             "; ".join(unresolved[:5]) or "all resolved"))
    if host_rdma:
        checks.append(
            _not_here(
                f"ldd resolves {', '.join(sorted(host_rdma))}",
                "this host has no rdma-core (libibverbs1, librdmacm1): UCX skips its RDMA "
                "modules here and moves bytes on one host only",
            )
        )
    return _level(checks)


def _ucx_build_info(
    ucx: dict, ucx_info: Path, env: dict[str, str], with_table: dict[str, Any]
) -> list[dict]:
    checks = []
    res = _run([str(ucx_info), "-b"], env)
    info = parse_build_info(res.stdout) if res.returncode == 0 else {}
    if res.returncode:
        checks.append(_check("ucx_info -b", False, (res.stderr or res.stdout)[-300:]))
    defines = list(ucx["defines"])
    if with_table.get("verbs") not in (None, False):
        defines.append("HAVE_IB")  # configure drops verbs silently when headers are missing
    for d in defines:
        checks.append(
            _check(f"define {d}", info.get(d) == "1", f"{d} = {info.get(d, 'undefined')}")
        )
    for d in ucx.get("absent_defines", []):
        checks.append(
            _check(
                f"define {d} absent",
                info.get(d) in (None, "0"),
                f"{d} = {info.get(d, 'undefined')}",
            )
        )
    for var, wanted in ucx["modules"].items():
        have = [m for m in info.get(var, "").split(":") if m]
        for w in wanted:
            checks.append(
                _check(f"{var} has {w}", w in have, f"{var} = {':'.join(have) or '(empty)'}")
            )
    return checks


def loaded(spec: dict, build_dir: Path, env: dict[str, str], python: str, platform: str,
           null_driver: Path | None, has_device: bool, components: list[str],
           ibmock_dir: Path | None = None) -> dict[str, Any]:
    checks = []
    if "ucx" not in components or "ucx" not in spec:
        return _level([], skipped="this recipe builds no UCX")
    denv = dict(env)
    note = None
    lz = spec.get("level_zero")
    if lz and not has_device:
        if null_driver is None:
            return _level([], skipped="no Intel GPU here and no Level Zero null driver was built")
        denv = envfile.apply(
            {"LD_LIBRARY_PATH": str(null_driver), "ZE_ENABLE_NULL_DRIVER": "1"}, env
        )
        note = f"Level Zero null driver from {null_driver}"
    want_transports = list(spec["ucx"]["transports"])
    want_domains = list(spec["ucx"]["memory_domains"])
    if platform == "cuda" and not has_device:
        return _level(
            [], skipped="no NVIDIA GPU on this host: ucx_info -d cannot show cuda transports"
        )
    res = _run([str(build_dir / "ucx" / "bin" / "ucx_info"), "-d"], denv)
    dev = parse_devices(res.stdout)
    if res.returncode:
        checks.append(_check("ucx_info -d", False, (res.stderr or res.stdout)[-300:]))
    # UCX offers cma only where process_vm_writev works (a container without CAP_SYS_PTRACE):
    # whether it was built is the built level's check (uct_MODULES); here it cannot be seen
    no_cma = hostcaps.cross_memory_denied() if "cma" in want_transports + want_domains else None
    gated = spec["ucx"].get("device_gated", {})
    for t, node in gated.items():
        if t not in want_transports:
            want_transports.append(t)
    for t in want_transports:
        if t == "cma" and no_cma and t not in dev["transports"]:
            checks.append(_not_here(f"transport {t}", no_cma))
            continue
        if t in gated and not os.path.exists(gated[t]):
            checks.append(
                _not_here(
                    f"transport {t}",
                    f"{gated[t]} is absent: its kernel module is not loaded "
                    f"on this host, so UCX cannot offer {t}",
                )
            )
            continue
        checks.append(
            _check(
                f"transport {t}",
                t in dev["transports"],
                f"listed: {', '.join(sorted(set(dev['transports'])))}",
            )
        )
    for m in want_domains:
        if m == "cma" and no_cma and m not in dev["memory_domains"]:
            checks.append(_not_here(f"memory domain {m}", no_cma))
            continue
        checks.append(
            _check(
                f"memory domain {m}",
                m in dev["memory_domains"],
                f"listed: {', '.join(dev['memory_domains'])}",
            )
        )
    if lz:
        text = dev["sections"].get("ze_cpy", "")
        marked = [line.strip("# ").strip() for line in text.splitlines() if lz["mark"] in line]
        checks.append(
            _check(
                f"ze_cpy shows {lz['mark']!r}",
                bool(marked),
                (note + "; " if note else "") + (marked[0] if marked else "no such line in ze_cpy"),
            )
        )
    if "policy" in spec and res.returncode == 0:
        checks.append(_policy(spec["policy"], dev["transports"], env, python))
    has_nixl = "nixl" in components and "nixl" in spec
    module = envfile.nixl_module(build_dir, spec["nixl"]["module"]) if has_nixl else None
    if "rdma" in spec:
        checks += _rdma_loaded(spec["rdma"], build_dir, env, python, module, ibmock_dir)
    if not has_nixl:
        return _level(checks)
    if module:
        r = _run([python, "-c", NIXL_PROBE, module], env, timeout=120)
        try:
            probe = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            probe = None
        if probe is None:
            checks.append(
                _check(f"{module} creates a UCX agent", False, (r.stderr or r.stdout)[-400:])
            )
        else:
            for p in spec["nixl"]["plugins"]:
                checks.append(
                    _check(
                        f"NIXL plugin {p}", p in probe["plugins"], f"plugins: {probe['plugins']}"
                    )
                )
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
        return _not_here(
            name, f"kvruntime is neither in this checkout ({REPO_ROOT}) nor importable by {python}"
        )
    r = _run([python, "-c", POLICY_PROBE, want["device"], ",".join(offered)], renv, timeout=60)
    try:
        got = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return _check(name, False, f"exit {r.returncode}: {(r.stderr or r.stdout)[-300:]}")
    tls = got["added"].get("UCX_TLS", "")
    return _check(
        name,
        tls == want["ucx_tls"],
        f"{'UCX_TLS=' + tls if tls else 'UCX_TLS left to UCX'}, "
        f"expected {want['ucx_tls'] or 'left to UCX'}; " + "; ".join(got["why"]),
    )


DEMO = "a prompt prefilled in one process, continued in another (kvruntime demo)"
# whether the target Python has what the demo imports, without importing it (~6 s of CPU)
HAS_DEMO_MODULES = ("import importlib.util as u, sys; "
                    "sys.exit(any(u.find_spec(m) is None for m in ('torch', 'transformers')))")


class Started:
    """A command of the moved level started before the built and loaded levels run, so that it
    runs beside their short commands (an install from a binary cache is mostly this wait); its
    result counts only when they passed (report_levels stops it otherwise)."""

    def __init__(self, cmd: list[str], env: dict[str, str], timeout: int = 600):
        self.cmd, self.timeout = cmd, timeout
        self.started = time.monotonic()
        # under the step supervisor, in a session of its own, as _run's commands
        self.proc = start_supervised(self.cmd, env)

    def result(self) -> subprocess.CompletedProcess:
        try:
            left = self.timeout - (time.monotonic() - self.started)
            out, err = self.proc.communicate(timeout=max(1.0, left))
        except subprocess.TimeoutExpired:
            self.stop()
            timed_out = f"timed out after {self.timeout}s"
            return subprocess.CompletedProcess(self.cmd, 124, "", timed_out)
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, out, err)

    def stop(self) -> None:
        """Its whole session (the selftest and the demo start processes of their own)."""
        if self.proc.poll() is None:
            stop_supervised(self.proc)


class Selftest(Started):
    """The moved level's `kvruntime selftest`."""

    # every memory kind and engine this host offers, over this build; the mixed-TP pairs test
    # kvruntime's head arithmetic, not the stack (`python -m kvruntime selftest` runs them)
    ARGS = ("-m", "kvruntime", "selftest", "--json", "--tp-pairs", "none")

    def __init__(self, env: dict[str, str], python: str, timeout: int = 600):
        super().__init__([python, *self.ARGS], env, timeout)


class Demo(Started):
    """The moved level's `kvruntime demo`: one pair of TP 1 processes (and the reference's) runs
    every engine, layout and operation of this host's memory ``device``."""

    ARGS = ("-m", "kvruntime", "demo", "--json", "--compact", "--tp", "1x1", "--device")

    def __init__(self, env: dict[str, str], python: str, device: str, timeout: int = 600):
        super().__init__([python, *self.ARGS, device], env, timeout)
        self.device = device

    @classmethod
    def start(cls, env: dict[str, str], python: str, device: str,
              timeout: int = 600) -> "Demo | dict[str, Any]":
        """The demo started; where the target Python has no torch or transformers, the check
        saying it is not checked here, with what to install."""
        if _run([python, "-c", HAS_DEMO_MODULES], env, timeout=60).returncode != 0:
            return _not_here(DEMO, f"torch and transformers are not importable by {python} (pip "
                                   f"install torch 'kvstack[demo]' there to run it)")
        return cls(env, python, device, timeout)


def _demo_device(platform: str, selftest: dict | None) -> str:
    """Device memory where the self-test moved it (cuda), else host memory; before the self-test
    has run (None), host memory for every platform but cuda, whose demo waits for it."""
    if platform != "cuda":
        return "cpu"
    return "cuda" if any(
        m.get("status") == "passed" and str(m.get("mode", "")).startswith("cuda/")
        for m in (selftest or {}).get("modes", [])) else "cpu"


def _demo(env: dict[str, str], python: str, platform: str, selftest: dict,
          timeout: int, started: "Demo | dict[str, Any] | None" = None) -> dict[str, Any]:
    """The richest check, where the target Python has torch and transformers (else not checked,
    with what to install): a small Llama's KV through this build from a prefill process to a
    decode process on every engine, both layouts, pull and push, the decode's tokens and logits
    identical to one process's. Device memory where the self-test moved it, else host memory.
    ``started``: the demo started beside the earlier levels (else it starts now)."""
    demo = started or Demo.start(env, python, _demo_device(platform, selftest), timeout)
    if isinstance(demo, dict):
        return demo
    r = demo.result()
    seconds = round(time.monotonic() - demo.started, 2)
    try:
        report = json.loads(r.stdout)
    except ValueError:
        return _check(DEMO, False, f"exit {r.returncode}: {(r.stderr or r.stdout)[-400:]}")
    cases = report.get("cases", [])
    good = [c for c in cases if c.get("ok")]
    bad = [f"{c.get('layout')}/{c.get('engine')}/{c.get('op')}: "
           f"{c.get('error') or 'tokens or logits differ'}"
           for c in cases if not c.get("ok") and "skipped" not in c]

    def median_ms(phase: str) -> float:
        xs = sorted(c["seconds"][phase] for c in good)
        return xs[len(xs) // 2] * 1e3 if xs else float("nan")

    tokens = len((report.get("reference") or {}).get("tokens", []))
    detail = (f"{len(good)} of {len(cases)} cases on {demo.device} memory continued the prompt "
              f"with one process's {tokens} tokens, logits bit-identical; median transfer "
              f"{median_ms('transfer'):.1f} ms, decode {median_ms('decode'):.1f} ms"
              + (f"; failed: {'; '.join(bad)[:400]}" if bad else "")
              + (f"; {report['error']}" if report.get("error") else ""))
    return {**_check(DEMO, r.returncode == 0 and report.get("ok") is True and bool(good), detail),
            "seconds": seconds}


def moved(build_dir: Path, env: dict[str, str], python: str, platform: str, components: list[str],
          timeout: int = 600, rdma: dict | None = None, nixl_module: str | None = None,
          ibmock_dir: Path | None = None, selftest: Selftest | None = None,
          demo: "Demo | dict[str, Any] | None" = None) -> dict[str, Any]:
    """Host memory always moves (no device needed); the platform's device memory where this host
    has the device, else those modes are shown as not checked here. `selftest`, `demo`: the ones
    started beside the earlier levels (else they run now)."""
    if "nixl" not in components:
        return _level([], skipped=NO_NIXL)
    renv = _kvruntime_env(env, python)
    if renv is None:
        return _level(
            [],
            skipped=f"kvruntime is neither in this checkout ({REPO_ROOT}) nor importable by "
            f"{python}",
        )
    selftest = selftest or Selftest(renv, python, timeout)
    # the RDMA move (one process, ~1 s) while the self-test and the demo run: their checks first
    rdma_checks = []
    if rdma is not None:
        module = envfile.nixl_module(build_dir, nixl_module) if nixl_module else None
        rdma_checks += _rdma_moved(rdma, env, python, module, ibmock_dir)
        if platform in ("cuda", "xpu"):  # device memory registered by the NIC: no mock can show it
            rdma_checks.append(
                _not_here(
                    f"GPUDirect RDMA ({platform} memory registered by the IB domain)",
                    "it needs a real RDMA device beside the GPU (and nvidia-peermem or "
                    "DMA-BUF; for xpu the xe driver): not proven on this host",
                )
            )
    r = selftest.result()
    try:
        result = json.loads(r.stdout)
    except ValueError:
        return _level(
            [
                _check(
                    "kvruntime selftest",
                    False,
                    f"exit {r.returncode}: {(r.stderr or r.stdout)[-400:]}",
                )
            ]
        )
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
                checks.append(
                    _not_here(f"moved {name}", mode.get("reason") or "no such device here")
                )
            continue
        checks.append(
            _check(
                f"moved {name}",
                status == "passed" and mode.get("digest_ok") is True,
                f"{mode.get('bytes', '?')} bytes in {mode.get('descriptors', '?')} descriptors, "
                f"{mode.get('gbps')} GB/s, {mode.get('digests_checked', 0)} block digests checked"
                + (f"; {mode['error']}" if mode.get("error") else ""),
            )
        )
    if not any(c["ok"] is not None for c in checks[1:]):
        return _level(
            checks,
            skipped="selftest ran no mode on this host: "
            f"{result.get('reason', 'no mode available')}",
        )
    checks.append(_demo(renv, python, platform, result, timeout, demo))
    level = _level(checks + rdma_checks)
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
    ibmock_dir = None
    if "rdma" in plan.verify and "ucx" in [c.name for c in plan.components]:
        ibmock_dir = _ibmock(plan, fetched, build_env, log_dir)
    return report_levels(
        plan.verify,
        plan.platform,
        plan.install_dir,
        env,
        plan.target.python,
        with_table,
        null_driver,
        has_device,
        [c.name for c in plan.components],
        ibmock_dir,
    )


def report_levels(
    spec,
    platform,
    build_dir,
    env,
    python,
    with_table,
    null_driver,
    has_device,
    components,
    ibmock_dir=None,
):
    started = time.monotonic()
    renv = _kvruntime_env(env, python) if "nixl" in components else None
    selftest = Selftest(renv, python) if renv is not None else None
    # beside it the demo, on host memory (cuda's waits for the self-test: device memory where
    # that moved); both run while the built and loaded levels' short commands do
    demo = (Demo.start(renv, python, "cpu") if renv is not None and platform != "cuda"
            else None)
    seconds: dict[str, float] = {}

    def timed(name: str, level: dict[str, Any]) -> dict[str, Any]:  # from the previous level's end
        seconds[name] = round(time.monotonic() - started - sum(seconds.values()), 2)
        return level

    try:
        levels = {"built": timed("built", built(spec, build_dir, env, with_table, components))}
        levels["loaded"] = timed("loaded", loaded(spec, build_dir, env, python, platform,
                                                  null_driver, has_device, components, ibmock_dir))
        if levels["built"]["status"] == "failed" or levels["loaded"]["status"] == "failed":
            levels["moved"] = {"status": "skipped", "reason": "an earlier level failed",
                               "checks": []}
        else:
            levels["moved"] = timed("moved", moved(
                build_dir, env, python, platform, components, rdma=spec.get("rdma"),
                ibmock_dir=ibmock_dir, selftest=selftest, demo=demo,
                nixl_module=spec.get("nixl", {}).get("module")))
    finally:
        for started in (selftest, demo):
            if isinstance(started, Started):
                started.stop()
    # each level's wait after the one before (the moved level's processes start with the first)
    return {"ok": passes(levels), "levels": levels, "has_device": has_device, "seconds": seconds}


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
    steps = [
        Step(
            "configure",
            "ze-null-configure",
            (
                "cmake",
                "-S",
                str(src),
                "-B",
                str(build),
                "-G",
                "Ninja",
                "-DCMAKE_BUILD_TYPE=Release",
            ),
        ),
        Step(
            "build",
            "ze-null-build",
            ("cmake", "--build", str(build), "--target", lz["cmake_target"], "-j", str(plan.jobs)),
        ),
    ]
    for s in steps:
        run_step(s, component="level-zero", env=build_env, log_dir=log_dir, actions={})
    dest.mkdir(parents=True, exist_ok=True)
    for lib in build.rglob("libze_null.so*"):
        shutil.copy2(lib, dest / lib.name, follow_symlinks=False)
    return dest


def _ibmock(plan: "Plan", fetched, build_env, log_dir: Path) -> Path | None:
    """UCX's fake RDMA device built from this build's UCX source (ibmock.py), kept in the build
    so a later `installer verify` finds it; None where it cannot be built (the reason is the
    loaded level's)."""
    dest = plan.install_dir / "verify" / "ibmock"
    if all((dest / lib).exists() for lib in ibmock.LIBS):
        return dest
    if not fetched or build_env is None:
        return None
    ucx = next(c for c in plan.components if c.name == "ucx")
    src = ucx.src_dir
    if not (src / ibmock.SOURCE_DIR).is_dir():  # the source tree is removed once a build is done
        src = plan.work_dir / "src" / "ucx-ibmock"
        extract(fetched[ucx.source], src)
    try:
        return ibmock.build(src, dest, build_env, log_dir, plan.work_dir / "build")
    except ibmock.Unavailable:
        return None


def _rdma_loaded(rdma: dict, build_dir: Path, env: dict[str, str], python: str, module: str | None,
                 ibmock_dir: Path | None) -> list[dict]:
    """The build's RDMA transports on this host's devices, or on UCX's fake one where there are
    none; NIXL's UCX backend comes up on them."""
    ucx_info = str(build_dir / "ucx" / "bin" / "ucx_info")
    real = ibmock.real_devices()
    if real:
        dev = parse_devices(_run([ucx_info, "-d"], env).stdout)
        return [_check(f"RDMA device {d} in ucx_info -d", d in dev["memory_domains"],
                       f"memory domains: {', '.join(dev['memory_domains'])}") for d in real]
    name = "RDMA under UCX's fake device (contrib/ibmock)"
    if ibmock_dir is None:
        return [
            _not_here(
                name, "ibmock was not built (no UCX source at hand; it is built during an install)"
            )
        ]
    menv = ibmock.environment(ibmock_dir, env)
    checks = []
    try:
        with ibmock.device_nodes():
            res = _run([ucx_info, "-d"], menv)
            dev = parse_devices(res.stdout)
            if res.returncode:
                checks.append(
                    _check("ucx_info -d under ibmock", False, (res.stderr or res.stdout)[-300:])
                )
            for m in rdma["memory_domains"]:
                checks.append(_check(f"ibmock memory domain {m}", m in dev["memory_domains"],
                                     f"listed: {', '.join(dev['memory_domains'])}"))
            section = "".join(dev["sections"].get(m, "") for m in rdma["memory_domains"])
            listed = re.findall(r"Transport:\s*(\S+)", section)
            for t in rdma["transports"]:
                checks.append(
                    _check(
                        f"ibmock transport {t}",
                        t in listed,
                        f"on {', '.join(rdma['memory_domains'])}: {', '.join(listed) or 'none'}",
                    )
                )
            if module:
                r = _run([python, "-c", NIXL_PROBE, module], _rdma_env(rdma, menv), timeout=120)
                ok = r.returncode == 0 and '"UCX"' in r.stdout
                checks.append(
                    _check(
                        f"NIXL's UCX backend on {rdma['net_device']} alone "
                        f"(UCX_TLS={rdma['moved_tls']})",
                        ok,
                        "created"
                        if ok
                        else f"exit {r.returncode}: {(r.stderr or r.stdout)[-300:]}",
                    )
                )
    except ibmock.Unavailable as e:
        return [_not_here(name, str(e))]
    return checks


def _rdma_env(rdma: dict, env: dict[str, str]) -> dict[str, str]:
    """UCX held to the RDMA device's transports: with any other transport left, a READ that
    UCX could not place on the device would quietly take tcp or shared memory instead."""
    return {
        **env,
        "UCX_TLS": rdma["moved_tls"],
        "UCX_NET_DEVICES": rdma["net_device"],
        "UCX_PROTO_INFO": "y",
        "UCX_LOG_FILE": "",
    }


def proto_lanes(text: str, between_peers: bool = False) -> list[str]:
    """Every transport/device in the Config column (the last cell) of UCX_PROTO_INFO's table rows.
    With ``between_peers``, only of tables between two endpoints (not a context's endpoint to
    itself, scope "self": a CUDA build's NIXL agent puts host-to-host copies on cuda_copy there,
    seen on an H200) whose operation names no memory but host memory."""
    lanes, scope, operation = set(), "", ""
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        title = _TABLE_TITLE.match(cells[0]) if len(cells) == 1 else None
        if title:
            scope = title.group(1)
        elif len(cells) == 1 and " memory" in cells[0]:  # a table's operation row
            operation = cells[0]
        elif len(cells) >= 3 and ".." in cells[0]:  # a row: range | description | config
            if between_peers and (scope == "self" or _DEVICE_MEMORY.search(operation)):
                continue
            lanes.update(f"{t}/{d}" for t, d in _LANE.findall(cells[-1]))
    return sorted(lanes)


def _rdma_moved(rdma: dict, env: dict[str, str], python: str, module: str | None,
                ibmock_dir: Path | None) -> list[dict]:
    """KV bytes through the verbs code path: bit-exact, and the lanes UCX read back are the RDMA
    device's. Never counted for a data path between hosts, which needs a real HCA."""
    real = ibmock.real_devices()
    if real:
        device = f"{real[0]}:1"
        menv, name = (
            {**env, "UCX_TLS": "ib", "UCX_NET_DEVICES": device, "UCX_PROTO_INFO": "y"},
            device,
        )
        rest = _not_here(
            "RDMA between hosts",
            f"one process here, through {real[0]}; a second host proves the wire",
        )
    elif ibmock_dir is None:
        return [_not_here("RDMA data path", NO_HCA)]
    else:
        menv, name = _rdma_env(rdma, ibmock.environment(ibmock_dir, env)), rdma["net_device"]
        rest = _not_here("RDMA data path between processes and hosts", NO_HCA)
    if module is None:
        return [_check("RDMA move", False, "no NIXL module in this build"), rest]
    title = f"moved {RDMA_MOVE_BYTES >> 20} MiB READ over {name} (one process, two NIXL agents)"
    try:
        with contextlib.nullcontext() if real else ibmock.device_nodes():
            r = _run(
                [python, "-c", RDMA_MOVE_PROBE, module, str(RDMA_MOVE_BYTES)], menv, timeout=180
            )
    except ibmock.Unavailable as e:
        return [_not_here(title, str(e)), rest]
    found = _RESULT.search(r.stdout)
    result = json.loads(found.group(1)) if found else None
    if result is None:
        return [_check(title, False, f"exit {r.returncode}: {(r.stderr or r.stdout)[-400:]}"), rest]
    lanes = proto_lanes(r.stdout + r.stderr, between_peers=True)
    device = name.split(":")[0]
    off = [lane for lane in lanes if lane.split("/")[1].split(":")[0] != device]
    on = [lane for lane in lanes if lane not in off]
    return [
        _check(
            title,
            result["state"] == "DONE" and result["bit_exact"],
            f"state {result['state']}, {'bit-exact' if result['bit_exact'] else 'BYTES DIFFER'}",
        ),
        _check(
            f"the lanes UCX read back are {device}'s",
            bool(on) and not off,
            f"on {device}: {', '.join(on) or 'none'}"
            + (f"; elsewhere: {', '.join(off)}" if off else ""),
        ),
        rest,
    ]


def verify_prefix(prefix: Path) -> dict[str, Any]:
    """`installer verify`: re-run the levels on an installed build, from its manifest."""
    build_dir = prefixmod.current(prefix)
    if build_dir is None or not prefixmod.is_complete(build_dir):
        raise PrefixError(
            f"{prefix} holds no finished kvstack build", fix="install first: python -m installer"
        )
    manifest = json.loads((build_dir / prefixmod.COMPLETE).read_text())
    recipe = manifest["recipe"]
    platform = manifest["platform"]
    env = envfile.apply(manifest["env"], dict(os.environ))
    has_device = detect_platform()[0] == platform
    nd, mock = build_dir / "verify" / "ze_null", build_dir / "verify" / "ibmock"
    report = report_levels(recipe["verify"], platform, build_dir, env, manifest["python"]["path"],
                           recipe["components"].get("ucx", {}).get("with", {}),
                           nd if nd.exists() else None, has_device, list(recipe["components"]),
                           mock if mock.exists() else None)
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
    not_run = [
        f"{name} ({v.get('reason', 'not run')})"
        for name, v in levels.items()
        if v["status"] != "passed"
    ]
    unchecked = [c for v in levels.values() for c in v["checks"] if c["ok"] is None]
    # checks a level could not make here (the platform's device memory, cma in a container)
    tail = (f"; {len(unchecked)} checks not made here, e.g. {unchecked[0]['check']} "
            f"({unchecked[0]['detail'].removeprefix('not checked here: ')})" if unchecked else "")
    if not not_run:
        return "verification passed" + tail
    passed = [name for name, v in levels.items() if v["status"] == "passed"]
    return (
        f"verification passed for {', '.join(passed)} only; not run here: {'; '.join(not_run)}"
        + tail
    )
