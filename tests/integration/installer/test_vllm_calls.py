"""vLLM's NIXL calls on a real build: two processes, real NIXL agents over the build's UCX,
NIXL loaded as vLLM loads it (`from nixl._api import nixl_agent, nixl_agent_config`), host
host memory (and VRAM where a cuda build and a GPU are here), bit-exact (vllm_calls_pair.py
makes the calls).

The sequence is NixlConnectorWorker's in vllm-project/vllm at commit
002a1057e9ae674d7bdc9c4be95bc29d65d2e808 (vllm/distributed/kv_transfer/kv_connector/v1/
nixl_connector.py): nixl_agent(uuid, nixl_agent_config(num_threads=4, capture_telemetry=True));
register_kv_caches: get_reg_descs([(base, size, device, "")], "DRAM"), register_memory,
get_xfer_descs of every (region, block), prep_xfer_dlist("NIXL_INIT_AGENT", ...),
get_agent_metadata; add_remote_agent: add_remote_agent(metadata), prep_xfer_dlist(remote name,
the remote's blocks); _read_blocks: make_prepped_xfer("READ", local, ids, remote, ids,
notif_msg=b"<request>:<world size>"), transfer, check_xfer_state until DONE,
get_xfer_telemetry, release_xfer_handle; a full prefix hit: send_notif; the prefill's
get_new_notifs; shutdown: release_dlist_handle, remove_remote_agent, deregister_memory. A WRITE
with a notification is made the same way (vLLM's connector only READs; NIXL's WRITE path is the
push engines use).

Runs on each pinned build named by KVSTACK_PINNED_PREFIX_CPU, _XPU, _XPU_IPC (ci/pinned-builds.sh)
and skips, saying so, for each one not set; on VRAM with the cuda build KVSTACK_PINNED_PREFIX_CUDA
names, on a GPU host (one GPU, and two where there are two)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from installer import envfile, nixlpackage

pytestmark = [pytest.mark.integration, pytest.mark.build]
PAIR = Path(__file__).with_name("vllm_calls_pair.py")
PINNED = ("CPU", "XPU", "XPU_IPC")


ROOT = Path(__file__).resolve().parents[3]


def _pinned(which: str, tmp_path: Path):
    """(build directory, its NIXL module, the `nixl` site, environment, Python) for the pinned
    build KVSTACK_PINNED_PREFIX_<which>; skips without one."""
    prefix = os.environ.get(f"KVSTACK_PINNED_PREFIX_{which}")
    if not prefix:
        pytest.skip(f"KVSTACK_PINNED_PREFIX_{which} names no pinned build (ci/pinned-builds.sh)")
    build = Path(prefix).resolve()
    manifest = json.loads((build / "manifest.json").read_text())
    backend = envfile.nixl_module(build, manifest["recipe"]["verify"]["nixl"]["module"])
    assert backend, f"{prefix} has no NIXL module"
    # the build's own `nixl`; one installed before kvstack wrote it gets it written beside
    site = nixlpackage.site_for(build, backend, manifest["platform"], manifest["build_id"],
                                tmp_path / "site")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "NIXL_"))}
    path = f"{site}:{manifest['env']['PYTHONPATH']}"
    env = envfile.apply({**manifest["env"], "PYTHONPATH": path}, base)
    py = str(manifest["python"]["path"])  # the Python the build's module was compiled for
    py = py if os.path.exists(py) else sys.executable
    return build, backend, site, env, py


def _vllm_pair(which: str, devices: tuple[str, str], tmp_path: Path) -> None:
    """Runs vllm_calls_pair.py (decode on devices[0], prefill on devices[1]) and checks it all."""
    build, backend, site, env, py = _pinned(which, tmp_path)
    r = subprocess.run([py, "-W", "ignore::RuntimeWarning", str(PAIR), "decode", *devices],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    out = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("VLLM "))[5:])
    kinds = ["VRAM" if d.startswith("cuda") else "DRAM" for d in devices]
    assert out["memory"] == kinds, out["memory"]
    assert out["states"] == {"READ": "DONE", "WRITE": "DONE"}, out
    assert out["read"], "READ blocks differ from the prefill's"
    assert out["telemetry_bytes"] == {"READ": 4 * 3 * (64 << 10), "WRITE": 4 * 2 * (64 << 10)}
    pre = out["prefill"]
    assert pre["written"] and pre["untouched"], pre
    assert pre["notifs"] == ["req-hit:1", "req-read:1", "req-write:1"], pre
    assert pre["senders"] == [out["decode_name"]] and out["prefill_rc"] == 0, out
    # `import nixl` was kvstack's, bound to this build's module, with this build's UCX only
    assert out["nixl"] == str(site / "nixl" / "__init__.py"), out["nixl"]
    assert Path(out["api"]).resolve() == (envfile.nixl_site_packages(build) / backend / "_api.py")
    for side, maps in (("decode", out["maps"]), ("prefill", pre["maps"])):
        ucp = [m for m in maps if "/libucp" in m]
        assert len(ucp) == 1 and ucp[0].startswith(str(build)), (side, maps)


@pytest.mark.parametrize("which", PINNED)
def test_vllms_nixl_calls_move_kv_bit_exact_through_import_nixl(which, tmp_path):
    _vllm_pair(which, ("cpu", "cpu"), tmp_path)


@pytest.mark.parametrize("devices", [("cuda:0", "cuda:0"), ("cuda:0", "cuda:1")],
                         ids=["one-gpu", "two-gpus"])
def test_vllms_nixl_calls_move_vram_bit_exact_on_the_cuda_build(devices, tmp_path):
    """vLLM's kv_buffer_device=cuda: both caches in VRAM, registered as NIXL's VRAM with their
    GPU's id; on one GPU (cuda_ipc within a device) and across two (peer access/NVLink)."""
    torch = pytest.importorskip("torch")
    need = 1 + int(devices[1] != devices[0])
    if not torch.cuda.is_available() or torch.cuda.device_count() < need:
        pytest.skip(f"needs {need} CUDA GPU(s); this host has "
                    f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    _vllm_pair("CUDA", devices, tmp_path)


@pytest.mark.parametrize("which", PINNED)
def test_kvruntime_which_names_the_builds_nixl_and_ucx(which, tmp_path):
    """`python -m kvruntime which` (README: which NIXL and UCX a process loaded) on the build."""
    build, backend, site, env, py = _pinned(which, tmp_path)
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{ROOT}"
    r = subprocess.run([py, "-W", "ignore::RuntimeWarning", "-m", "kvruntime", "which", "--json"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(r.stdout[r.stdout.index("{"):])
    assert info["file"] == str(site / "nixl" / "__init__.py")
    assert info["kvstack"]["backend"] == backend
    assert len(info["ucp"]) == 1 and info["ucp"][0].startswith(str(build / "ucx" / "lib")), info
    assert info["ucx_info"] == str(build / "ucx" / "bin" / "ucx_info")
    assert {"tcp", "posix"} <= set(info["transports"]), info["transports"]
