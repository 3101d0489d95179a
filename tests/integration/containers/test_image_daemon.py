"""installer/image.py against a real dockerd (Debian's docker.io; overlay2, no iptables, no
bridge): the one DOCKER_HOST names when it answers (CI's container step starts one), else one this
module starts and stops by its pid. Skipped with the reason only when no daemon can start here
(not root, no dockerd); CI installs docker.io and starts one, so CI runs every test here.

No registry is reachable: a missing base fails at FROM ("base image missing and no registry"),
and the cpu image is built with no network (installer image --offline: the builder's network mode
none, pip with no index) on the debootstrapped base with Debian's packages the stages want
(ci/base-image.sh, ci/offline-base.sh) from the pinned cpu build
CI made (ci/pinned-builds.sh; KVSTACK_PINNED_PREFIX_CPU names it, the image tests skip without it):
its binary cache, which the build stage installs from, relocated and verified there
(ci/image-inputs.sh). Inside the image, `installer verify` (all three levels) and `kvruntime
selftest` must pass on that build's UCX and NIXL. The xpu image the same way from the pinned xpu
build (KVSTACK_PINNED_PREFIX_XPU): no Intel GPU here, so its loaded level runs under the Level
Zero null driver the build carries, with Debian's Level Zero loader (libze1) in the image, and the
selftest moves host memory through that build's NIXL and UCX."""
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from installer import image, verify
from installer.errors import BuildError

pytestmark = pytest.mark.integration
docker = pytest.importorskip("docker")
ROOT = Path(image.__file__).resolve().parent.parent
BASE = "kvstack-base:bookworm"
# BASE with the stages' Debian packages (ci/offline-base.sh): the build stage's, the runtime's
OFFLINE_BASE, OFFLINE_RUNTIME = "kvstack-offline-base:bookworm", "kvstack-offline-runtime:bookworm"
# the tags CI's container step builds: the same requests here reuse their layers
TAG = "kvstack:cpu-ci"
XPU_TAG = "kvstack:xpu-ci"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")


def _own_daemon(d: Path):
    sock = f"unix://{d}/sock"
    proc = subprocess.Popen(
        [
            "dockerd",
            "--data-root",
            str(d / "root"),
            "--exec-root",
            str(d / "exec"),
            "--pidfile",
            str(d / "pid"),
            "-H",
            sock,
            "--iptables=false",
            "--bridge=none",
        ],
        stdout=open(d / "log", "wb"),
        stderr=subprocess.STDOUT,
    )
    for _ in range(60):
        try:
            return proc, sock, image.connect({"DOCKER_HOST": sock})
        except Exception:
            time.sleep(0.5)
    proc.terminate()
    proc.wait(30)
    pytest.skip("dockerd did not answer: " + (d / "log").read_text()[-500:])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """(client, DOCKER_HOST) of a daemon that answers."""
    if os.environ.get("DOCKER_HOST"):
        try:
            yield image.connect(), os.environ["DOCKER_HOST"]
            return
        except Exception:
            pass  # named but not answering: start our own below
    if os.geteuid() != 0 or not shutil.which("dockerd"):
        pytest.skip("no dockerd can start here (needs root and Debian's docker.io)")
    proc, sock, client = _own_daemon(tmp_path_factory.mktemp("dockerd"))
    try:
        yield client, sock
    finally:
        proc.terminate()
        proc.wait(30)


def test_missing_base_without_registry_is_one_line_and_leaves_no_containers(daemon, tmp_path):
    client, _ = daemon
    checkout = tmp_path / "ctx"
    shutil.copytree(
        ROOT, checkout, ignore=shutil.ignore_patterns(".git", ".venv", "_work", "__pycache__")
    )
    req = image.request("cpu", "kvstack-test:absent-base", "kvstack-absent-base:none")
    assert not image.base_is_local(client, req.base_image)
    before = {c.id for c in client.containers.list(all=True)}
    lines = []
    with pytest.raises(BuildError) as e:
        image.build(client, req, checkout, lines.append)
    assert "\n" not in e.value.line() and "--base-image" in e.value.line()
    assert {c.id for c in client.containers.list(all=True)} == before


