"""Mixed-TP groups with every rank a process of its own on its own GPU (bench's ``--scenario``):
the rows come back whole, every decode rank bit-exact, no device memory over TCP, each rank
placed as the scenario says. Skipped, with the reason, where torch sees fewer than two CUDA
devices. No timings are asserted: figures go to BENCHMARKS.md (ci/gpu-tp.sh)."""

import json
import subprocess
import sys

import pytest

from kvruntime.memory import device_unavailable

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

_why_not = device_unavailable("cuda")
if _why_not is not None:
    pytest.skip(f"no CUDA memory here: {_why_not}", allow_module_level=True)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.parametrize("scenario,need", [("tp-2gpu", 2), ("tp-4gpu", 4)])
def test_a_scenario_runs_every_rank_on_its_gpu_bit_exact(scenario, need):
    if _gpus() < need:
        pytest.skip(f"{scenario} needs {need} GPUs; torch sees {_gpus()}")
    r = subprocess.run([sys.executable, "-m", "kvruntime", "bench", "--json", "--compact",
                        "--device", "cuda", "--scenario", scenario, "--sizes", "16", "--iters",
                        "1"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    rows = json.loads(r.stdout)["tp"]
    ran = [row for row in rows if "skipped" not in row]
    assert ran and all("error" not in row for row in rows), rows
    for row in ran:
        assert row["bit_exact"] and not row["tcp_for_device_memory"], row
        assert row["memory"] == "VRAM" and row["total"]["ref_gbps"] > 0
        for rank in row["ranks"]:
            assert rank["device_id"] == row["placement"]["decode"][rank["instance"]][rank["rank"]]
    # the same-node engine copies head slices of device memory: no group skips it
    assert {row["engine"] for row in ran} >= {"samenode", "nixl", "staged"}
    first = next(row for row in ran if row["group"] == rows[0]["group"])
    if scenario == "tp-4gpu":  # prefill TP2 on GPUs 0,1 -> decode TP2 on 2,3
        assert first["placement"] == {"prefill": [0, 1], "decode": [[2, 3]]}
    else:  # prefill TP2 on 0,1 -> decode TP1 on 0 (three ranks, two GPUs)
        assert first["placement"] == {"prefill": [0, 1], "decode": [[0]]}
