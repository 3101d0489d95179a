"""The pinned stacks CI builds from the offline mirror (ci/pinned-builds.sh, which exports
KVSTACK_PINNED_PREFIX_CPU, _XPU and _XPU_IPC): cpu, xpu at the release pin (UCX v1.22.0) and xpu's
ze-ipc variant (UCX at the head of upstream pull request 11218). No Intel GPU here: their UCX is
asked through the Level Zero null driver each xpu build keeps (`<build>/verify/ze_null`), and every
check below runs the real `ucx_info` of those builds — verification's levels and kvruntime's
transport policy on what that UCX lists, both ways round (the ze-ipc choice on the release UCX
must fail, naming what it found). Without those prefixes (outside CI: run ci/pinned-builds.sh and
source _work/pinned/env.sh) the tests skip, saying so."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from installer import envfile, recipe, verify
from kvruntime.nixl import transports

pytestmark = [pytest.mark.integration, pytest.mark.build]
PR_HEAD = "b8d6012325b5fe026a94be537009f486ed2b9d40"
RELEASE_TRANSPORTS = ["cma", "posix", "self", "sysv", "tcp", "ze_copy"]


def _build(name):
    var = f"KVSTACK_PINNED_PREFIX_{name}"
    prefix = os.environ.get(var)
    if not prefix or not (Path(prefix) / "manifest.json").is_file():
        pytest.skip(
            f"{var} names no pinned build (CI's ci/pinned-builds.sh makes them; then . "
            "_work/pinned/env.sh)"
        )
    build_dir = Path(prefix).resolve()
    manifest = json.loads((build_dir / "manifest.json").read_text())
    return {
        "dir": build_dir,
        "manifest": manifest,
        "env": envfile.apply(manifest["env"], dict(os.environ)),
        "null_driver": build_dir / "verify" / "ze_null",
    }


@pytest.fixture(scope="module")
def cpu():
    return _build("CPU")


@pytest.fixture(scope="module")
def xpu():
    return _build("XPU")


@pytest.fixture(scope="module")
def ipc():
    return _build("XPU_IPC")


def _loaded(spec, build):
    """The loaded level of `spec` on `build`'s own UCX, as a host without an Intel GPU runs it."""
    return verify.loaded(
        spec,
        build["dir"],
        build["env"],
        sys.executable,
        "xpu",
        build["null_driver"],
        False,
        ["ucx", "nixl"],
    )


def _offered(build, monkeypatch):
    """What kvruntime reads at run time: `ucx_info -d` on PATH, here under the null driver."""
    env = envfile.apply(
        {"LD_LIBRARY_PATH": str(build["null_driver"]), "ZE_ENABLE_NULL_DRIVER": "1"}, build["env"]
    )
    for k in ("PATH", "LD_LIBRARY_PATH", "ZE_ENABLE_NULL_DRIVER"):
        monkeypatch.setenv(k, env[k])
    return transports.offered_transports()


def _failed(level):
    return {c["check"]: c["detail"] for c in level["checks"] if c["ok"] is False}


def test_the_ze_ipc_build_says_its_ucx_is_an_unreleased_pull_request(ipc):
    m = ipc["manifest"]
    assert m["platform"] == "xpu" and m["kvstack_plan"]["variant"] == "ze-ipc"
    assert m["kvstack_plan"]["unreleased"]["ucx"]["number"] == 11218
    ucx = m["kvstack_plan"]["sources"]["ucx"]
    assert ucx["commit"] == PR_HEAD and "tag" not in ucx
    assert m["sources"]["ucx"]["commit"] == PR_HEAD and "commit" in m["sources"]["ucx"]["checked"]
    configure = next(
        s
        for s in m["phases"]["configure"]["components"]["ucx"]["steps"]
        if s["step"] == "configure"
    )
    assert "--with-ze=yes" in configure["argv"]