def _ci_image(daemon, tmp_path_factory, platform: str, tag: str):
    """The PLATFORM image as CI's container step builds it (same inputs, same checkout as context):
    (client, result, log lines, the pinned build's manifest)."""
    client, host = daemon
    var = f"KVSTACK_PINNED_PREFIX_{platform.upper()}"
    prefix = os.environ.get(var)
    if not prefix or not (Path(prefix) / "manifest.json").is_file():
        pytest.skip(f"{var} names no pinned {platform} build (ci/pinned-builds.sh makes it)")
    env = dict(os.environ, DOCKER_HOST=host)
    if not all(image.base_is_local(client, b) for b in (OFFLINE_BASE, OFFLINE_RUNTIME)):
        if not image.base_is_local(client, BASE):
            subprocess.run(["bash", "ci/base-image.sh", BASE], cwd=ROOT, env=env, check=True,
                           timeout=1200)
        subprocess.run(
            ["bash", "ci/offline-base.sh", BASE, OFFLINE_BASE, OFFLINE_RUNTIME],
            cwd=ROOT,
            env=env,
            check=True,
            timeout=1200,
        )
    inputs = tmp_path_factory.mktemp(f"image-inputs-{platform}")
    for args in (
        ["ci/image-inputs.sh", str(inputs), prefix],
        ["ci/image-wheels.sh", str(inputs / "wheels")],
    ):
        r = subprocess.run(
            ["bash", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
        )
        assert r.returncode == 0, r.stderr[-2000:]
    req = image.request(platform, tag, OFFLINE_BASE, str(inputs / "mirror"),
                        str(HOST_CA) if HOST_CA.is_file() else None,
                        [str(p) for p in sorted((inputs / "overlays").glob("*.toml"))],
                        str(inputs / "wheels"), binary_cache=str(inputs / "cache"), offline=True,
                        runtime_base_image=OFFLINE_RUNTIME)
    before = {c.id for c in client.containers.list(all=True)}
    lines = []
    res = image.build(client, req, ROOT, lines.append)
    assert {c.id for c in client.containers.list(all=True)} == before  # intermediate ones removed
    return client, res, lines, json.loads((Path(prefix) / "manifest.json").read_text())


@pytest.fixture(scope="module")
def cpu_image(daemon, tmp_path_factory):
    return _ci_image(daemon, tmp_path_factory, "cpu", TAG)


@pytest.fixture(scope="module")
def xpu_image(daemon, tmp_path_factory):
    return _ci_image(daemon, tmp_path_factory, "xpu", XPU_TAG)


def _run(client, tag: str, script: str, caps=("SYS_PTRACE",)) -> tuple[int, str]:
    """bash -c SCRIPT in a fresh container of TAG (env.sh sourced, loopback only; CAP_SYS_PTRACE,
    which docker's default seccomp profile asks for process_vm_readv, UCX's cma); exit code and
    stdout."""
    c = client.containers.run(
        tag,
        ["bash", "-c", "source /opt/kvstack/env.sh && " + script],
        detach=True,
        network_mode="none",
        cap_add=list(caps),
    )
    try:
        rc = c.wait(timeout=600)["StatusCode"]
        return rc, c.logs(stdout=True, stderr=False).decode()
    finally:
        c.remove(force=True)


def test_cpu_image_says_where_its_parts_came_from(cpu_image):
    client, res, _, built = cpu_image
    ucx, nixl = res["parts"]
    assert ucx["from"] == "source" and ucx["source"] == "ucx" and ucx["version"] == "1.22.0"
    assert nixl["from"] == "source" and nixl["source"] == "nixl" and nixl["version"] == "1.4.0"
    assert (
        ucx["binary_cache"] == nixl["binary_cache"] == built["install_dir"]
    )  # not compiled in the image
    # the build stage took it from the binary cache (its log may be all "Using cache": CI built it
    # just before)
    assert res["manifest"]["build_id"] == built["build_id"] and list(res["manifest"]["phases"]) == [
        "binary-cache"
    ]
    rendered = image.render_parts(res)
    assert rendered[0].startswith("ucx: 1.22.0 built from source ucx (ucx-1.22.0.tar.gz")
    assert rendered[0].endswith(f", taken from a binary cache (built in {built['install_dir']})")
    # the runtime stage carries the prefix, the venv and env.sh: no compiler, no checkout
    assert res["size"] < res["build_stage"]["size"]
    rc, out = _run(client, TAG, "command -v gcc make; ls /src 2>&1; ls /opt/kvstack/")
    assert (
        "gcc" not in out
        and "No such file" in out
        and "env.sh" in out
        and "ucx" in out
        and "nixl" in out
    )


def test_installer_verify_passes_inside_the_image(cpu_image):
    client, res, _, _ = cpu_image
    rc, out = _run(client, res["tag"], "python -m installer verify --prefix /opt/kvstack --json")
    report = json.loads(out)
    levels = report["levels"]
    assert rc == 0 and report["ok"], out[-3000:]
    assert {name: lvl["status"] for name, lvl in levels.items()} == {
        "built": "passed",
        "loaded": "passed",
        "moved": "passed",
    }
    assert {c["check"] for c in levels["loaded"]["checks"]} >= {
        "transport cma",
        "transport tcp",
        "memory domain posix",
        "NIXL plugin UCX",
    }
    assert all(c["ok"] is True for c in levels["loaded"]["checks"])
    # RDMA between hosts is never proven without an HCA: reported as not checked, never passed
    moved = levels["moved"]["checks"]
    between = [c for c in moved if c["check"].startswith("RDMA data path")]
    assert len(between) == 1 and between[0]["ok"] is None and "not proven" in between[0]["detail"]
    # the images carry no transformers: the demo is said not checked, with what to install
    demo = [c for c in moved if c["check"] == verify.DEMO]
    assert len(demo) == 1 and demo[0]["ok"] is None and "not importable" in demo[0]["detail"], demo
    assert all(c["ok"] is True for c in moved if c not in between + demo)


def test_without_cap_sys_ptrace_cma_is_not_checked_rather_than_passed(cpu_image):
    client, res, _, _ = cpu_image
    rc, out = _run(
        client, res["tag"], "python -m installer verify --prefix /opt/kvstack --json", caps=()
    )
    loaded = json.loads(out)["levels"]["loaded"]
    assert loaded["status"] == "passed", out[-3000:]
    cma = {c["check"]: c for c in loaded["checks"] if "cma" in c["check"]}
    assert set(cma) == {"transport cma", "memory domain cma"}
    assert all(c["ok"] is None and "CAP_SYS_PTRACE" in c["detail"] for c in cma.values())


def test_kvruntime_selftest_moves_bytes_between_two_processes_inside_the_image(cpu_image):
    client, res, _, built = cpu_image
    rc, out = _run(client, res["tag"], "python -m kvruntime selftest --json")
    report = json.loads(out)
    assert rc == 0 and report["ok"], (report.get("error"), out[-3000:])
    assert report["nixl_module"] == "nixl_cpu" and report["nixl_module_file"].startswith(
        "/opt/kvstack.builds/"
    )
    # the runtime stage has no compiler: the block-id reader is the one the build stage cached
    assert report["id_reader"].startswith("loaded /opt/kvruntime-cache/"), report["id_reader"]
    passed = [m for m in report["modes"] if m["status"] == "passed"]
    engines = {m.get("engine", "").split(":")[0] for m in passed}  # e.g. samenode:process_vm_readv
    assert {"nixl", "samenode", "host_staged"} <= engines, engines
    assert any(m["mode"].startswith("host/") and m["mode"].endswith("/staged") for m in passed)
    assert all(m["digest_ok"] for m in passed) and sum(m.get("bytes", 0) for m in passed) > 0


def test_xpu_image_verifies_under_the_null_driver_and_moves_bytes_inside(xpu_image):
    client, res, _, built = xpu_image
    assert res["manifest"]["build_id"] == built["build_id"] and list(res["manifest"]["phases"]) == [
        "binary-cache"
    ]
    rc, out = _run(client, XPU_TAG, "python -m installer verify --prefix /opt/kvstack --json")
    report = json.loads(out)
    assert rc == 0 and report["ok"], out[-3000:]
    levels = report["levels"]
    assert {name: lvl["status"] for name, lvl in levels.items()} == {
        "built": "passed",
        "loaded": "passed",
        "moved": "passed",
    }
    loaded = {c["check"]: c for c in levels["loaded"]["checks"]}
    # ze through Level Zero's null driver (no Intel GPU here): the transport and the memory domain
    assert (
        loaded["transport ze_copy"]["ok"] is True and loaded["memory domain ze_cpy"]["ok"] is True
    ), loaded
    # host memory moved through the build's NIXL; the xpu modes are not checked (torch sees no
    # xpu), never passed
    # and RDMA between hosts and GPUDirect are reported not proven (no HCA), never passed
    moved = levels["moved"]["checks"]
    rdma = [c for c in moved if c["check"].startswith(("RDMA data path", "GPUDirect RDMA"))]
    assert len(rdma) == 2 and all(c["ok"] is None and "not proven" in c["detail"] for c in rdma), (
        rdma
    )
    demo = [c for c in moved if c["check"] == verify.DEMO]  # no transformers in the image
    assert len(demo) == 1 and demo[0]["ok"] is None, demo
    assert all(
        c["ok"] is True for c in moved if "xpu/" not in c["check"] and c not in rdma + demo
    )
    assert any("host/" in c["check"] for c in moved)
    assert all(
        c["ok"] is None and "no xpu device" in c["detail"] for c in moved if "xpu/" in c["check"]
    )
    rc, out = _run(client, XPU_TAG, "python -m kvruntime selftest --json")
    report = json.loads(out)
    assert rc == 0 and report["ok"], (report.get("error"), out[-3000:])
    assert report["nixl_module"] == "nixl_xpu" and report["nixl_module_file"].startswith(
        "/opt/kvstack.builds/"
    )
    passed = [m for m in report["modes"] if m["status"] == "passed"]
    assert any(m.get("engine", "").startswith("nixl") for m in passed) and all(
        m["digest_ok"] for m in passed
    )


def _shell_only_base(client, tmp_path) -> str:
    """A base image of this host's own /bin/sh and the libraries it loads (docker import): the
    Containerfile's first steps need no more, and no registry."""
    import tarfile
    sh = Path(os.path.realpath("/bin/sh"))
    ldd = subprocess.run(["ldd", str(sh)], capture_output=True, text=True, check=True).stdout
    libs = {Path(w) for line in ldd.splitlines() for w in line.split() if w.startswith("/")}
    tar = tmp_path / "sh-base.tar"
    with tarfile.open(tar, "w") as tf:
        for f in {sh, *libs}:
            tf.add(os.path.realpath(f), arcname=str(f).lstrip("/"))
        link = tarfile.TarInfo("bin/sh")
        link.type, link.linkname = tarfile.SYMTYPE, str(sh)
        tf.addfile(link)
        tmp = tarfile.TarInfo("tmp")
        tmp.type, tmp.mode = tarfile.DIRTYPE, 0o1777
        tf.addfile(tmp)
    tag = "kvstack-test-sh-base:1"
    client.api.import_image(src=str(tar), repository=tag.split(":")[0], tag="1")
    return tag


def test_docker_build_of_the_checkout_says_to_use_installer_image(daemon, tmp_path):
    """`docker build .` at the root (no staged _work/, none of installer image's build arguments)
    stops at the Containerfile's first step, saying what to run; with the staging argument it gets
    past that step and stops at the first COPY of _work/ (where it used to stop, unexplained)."""
    client, _ = daemon
    checkout = tmp_path / "ctx"
    shutil.copytree(ROOT, checkout,
                    ignore=shutil.ignore_patterns(".git", ".venv", "_work", "__pycache__"))
    base = _shell_only_base(client, tmp_path)

    def build(**args) -> str:
        out = []
        for chunk in client.api.build(path=str(checkout), dockerfile="Containerfile", rm=True,
                                      forcerm=True, buildargs={"BASE_IMAGE": base, **args},
                                      decode=True, pull=False):
            out.append(chunk.get("stream", "") + chunk.get("error", ""))
        return "".join(out)
    plain = build()
    assert ("error: docker build . alone cannot make this image: its inputs are staged under "
            "_work/ by: python -m installer image --platform cpu|cuda|xpu") in plain, plain[-2000:]
    assert "returned a non-zero code: 1" in plain and "image-ca.crt" not in plain
    staged = build(KVSTACK_STAGED="1")
    assert "returned a non-zero code" not in staged, staged[-2000:]
    *_, copy, failed = staged.splitlines()
    assert "COPY _work/image-ca.crt" in copy and "image-ca.crt" in failed
