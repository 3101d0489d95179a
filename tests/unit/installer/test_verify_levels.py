"""installer/verify.py's level arithmetic: a check this host cannot run (ok None) is neither a pass
nor a failure, and a level made only of those is not passed."""
import os
import stat

from installer import hostcaps, verify

DEVICES = """# Memory domain: posix
#     Transport: posix
# Memory domain: sysv
#     Transport: sysv
# Memory domain: self
#     Transport: self
# Memory domain: tcp
#     Transport: tcp
"""
SPEC = {
    "ucx": {
        "transports": ["tcp", "posix", "sysv", "cma"],
        "memory_domains": ["posix", "sysv", "cma"],
    }
}


def _fake_ucx_info(tmp_path):
    b = tmp_path / "ucx" / "bin"
    b.mkdir(parents=True)
    f = b / "ucx_info"
    f.write_text("#!/bin/sh\ncat <<'EOF'\n" + DEVICES + "EOF\n")
    f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def test_levels_count_only_checks_that_ran():
    ok, bad = verify._check("a", True, ""), verify._check("b", False, "")
    skip = verify._not_here("c", "no CAP_SYS_PTRACE")
    assert verify._level([ok, skip])["status"] == "passed"
    assert verify._level([bad, skip])["status"] == "failed"
    assert verify._level([skip])["status"] == "failed"  # nothing proven is not a pass
    text = verify.render_verification({"ok": True, "levels": {"loaded": verify._level([ok, skip])}})
    assert "   skip c: not checked here: no CAP_SYS_PTRACE" in text


def test_cma_missing_where_the_kernel_refuses_it_is_not_checked_rather_than_failed(
    tmp_path, monkeypatch
):
    build = _fake_ucx_info(tmp_path)
    monkeypatch.setattr(
        hostcaps, "cross_memory_denied", lambda: "process_vm_writev is refused here"
    )
    level = verify.loaded(SPEC, build, dict(os.environ), "python3", "cpu", None, False, ["ucx"])
    assert level["status"] == "passed"
    cma = [c for c in level["checks"] if "cma" in c["check"]]
    assert len(cma) == 2 and all(c["ok"] is None and "refused" in c["detail"] for c in cma)
    # where the kernel allows it, a UCX that does not list cma fails as before
    monkeypatch.setattr(hostcaps, "cross_memory_denied", lambda: None)
    level = verify.loaded(SPEC, build, dict(os.environ), "python3", "cpu", None, False, ["ucx"])
    assert level["status"] == "failed" and {
        c["check"] for c in level["checks"] if c["ok"] is False
    } == {"transport cma", "memory domain cma"}


def test_this_host_allows_process_vm_writev_or_says_why():
    why = hostcaps.cross_memory_denied()
    assert why is None or "process_vm_writev" in why


def _report(built, loaded, moved):
    make = {"passed": lambda: verify._level([verify._check("a", True, "")]),
            "skipped": lambda: verify._level([], skipped="no Intel GPU here"),
            "failed": lambda: verify._level([verify._check("b", False, "")]),
            "no nixl": lambda: verify._level([], skipped=verify.NO_NIXL)}
    levels = {"built": make[built](), "loaded": make[loaded](), "moved": make[moved]()}
    return {"levels": levels, "ok": verify.passes(levels)}


def test_a_level_that_could_not_run_is_never_read_as_passed():
    """Issue 30: xpu with no Intel GPU and the null driver hidden said "verification passed" after
    the built level alone. The verdict names what did not run, and a build with NIXL passes only
    once bytes moved (host memory needs no device)."""
    assert verify.verdict(_report("passed", "passed", "passed")) == "verification passed"
    partial = _report("passed", "skipped", "passed")
    assert partial["ok"]
    assert verify.verdict(partial) == ("verification passed for built, moved only; "
                                       "not run here: loaded (no Intel GPU here)")
    assert not _report("passed", "skipped", "skipped")["ok"]
    assert verify.verdict(_report("passed", "skipped", "skipped")) == "verification FAILED"
    unchecked = _report("passed", "passed", "passed")
    unchecked["levels"]["moved"]["checks"].append(
        verify._not_here("moved xpu/cross_layer/pull/nixl", "no xpu device")
    )
    assert verify.verdict(unchecked) == ("verification passed; 1 checks not made here, e.g. "
                                         "moved xpu/cross_layer/pull/nixl (no xpu device)")
    # a UCX-only recipe (no NIXL to move bytes with) is the one build that may finish unmoved
    ucx_only = _report("passed", "passed", "no nixl")
    assert ucx_only["ok"] and verify.verdict(ucx_only).endswith(
        "not run here: moved (this recipe builds no NIXL)"
    )