@pytest.mark.parametrize("name", ["CPU", "XPU", "XPU_IPC"])
def test_every_pinned_build_passed_all_three_levels(name):
    """The install's own verification: every level ran and passed; bytes moved in host memory on the
    fresh NIXL (no device here), the xpu modes shown as not checked here, never as passed."""
    build = _build(name)
    report = build["manifest"]["verification"]
    assert all(v["status"] == "passed" for v in report["levels"].values()), (
        verify.render_verification(report)
    )
    assert verify.verdict(report).startswith(
        "verification passed"
    ) and " only;" not in verify.verdict(report)
    moved = report["levels"]["moved"]["checks"]
    assert moved[0]["check"] == "the self-test used this build's NIXL" and moved[0]["ok"]
    assert any(c["check"].startswith("moved host/") and c["ok"] for c in moved)
    device = [c for c in moved if c["check"].startswith("moved xpu/")]
    assert all(c["ok"] is None for c in device) and (device or name == "CPU")
    # the richest check: a model's prompt continued in another process on this build (CI's
    # builds' Python sees .venv's torch and transformers, the test extra's)
    demo = next(c for c in moved if c["check"] == verify.DEMO)
    if importlib.util.find_spec("transformers"):
        assert demo["ok"] is True and demo["detail"].startswith("14 of 14 cases on cpu memory"), (
            demo
        )
    else:
        assert demo["ok"] is None and "transformers are not importable" in demo["detail"], demo


def test_both_xpu_pins_prove_their_transports_under_the_null_driver(xpu, ipc):
    rel = _loaded(recipe.load("xpu").data["verify"], xpu)
    assert rel["status"] == "passed", _failed(rel)
    checks = {c["check"]: c["detail"] for c in rel["checks"]}
    assert checks["transport ze_copy"] == "listed: " + ", ".join(RELEASE_TRANSPORTS)
    assert "transport ze_ipc" not in checks
    assert checks["ze_cpy shows 'host (access'"].startswith("Level Zero null driver from ")
    pr = _loaded(recipe.load("xpu", variant="ze-ipc").data["verify"], ipc)
    assert pr["status"] == "passed", _failed(pr)
    checks = {c["check"]: c["detail"] for c in pr["checks"]}
    assert checks["transport ze_ipc"] == "listed: " + ", ".join(
        sorted(RELEASE_TRANSPORTS + ["ze_ipc"])
    )
    assert "ze_ipc" in checks["memory domain ze_ipc"]
    policy = checks["kvruntime's UCX_TLS for xpu memory on one node"]
    assert policy.startswith("UCX_TLS=ze_ipc,ze_copy,tcp, expected ze_ipc,ze_copy,tcp; ")
    assert "UCX_TLS=ze_ipc,ze_copy,tcp: single-node Intel GPUs without InfiniBand" in policy


def test_ze_ipc_choice_on_a_ucx_without_ze_ipc_fails_the_loaded_level_naming_what_it_found(xpu):
    """The variant's proof laid over the release UCX (what an overlay pointing its source elsewhere
    builds): the loaded level fails, and says which transports that UCX has."""
    level = _loaded(recipe.load("xpu", variant="ze-ipc").data["verify"], xpu)
    assert level["status"] == "failed"
    failed = _failed(level)
    assert failed["transport ze_ipc"] == "listed: " + ", ".join(RELEASE_TRANSPORTS)
    assert "memory domain ze_ipc" in failed
    assert failed["kvruntime's UCX_TLS for xpu memory on one node"].startswith(
        "UCX_TLS left to UCX, expected ze_ipc,ze_copy,tcp; UCX_MEMTYPE_CACHE=n: ")
    assert "UCX_TLS unset: ze_copy fallback: this UCX offers no ze_ipc" in failed[
        "kvruntime's UCX_TLS for xpu memory on one node"]


def test_the_policy_on_each_builds_real_ucx_info(xpu, ipc, monkeypatch):
    """kvruntime's transport policy as a process on that host runs it: ucx_info -d on PATH."""
    offered = _offered(ipc, monkeypatch)
    assert {"ze_ipc", "ze_copy", "tcp"} <= offered and not offered & transports.IB_TRANSPORTS
    added = transports.ucx_settings("xpu", {}, offered)
    assert added == {"UCX_TLS": "ze_ipc,ze_copy,tcp", "UCX_MEMTYPE_CACHE": "n"}
    print("ze-ipc:", transports.describe(added, {}, "xpu", offered))
    offered = _offered(xpu, monkeypatch)
    assert "ze_copy" in offered and "ze_ipc" not in offered
    added = transports.ucx_settings("xpu", {}, offered)
    assert added == {"UCX_MEMTYPE_CACHE": "n"}
    lines = transports.describe(added, {}, "xpu", offered)
    print("release:", lines)
    assert lines[-1].startswith("UCX_TLS unset: ze_copy fallback: this UCX offers no ze_ipc")


