"""NIXL's own Python tests and examples, from the pinned source archive a build was made from,
run against that build through `import nixl` (kvstack's package, installer/nixlpackage.py), host
memory only. Nothing of NIXL's is kept in this repository: the archive named by the build's
manifest (the installer's cache, else the mirror), checked against the manifest's sha256, is
the only source of the files, extracted into a temporary directory.

    python ci/nixl_suite.py PREFIX [--name NAME] [--mirror DIR] [--timeout SECONDS]

Prints one line per test or example that did not pass (a skip with what it needs: the plugin
or device, or NIXL's own reason) and `nixl suite NAME: P passed, S skipped, F failed`; exits 1
when anything failed or nothing ran. Run from the repository root (it imports the installer)."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from installer import envfile, nixlpackage  # noqa: E402
from installer.cache import sha256_file  # noqa: E402

PARTS = ("test/python/", "examples/python/")
OK_LINE = "Test Complete."
# every example of NIXL v1.4.0's examples/python, with what it needs beyond host memory and UCX;
# one this table does not know fails the suite, so a new pin's examples are looked at
TWO_PEERS = {"basic_two_peers.py": {"initiator": ["Data verification passed"]},
             "expanded_two_peers.py": {"target": ["Target data verification passed"],
                                       "initiator": ["Initiator final data verification passed"]}}
ONE_PROCESS = {"partial_md_example.py": [], "query_mem_example.py": ["plugin POSIX"]}
NOT_RUN = {"nixl_gds_example.py": "needs NIXL plugin GDS and a GPU with GPUDirect Storage",
           "telemetry_reader.py": "a reader of another agent's telemetry "
                                  "(NIXL_TELEMETRY_ENABLE), not an example that runs alone",
           "remote_storage_example": "needs NIXL storage plugins (POSIX, GDS_MT) and files"}
PLUGIN_PROBE = ("import json, nixl, nixl._api as a\nag = a.nixl_agent('suite-probe', "
                "a.nixl_agent_config(backends=[]))\nprint('PROBE ' + json.dumps({'plugins': "
                "sorted(ag.get_plugin_list()), 'nixl': nixl.__file__, 'backend': "
                "nixl.__kvstack__['backend_file'], 'unused': nixl.__kvstack__['unused']}))")


def archive(manifest: dict, mirror: Path | None) -> Path:
    """The NIXL archive the build was made from, proven by the manifest's sha256."""
    source = manifest["recipe"]["components"]["nixl"]["source"]
    pin, got = manifest["recipe"]["sources"][source], manifest["sources"][source]
    want = str(got.get("sha256") or "")
    candidates = [Path(str(got.get("path", "")))]
    if mirror:
        candidates.append(mirror / str(pin.get("filename", "")))
    for c in candidates:
        if re.fullmatch(r"[0-9a-f]{64}", want) and c.is_file() and sha256_file(c) == want:
            return c
    raise SystemExit(f"error: no archive with sha256 {want or '?'} (the build's NIXL source) at "
                     f"{', '.join(map(str, candidates))}: give --mirror the build's mirror")


def extract(tar_path: Path, into: Path) -> Path:
    """Only NIXL's test/python and examples/python, regular files, nothing outside `into`."""
    with tarfile.open(tar_path) as tf:
        for m in tf.getmembers():
            top, _, rest = m.name.partition("/")
            if not m.isfile() or not rest.startswith(PARTS) or ".." in Path(rest).parts:
                continue
            dest = into / rest
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(tf.extractfile(m).read())
    if not (into / "test/python").is_dir():
        raise SystemExit(f"error: {tar_path} holds no test/python: not NIXL's source")
    return into


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_skip_reason(source: Path, line: int) -> str:
    """The comment above a test NIXL's source marks skip: its reason, which names what it needs."""
    lines = source.read_text(errors="replace").splitlines()[:line - 1]
    said = []
    for text in reversed(lines):
        if text.startswith("#"):
            said.insert(0, text.lstrip("# "))
        elif not text.startswith("@"):
            break
    return "NIXL's source skips it: " + (" ".join(said) or "no reason given")


