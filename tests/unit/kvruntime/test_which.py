"""`python -m kvruntime which` without a build: what it reads from a process's mapped files
(a build's libucp.so.0, a wheel's libucp-<hash>.so.0, two of them), and a `nixl` that brings no
UCX up is reported unusable, in a fresh interpreter so this process's imports stay its own."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvruntime.tools.which import render, ucx_of

ROOT = Path(__file__).resolve().parents[3]


def test_a_builds_and_a_wheels_libucp_and_the_modules_are_found():
    files = ["/b/ucx/lib/libucp.so.0.0.0", "/b/ucx/lib/ucx/libuct_cma.so.0.0.0",
             "/s/nixl.libs/libucp-1a2b3c4d.so.0", "/s/nixl.libs/ucx/libuct_ib.so.0",
             "/b/ucx/lib/libucs.so.0", "/usr/lib/libucpx.so"]
    got = ucx_of(files)
    assert got == {"ucp": ["/b/ucx/lib/libucp.so.0.0.0", "/s/nixl.libs/libucp-1a2b3c4d.so.0"],
                   "modules": ["cma", "ib"]}
    lines = render({"module": "nixl", "file": "/x/nixl/__init__.py", "api": "/x/_api.py",
                    "kvstack": None, **got, "ucx_info": None, "transports": []})
    assert lines[1].startswith("UCX: 2 libucp loaded (") and "two UCXs in one process" in lines[1]


def test_a_nixl_that_loads_no_ucx_is_unusable(tmp_path):
    pkg = tmp_path / "nixl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_api.py").write_text("class nixl_agent_config:\n    def __init__(self, **kw):\n"
                                 "        pass\nclass nixl_agent:\n    def __init__(self, *a):\n"
                                 "        pass\n")
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "kvruntime", "which", "--json"], env=env,
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 3, r.stderr
    info = json.loads(r.stdout)
    assert info["file"] == str(pkg / "__init__.py") and info["ucp"] == [], info


def test_a_nixl_that_does_not_import_is_one_line(tmp_path):
    (tmp_path / "nixl").mkdir()
    (tmp_path / "nixl" / "__init__.py").write_text("raise ImportError('kvstack says why')\n")
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "kvruntime", "which"], env=env,
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 3
    assert r.stderr == "nixl: does not load here: ImportError: kvstack says why\n"