def test_xpu_verification_refuses_a_ucx_without_level_zero(cpu, xpu):
    """xpu's proof on the cpu build's UCX (no --with-ze): the built level names the missing define
    and module, the loaded level (the xpu build's null driver) the missing ze transport."""
    spec = recipe.load("xpu").data["verify"]
    built = verify.built(spec, cpu["dir"], cpu["env"], {"ze": "yes"}, ["ucx", "nixl"])
    assert {"define HAVE_ZE", "uct_MODULES has ze"} <= set(_failed(built))
    loaded = _loaded(spec, {**cpu, "null_driver": xpu["null_driver"]})
    assert set(_failed(loaded)) >= {
        "transport ze_copy",
        "memory domain ze_cpy",
        "ze_cpy shows 'host (access'",
    }


def test_selftest_reports_the_xpu_choice_with_its_reason_on_each_build(xpu, ipc):
    """What `python -m kvruntime selftest` reports (its `ucx_policy`, and the text lines it prints
    from it) in a process run with each build's env.sh and the null driver, as on that host."""
    import subprocess

    code = (
        "import json; from kvruntime.tools.selftest import ucx_policy; "
        "print(json.dumps(ucx_policy()))"
    )
    said = {}
    for name, build in (("release", xpu), ("ze-ipc", ipc)):
        env = envfile.apply(
            {
                "LD_LIBRARY_PATH": str(build["null_driver"]),
                "ZE_ENABLE_NULL_DRIVER": "1",
                "PYTHONPATH": str(Path(__file__).resolve().parents[3]),
            },
            build["env"],
        )
        env.pop("UCX_TLS", None)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=120, check=True)
        said[name] = json.loads(out.stdout)["xpu"]
    assert (
        "UCX_TLS=ze_ipc,ze_copy,tcp: single-node Intel GPUs without InfiniBand: ze_ipc between "
        "processes, ze_copy, and tcp for NIXL's active messages (seed 001)" in said["ze-ipc"]
    )
    assert any(line.startswith("UCX_TLS unset: ze_copy fallback: this UCX offers no ze_ipc")
               for line in said["release"]), said["release"]


@pytest.mark.parametrize("name", ["CPU", "XPU", "XPU_IPC"])
def test_every_pinned_build_carries_rdma_proven_under_ibmock_and_says_what_it_cannot(name):
    """Every pinned UCX has verbs, rdmacm, mlx5 and efa; with no HCA here, UCX's own fake EFA
    device (contrib/ibmock, built from the build's UCX source) shows its domains and transports,
    NIXL's UCX backend comes up on it alone, a READ held to it moves bit-exact on its lanes, and
    the data path between hosts is reported not proven, never passed. ibmock never reaches a
    runtime path."""
    build = _build(name)
    report = build["manifest"]["verification"]
    checks = {lvl: {c["check"]: c for c in v["checks"]} for lvl, v in report["levels"].items()}
    for module in ("uct_MODULES has ib", "uct_MODULES has rdmacm", "uct_ib_MODULES has mlx5",
                   "uct_ib_MODULES has efa", "define HAVE_IB"):
        assert checks["built"][module]["ok"] is True, module
    loaded = checks["loaded"]
    for check in (
        "ibmock memory domain rdmap0",
        "ibmock transport ud_verbs",
        "ibmock transport srd",
        "NIXL's UCX backend on rdmap0:1 alone (UCX_TLS=ud_verbs)",
    ):
        assert loaded[check]["ok"] is True, (check, loaded.get(check))
    moved = checks["moved"]
    assert moved["moved 4 MiB READ over rdmap0:1 (one process, two NIXL agents)"]["ok"] is True
    lanes = moved["the lanes UCX read back are rdmap0's"]
    assert (
        lanes["ok"] is True
        and "ud_verbs/rdmap0:1" in lanes["detail"]
        and "elsewhere" not in lanes["detail"]
    )
    between = moved["RDMA data path between processes and hosts"]
    assert between["ok"] is None and "not proven on this host" in between["detail"]
    assert (build["dir"] / "verify" / "ibmock" / "libibverbs.so.1").exists()
    assert "ibmock" not in (build["dir"] / "env.sh").read_text() and "ibmock" not in json.dumps(
        build["manifest"]["env"]
    )