def test_env_sh_notes_the_transport_choice_the_loaded_level_saw():
    """env.sh carries the policy check's line (what kvruntime chose on this build's UCX and why),
    only when the loaded level made that check and it passed."""
    from installer import envfile

    detail = (
        "UCX_TLS=ze_ipc,ze_copy,tcp, expected ze_ipc,ze_copy,tcp; UCX_TLS=ze_ipc,ze_copy,tcp: "
        "single-node Intel GPUs without InfiniBand"
    )
    report = {
        "levels": {
            "loaded": {
                "checks": [
                    {"check": "transport ze_ipc", "ok": True, "detail": "listed"},
                    {
                        "check": "kvruntime's UCX_TLS for xpu memory on one node",
                        "ok": True,
                        "detail": detail,
                    },
                ]
            }
        }
    }
    note = envfile.policy_comment(report)
    assert note.startswith(
        "# kvruntime's UCX_TLS for xpu memory on one node, from this build's ucx_info -d"
    )
    assert detail in note and all(line.startswith("#") for line in note.splitlines())
    report["levels"]["loaded"]["checks"][1]["ok"] = None  # not checked here
    assert envfile.policy_comment(report) == ""
    assert envfile.policy_comment({"levels": {"loaded": {"checks": []}}}) == ""


def test_env_sh_notes_what_verification_proved_of_rdma_and_what_it_did_not():
    from installer import envfile

    report = {
        "levels": {
            "moved": {
                "checks": [
                    verify._check("moved host/cross_layer/pull/nixl", True, "..."),
                    verify._check(
                        "moved 4 MiB READ over rdmap0:1 (one process, two NIXL agents)",
                        True,
                        "bit-exact",
                    ),
                    verify._not_here("RDMA data path between processes and hosts", verify.NO_HCA),
                ]
            }
        }
    }
    note = envfile.policy_comment(report).splitlines()
    assert note[0] == (
        "# RDMA when this build was verified: moved 4 MiB READ over rdmap0:1 (one process, "
        "two NIXL agents): passed; RDMA data path between processes and hosts: not proven here"
    )
    assert "python -m kvruntime policy" in note[1] and len(note) == 2


# Rows of UCX_PROTO_INFO=y tables as UCX v1.22.0 (the pinned build) printed them for a READ under
# UCX's fake EFA device with UCX_TLS=ud_verbs,posix,cma (installer/verify.py RDMA_MOVE_PROBE)
PROTO_INFO = """\
[1795784415.472650] [vm:5635 :0]   | ucp_context_1 intra-node cfg#1                     |
[1795784415.472650] [vm:5635 :0]   | active message by ucp_am_send* from host memory    |
[1795784415.472650] [vm:5635 :0]   |   Range   |    Description     |      Config       |
[1795784415.472650] [vm:5635 :0]   |   0..4080 | copy-in            | ud_verbs/rdmap0:1 |
[1795784415.472650] [vm:5635 :0]   | 4081..inf | multi-frag copy-in | ud_verbs/rdmap0:1 |
[1795784415.477834] [vm:5635 :0]   | remote memory write by ucp_put* from host memory to host |
[1795784415.477834] [vm:5635 :0]   | 0..inf | zero-copy   | cma/memory                        |
"""


