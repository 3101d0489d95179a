"""A NIXL wheel with a private libibverbs but no libefa (PyPI's nixl-cu12 1.5.1) on a host with
rdma-core: UCX's efa module would bring the host's libibverbs in beside the private one, and the
process would die with SIGSEGV when its agent is destroyed (seen on this CI host once
libibverbs-dev was installed for the RDMA builds). kvruntime keeps that module unloaded."""
from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvruntime.nixl.binding import NixlBinding

ROOT = Path(__file__).resolve().parents[3]


def _wheel(tmp_path, *, libefa=False, efa_module=True):
    pkg = tmp_path / "nixl_fake"
    (tmp_path / "nixl_fake.libs" / "ucx").mkdir(parents=True)
    pkg.mkdir()
    (pkg / "_api.py").write_text("")
    (tmp_path / "nixl_fake.libs" / "libibverbs-1de1263b.so.1.14.48.0").write_bytes(b"")
    if libefa:
        (tmp_path / "nixl_fake.libs" / "libefa-0a1b2c3d.so.1").write_bytes(b"")
    if efa_module:
        (tmp_path / "nixl_fake.libs" / "ucx" / "libuct_ib_efa.so.0.0.0").write_bytes(b"")
    return NixlBinding("nixl_fake", types.SimpleNamespace(__file__=str(pkg / "_api.py")))


def test_a_private_libibverbs_without_libefa_keeps_efa_unloaded_where_the_host_has_libefa(
        tmp_path, monkeypatch):
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libefa.so.1")
    why = _wheel(tmp_path).efa_clash()
    assert why and "nixl_fake's wheel bundles its own libibverbs but not libefa" in why


@pytest.mark.parametrize("kw", [{"libefa": True}, {"efa_module": False}])
def test_a_wheel_that_brings_libefa_or_has_no_efa_module_is_left_alone(tmp_path, monkeypatch, kw):
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libefa.so.1")
    assert _wheel(tmp_path, **kw).efa_clash() is None


def test_a_host_without_libefa_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert _wheel(tmp_path).efa_clash() is None


def test_an_agent_of_pypis_nixl_ends_cleanly_on_a_host_with_rdma_core():
    """The real thing, in a process of its own: without UCX_MODULES=^efa it exits with SIGSEGV
    here (-11) once the host has libefa."""
    pytest.importorskip("nixl_cu12")
    if ctypes.util.find_library("efa") is None:
        pytest.skip("this host has no libefa: the clash cannot happen")
    code = ("from kvruntime.nixl.agent import Agent\n"
            "from kvruntime.nixl.binding import load_nixl\n"
            "a = Agent('clash-check', load_nixl('nixl_cu12'))\n"
            "print(a.ucx_env.get('UCX_MODULES'))\n"
            "a.close()\n"
            "del a\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.strip().splitlines()[-1] == "^efa"