def test_a_read_that_leaves_the_rdma_device_fails_the_lane_check(cpu):
    """The lane check can fail: with shared memory and cma admitted beside ud_verbs, UCX puts the
    READ on cma/memory and the level names it, although the bytes arrive."""
    spec = dict(recipe.load("cpu").data["verify"]["rdma"], moved_tls="ud_verbs,posix,cma")
    module = envfile.nixl_module(cpu["dir"], "nixl_cpu")
    checks = verify._rdma_moved(
        spec, cpu["env"], sys.executable, module, cpu["dir"] / "verify" / "ibmock"
    )
    by_name = {c["check"]: c for c in checks}
    assert by_name["moved 4 MiB READ over rdmap0:1 (one process, two NIXL agents)"]["ok"] is True
    lanes = by_name["the lanes UCX read back are rdmap0's"]
    assert lanes["ok"] is False and "elsewhere: cma/memory" in lanes["detail"], lanes


def _ucx_env(build, monkeypatch, before=""):
    """`build`'s UCX first on PATH and LD_LIBRARY_PATH (``before`` ahead of its libraries)."""
    monkeypatch.setenv("PATH", build["env"]["PATH"])
    monkeypatch.setenv("LD_LIBRARY_PATH", before + build["env"]["LD_LIBRARY_PATH"])


def test_the_choice_across_hosts_on_the_cpu_builds_real_ucx_info(cpu, monkeypatch):
    """The cpu build has verbs, rdmacm, mlx5 and efa, but ucx_info lists an RDMA transport only
    on a device that exists: on a host without an HCA none, so across hosts is tcp, said; and a
    UCX_NET_DEVICES naming an RDMA port is refused before NIXL would fail (prime-rl #3204)."""
    from kvruntime.nixl import nics

    _ucx_env(cpu, monkeypatch)
    offered = transports.offered_devices()
    host = nics.read_host("cpu")
    if host.active() or set(offered) & set(transports.RDMA_AM):
        pytest.skip("this host has RDMA devices: the HCA-less case does not apply")
    assert "tcp" in offered
    assert transports.policy("cpu", {}, offered, host)[-1] == \
        "across hosts: tcp: no RDMA device on this host"
    refused = transports.policy("cpu", {"UCX_NET_DEVICES": "mlx5_0:1"}, offered, host)
    assert refused[0].startswith("refused: UCX_NET_DEVICES=mlx5_0:1 names mlx5_0:1, not on this "
                                 "host (RDMA ports: none;")


def test_the_choice_across_hosts_under_ibmocks_efa_devices(cpu, monkeypatch):
    """The same build's ucx_info under UCX's contrib/ibmock (the one its verification built,
    <build>/verify/ibmock, or KVSTACK_IBMOCK_DIR; its device nodes as installer/ibmock.py makes
    them): two EFA devices with ud_verbs and srd, which the policy takes as RDMA with an AM lane,
    pinning a GPU's nearest; sysfs shows none of them, which the policy says."""
    from installer import ibmock
    from kvruntime.nixl import nics

    mock = Path(os.environ.get("KVSTACK_IBMOCK_DIR") or cpu["dir"] / "verify" / "ibmock")
    if not (mock / "libibverbs.so.1").exists():
        pytest.skip(f"no ibmock build at {mock}")
    _ucx_env(cpu, monkeypatch, before=f"{mock}:")
    monkeypatch.setenv("CLOUD_TYPE", "aws")
    try:
        with ibmock.device_nodes():
            offered = transports.offered_devices()
    except ibmock.Unavailable as e:
        pytest.skip(str(e))
    assert offered["srd"] == offered["ud_verbs"] == {"rdmap0:1", "rdmap1:1"}
    up = nics.Port(1, "ACTIVE", "InfiniBand", "")
    rdmap = tuple(nics.Nic(f"rdmap{i}", (up,), None, None) for i in (0, 1))
    host = nics.RdmaHost(nics=rdmap, net_interfaces=("lo",), gpu="0000:18:00.0",
                         nearest=(rdmap[1], "the test's choice"))
    assert transports.ucx_settings("cuda", {}, offered, host)["UCX_NET_DEVICES"] == "rdmap1:1"
    seen = transports.policy("cpu", {"UCX_NET_DEVICES": "rdmap0:1"}, offered,
                             nics.read_host("cpu"))
    assert seen[-1].startswith("across hosts: tcp: no RDMA device on this host (sysfs), though "
                               "this UCX lists rdmap0:1, rdmap1:1")