# Rows a CUDA build's probe printed on an H200 under ibmock (UCX_TLS=ud_verbs,cuda_copy): NIXL's
# agent puts host-to-host writes of its endpoint to itself on cuda_copy
SELF_TABLE = """\
[1795785404.632562] [vm:19149:0]   | ucp_context_0 self cfg#0                                 |
[1795785404.632562] [vm:19149:0]   | remote memory write by ucp_put* from host memory to host |
[1795785404.632562] [vm:19149:0]   |     Range     | Description |           Config           |
[1795785404.632562] [vm:19149:0]   | 0..4294967295 | short       | cuda_copy/cuda             |
"""
# written for this test in the same format: a table of device memory between two endpoints
DEVICE_TABLE = """\
[1795785404.632562] [vm:19149:0]   | ucp_context_1 intra-node cfg#2                   |
[1795785404.632562] [vm:19149:0]   | remote memory read into cuda/dev[0] memory from host |
[1795785404.632562] [vm:19149:0]   | 0..inf | zero-copy   | cuda_ipc/cuda              |
"""


def test_lanes_are_read_from_the_config_column_only_with_or_without_a_port():
    assert verify.proto_lanes(PROTO_INFO) == ["cma/memory", "ud_verbs/rdmap0:1"]
    assert verify.proto_lanes("| ucp_get*(multi) into host/x memory from host |") == []


def test_lanes_between_peers_leave_out_self_endpoints_and_device_memory():
    every = PROTO_INFO + SELF_TABLE + DEVICE_TABLE
    assert verify.proto_lanes(every) == [
        "cma/memory",
        "cuda_copy/cuda",
        "cuda_ipc/cuda",
        "ud_verbs/rdmap0:1",
    ]
    assert verify.proto_lanes(every, between_peers=True) == ["cma/memory", "ud_verbs/rdmap0:1"]


def test_the_demo_is_not_checked_where_the_target_python_has_no_transformers(tmp_path):
    """A real interpreter without torch or transformers (a bare venv): the moved level shows the
    demo as not checked, with what to install, and runs nothing."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "v")],
                   check=True)
    python = str(tmp_path / "v" / "bin" / "python")
    check = verify._demo(dict(os.environ, PYTHONPATH=""), python, "cpu", {}, 60)
    assert check["check"] == verify.DEMO and check["ok"] is None
    assert check["detail"] == (f"not checked here: torch and transformers are not importable by "
                               f"{python} (pip install torch 'kvstack[demo]' there to run it)")


def test_the_selftest_started_beside_the_earlier_levels_is_stopped_when_one_fails(tmp_path,
                                                                                 monkeypatch):
    """The moved level's selftest and demo start before the built and loaded levels, so they run
    beside their short commands; when one of those fails their results are never read and their
    processes do not outlive verification. (A sleeping Python stands in for each: nothing here
    can move.)"""
    import importlib.util
    import sys
    started = []
    sleep = ("-c", "import time; time.sleep(60)")

    class Recorded(verify.Selftest):
        ARGS = sleep

        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            started.append(self)

    class RecordedDemo(verify.Demo):
        ARGS = sleep

        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            started.append(self)

    monkeypatch.setattr(verify, "Selftest", Recorded)
    monkeypatch.setattr(verify, "Demo", RecordedDemo)
    spec = {**SPEC, "ucx": {**SPEC["ucx"], "defines": [], "modules": {}, "absent_defines": []},
            "nixl": {"module": "nixl_cpu", "plugins": ["UCX"]}}
    report = verify.report_levels(spec, "cpu", tmp_path, dict(os.environ), sys.executable, {}, None,
                                  False, ["ucx", "nixl"])
    assert report["levels"]["built"]["status"] == "failed" and not report["ok"]
    assert report["levels"]["moved"] == {"status": "skipped", "reason": "an earlier level failed",
                                         "checks": []}
    # the demo where this Python has what it imports (CI's has: the test extra)
    demo = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
    assert [type(s) for s in started] == [Recorded] + [RecordedDemo] * demo
    assert all(s.proc.poll() is not None for s in started)  # started, then stopped