def run_tests(py: str, env: dict, root: Path, timeout: int) -> list[tuple[str, str, str]]:
    report = root / "junit.xml"
    tests = sorted(str(p) for p in (root / "test/python").glob("test_*.py"))
    r = subprocess.run([py, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                        f"--junitxml={report}", *tests], cwd=root / "test/python", env=env,
                       capture_output=True, text=True, timeout=timeout)
    if not report.is_file():
        return [("test/python", "failed", (r.stdout + r.stderr)[-800:])]
    out = []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('file') or case.get('classname')}::{case.get('name')}"
        skip = case.find("skipped")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            out.append((name, "failed", (bad.get("message") or "")[:300]))
        elif skip is not None:
            why = skip.get("message") or ""
            if why == "unconditional skip":
                mod = root / "test/python" / (case.get("classname") or "").replace(".", "/")
                found = re.search(rf"^def {re.escape(case.get('name').split('[')[0])}\(",
                                  mod.with_suffix(".py").read_text(), re.M)
                at = mod.with_suffix(".py").read_text()[:found.start()].count("\n") if found else 0
                why = own_skip_reason(mod.with_suffix(".py"), at)
            out.append((name, "skipped", why))
        else:
            out.append((name, "passed", ""))
    if r.returncode not in (0, 1) and not any(s == "failed" for _, s, _ in out):
        out.append(("test/python", "failed", f"pytest exited {r.returncode}: {r.stderr[-300:]}"))
    return out


def _verdict(procs: dict, marks: dict) -> str:
    """'' when every process ended 0, said OK_LINE and its marks, and logged no ERROR."""
    for role, (rc, text) in procs.items():
        if rc != 0:
            return f"{role} exited {rc}: {text.strip()[-300:]}"
        missing = [m for m in [OK_LINE, *marks.get(role, [])] if m not in text]
        errors = [ln for ln in text.splitlines() if re.search(r"\bERROR\b", ln)]
        if missing or errors:
            return f"{role}: {'missing ' + repr(missing) if missing else errors[0][-300:]}"
    return ""


