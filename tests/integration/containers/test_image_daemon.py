"""installer/image.py against a real dockerd this test starts (Debian's docker.io; overlay2, no
iptables, no bridge) and stops by its pid. Skipped with the reason when no daemon can start here
(not root, no dockerd); CI installs docker.io, so CI runs it. No registry is reachable: the build
below fails at FROM, which is the "base image missing and no registry" path."""
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from installer import image
from installer.errors import BuildError

pytestmark = pytest.mark.integration
docker = pytest.importorskip("docker")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    if os.geteuid() != 0 or not shutil.which("dockerd"):
        pytest.skip("no dockerd can start here (needs root and Debian's docker.io)")
    d = tmp_path_factory.mktemp("dockerd")
    sock = f"unix://{d}/sock"
    proc = subprocess.Popen(["dockerd", "--data-root", str(d / "root"), "--exec-root", str(d / "exec"),
                             "--pidfile", str(d / "pid"), "-H", sock, "--iptables=false", "--bridge=none"],
                            stdout=open(d / "log", "wb"), stderr=subprocess.STDOUT)
    try:
        for _ in range(60):
            try:
                client = image.connect({"DOCKER_HOST": sock})
                break
            except Exception:
                time.sleep(0.5)
        else:
            pytest.skip("dockerd did not answer: " + (d / "log").read_text()[-500:])
        yield client
    finally:
        proc.terminate()
        proc.wait(30)


def test_missing_base_without_registry_is_one_line_and_leaves_no_containers(daemon, tmp_path):
    checkout = tmp_path / "ctx"
    shutil.copytree(Path(image.__file__).resolve().parent.parent, checkout,
                    ignore=shutil.ignore_patterns(".git", ".venv", "_work", "__pycache__"))
    req = image.request("cpu", "kvstack-test:absent-base", "kvstack-absent-base:none")
    assert not image.base_is_local(daemon, req.base_image)
    lines = []
    with pytest.raises(BuildError) as e:
        image.build(daemon, req, checkout, lines.append)
    assert "\n" not in e.value.line() and "--base-image" in e.value.line()
    assert daemon.containers.list(all=True) == []