def run_examples(py: str, env: dict, root: Path, plugins: list[str], timeout: int, work: Path):
    ex, out = root / "examples/python", []
    for name in sorted(p.name for p in ex.iterdir() if p.name != "README.md"):
        cwd = Path(tempfile.mkdtemp(prefix=name.replace(".", "-") + "-", dir=work))
        if name in NOT_RUN:
            out.append((f"examples/{name}", "skipped", NOT_RUN[name]))
        elif name in TWO_PEERS:
            port = free_port()
            args = ["--ip", "127.0.0.1", "--port", str(port)]
            target = subprocess.Popen([py, str(ex / name), "--mode", "target", *args], cwd=cwd,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
            time.sleep(1.0)  # the target listens before the initiator asks for its metadata
            try:
                ini = subprocess.run([py, str(ex / name), "--mode", "initiator", *args], cwd=cwd,
                                     env=env, capture_output=True, text=True, timeout=timeout)
                t_out, _ = target.communicate(timeout=timeout)
                procs = {"target": (target.returncode, t_out),
                         "initiator": (ini.returncode, ini.stdout + ini.stderr)}
                said = _verdict(procs, TWO_PEERS[name])
            except subprocess.TimeoutExpired:
                said = f"timed out after {timeout}s"
            finally:
                target.kill()
                target.wait()
            out.append((f"examples/{name}", "failed" if said else "passed", said))
        elif name in ONE_PROCESS:
            needs = [n.split()[1] for n in ONE_PROCESS[name] if n.startswith("plugin ")]
            lacking = [p for p in needs if p not in plugins]
            if lacking:
                has = ", ".join(plugins) or "none"
                out.append((f"examples/{name}", "skipped",
                            f"needs NIXL plugin {', '.join(lacking)} (this build has {has})"))
                continue
            args, penv = [], env
            if name == "partial_md_example.py":
                args = ["--init-port", str(free_port()), "--target-port", str(free_port())]
                # without --etcd it deletes NIXL_ETCD_ENDPOINTS unguarded (KeyError when unset)
                penv = {**env, "NIXL_ETCD_ENDPOINTS": ""}
            try:
                r = subprocess.run([py, str(ex / name), *args], cwd=cwd, env=penv,
                                   capture_output=True, text=True, timeout=timeout)
                said = _verdict({"process": (r.returncode, r.stdout + r.stderr)}, {})
            except subprocess.TimeoutExpired:
                said = f"timed out after {timeout}s"
            out.append((f"examples/{name}", "failed" if said else "passed", said))
        else:
            out.append((f"examples/{name}", "failed", "not known to ci/nixl_suite.py: say what it "
                        "needs (TWO_PEERS, ONE_PROCESS or NOT_RUN)"))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ci/nixl_suite.py", allow_abbrev=False)
    p.add_argument("prefix", type=Path)
    p.add_argument("--name", default=None, help="the build's name in the summary (its platform)")
    p.add_argument("--mirror", type=Path, default=None, help="where else the archive may be")
    p.add_argument("--timeout", type=int, default=120, help="seconds for each step")
    a = p.parse_args(argv)
    build = a.prefix.resolve()
    try:
        manifest = json.loads((build / "manifest.json").read_text())
        manifest["recipe"]["verify"]["nixl"]["module"], manifest["env"], manifest["python"]["path"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: {a.prefix}: no kvstack manifest with a NIXL build ({e!r})")
    if manifest.get("complete") is not True:
        raise SystemExit(f"error: {a.prefix} is not a finished kvstack install")
    name = a.name or manifest["platform"]
    backend = envfile.nixl_module(build, manifest["recipe"]["verify"]["nixl"]["module"])
    if backend is None:
        raise SystemExit(f"error: {a.prefix} has no NIXL Python module")
    py = str(manifest["python"]["path"])  # the Python the build's module was compiled for
    py = py if os.path.exists(py) else sys.executable
    work = Path(tempfile.mkdtemp(prefix=f"nixl-suite-{name}-"))
    root = extract(archive(manifest, a.mirror), work / "nixl")
    site = nixlpackage.site_for(build, backend, manifest["platform"], manifest["build_id"],
                                work / "site")
    env = envfile.apply(manifest["env"], {k: v for k, v in os.environ.items()
                                          if not k.startswith(("UCX_", "NIXL_"))})
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # another NIXL installed beside (CI's venv has PyPI's nixl-cu12): named once below, not in
    # every process's output
    env["PYTHONWARNINGS"] = "ignore:`import nixl` is kvstack's:RuntimeWarning"
    r = subprocess.run([py, "-c", PLUGIN_PROBE], env=env, capture_output=True, text=True,
                       timeout=a.timeout)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")), None)
    if line is None:
        raise SystemExit(f"error: `import nixl` from {site} failed: {r.stderr.strip()[-600:]}")
    probe = json.loads(line[6:])
    print(f"nixl suite {name}: NIXL's tests and examples from {root}; `import nixl` is "
          f"{probe['nixl']} -> {probe['backend']}; plugins {', '.join(probe['plugins'])}")
    if probe["unused"]:
        print(f"  (also installed there, not used: {probe['unused']})")  # the shim's warning
    results = run_tests(py, env, root, a.timeout)
    results += run_examples(py, env, root, probe["plugins"], a.timeout, work)
    for what, state, why in results:
        if state != "passed":
            print(f"  {state}: {what}: {why}")
    counts = {s: sum(1 for _, st, _ in results if st == s) for s in ("passed", "skipped", "failed")}
    print(f"nixl suite {name}: {counts['passed']} passed, {counts['skipped']} skipped, "
          f"{counts['failed']} failed")
    if counts["failed"] or not counts["passed"]:
        print(f"nixl suite {name}: NIXL's files and the examples' directories kept in {work}")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
