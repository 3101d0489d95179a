"""RDMA in the build: what the recipe asks of UCX, and whether this host can build it.

UCX reaches other hosts over verbs (rc, ud, dc; the mlx5 and efa providers), with rdmacm for
connection setup and device memory (dm). It is compiled against the host's rdma-core, the
distribution's libibverbs-dev and librdmacm-dev, not a private copy built into the prefix:

- libibverbs loads its providers (libmlx5, libefa, ...) from the host's rdma-core, and a
  provider must come from the same rdma-core as the libibverbs that loads it: the host's are
  the ones that match the host's kernel drivers and configuration (/etc/libibverbs.d).
- A second libibverbs in one process clashes with the host's, which NCCL and the engines load
  too (NIXL PR #1929, against the private libibverbs its own wheel bundles).
- Every current distribution has a new enough rdma-core (Debian 12: 44, Ubuntu 24.04: 50,
  RHEL 9: 46+). The floor is a capability, not a version: ``ibv_reg_dmabuf_mr`` (rdma-core 34),
  which registers GPU memory through a DMA-BUF (GPUDirect RDMA for Intel Xe, UCX e5d9887970;
  NVIDIA GPUs without nvidia-peermem).
- The build links against libibverbs.so.1 and librdmacm.so.1 by soname: UCX's ib modules then
  need the symbol versions of the build host's rdma-core or newer where they run. A host without
  rdma-core loads UCX without those modules (UCX skips a module it cannot load) and still moves
  bytes on one host; the manifest records the build host's rdma-core.

Everything here is a check on paths and text: nothing is compiled.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any, Mapping

from .errors import SystemPackagesError

# UCX `with` key -> (the header its configure looks for, the Debian package that has it)
HEADERS: dict[str, tuple[str, str]] = {
    "verbs": ("infiniband/verbs.h", "libibverbs-dev"),
    "rdmacm": ("rdma/rdma_cma.h", "librdmacm-dev"),
    "mlx5": ("infiniband/mlx5dv.h", "libibverbs-dev"),
    "efa": ("infiniband/efadv.h", "libibverbs-dev"),
}
# (symbol in verbs.h, the rdma-core that brought it, what needs it)
FLOOR = ("ibv_reg_dmabuf_mr", "rdma-core 34",
         "GPU memory registered by the IB domain through a DMA-BUF (GPUDirect RDMA)")
WHAT = {"verbs": "InfiniBand/RoCE transports rc, ud, dc", "rdmacm": "RDMA connection setup",
        "dm": "device memory on the NIC", "mlx5": "ConnectX provider (rc_mlx5, dc_mlx5, ud_mlx5)",
        "efa": "AWS EFA provider (srd)", "gdrcopy": "GPU memory mapped for the CPU (gdr_copy)"}
OFF = (False, "no")


def wanted(with_table: Mapping[str, Any]) -> list[str]:
    """The RDMA parts the recipe turns on, in HEADERS' order (none when verbs is off)."""
    if with_table.get("verbs", False) in OFF:
        return []
    return [k for k in HEADERS if with_table.get(k, k == "verbs") not in OFF]


def include_dir(with_table: Mapping[str, Any]) -> Path:
    """Where UCX's configure looks for the verbs headers: --with-verbs=DIR, else /usr."""
    value = with_table.get("verbs")
    return (
        Path(value if isinstance(value, str) and value not in ("yes", "") else "/usr") / "include"
    )


def plan_lines(with_table: Mapping[str, Any]) -> list[str]:
    """The RDMA choices as `--dry-run` shows them, each with why."""
    parts = wanted(with_table)
    if not parts:
        return ["  none: UCX without verbs (KV moves between processes of one host only)"]
    lines = [f"  {k:9} {WHAT[k]}" for k in ("verbs", "rdmacm", "dm", "mlx5", "efa")
             if k in parts or (k == "dm" and with_table.get("dm", True) not in OFF)]
    gdr = with_table.get("gdrcopy", False)
    lines.append(f"  {'gdrcopy':9} " + (f"{WHAT['gdrcopy']}, from {gdr}" if gdr not in OFF
                                         else "off (no GPU memory mapped for the CPU)"))
    lines.append(f"  from      the host's rdma-core under {include_dir(with_table)} (not a private "
                 f"copy: installer/rdma.py says why); floor {FLOOR[0]} ({FLOOR[1]})")
    return lines


def host_problems(with_table: Mapping[str, Any], include: Path | None = None) -> list[str]:
    """What this host lacks to build the recipe's RDMA parts: one entry per missing header or
    capability, naming the package that brings it."""
    include = include or include_dir(with_table)
    problems = []
    for key in wanted(with_table):
        header, package = HEADERS[key]
        if not (include / header).is_file():
            problems.append(f"{key}: {include / header} is missing (package {package})")
    verbs_h = include / HEADERS["verbs"][0]
    if "verbs" in wanted(with_table) and verbs_h.is_file():
        try:
            text = verbs_h.read_text(errors="replace")
        except OSError as e:
            text = ""
            problems.append(f"verbs: {verbs_h} cannot be read ({e.strerror})")
        if text and not re.search(rf"\b{FLOOR[0]}\b", text):
            problems.append(
                f"verbs: {verbs_h} has no {FLOOR[0]} (older than {FLOOR[1]}; needed for {FLOOR[2]})"
            )
    return problems


def check_host(with_table: Mapping[str, Any], include: Path | None = None) -> None:
    """Stop before anything builds when the host cannot build the recipe's RDMA parts."""
    problems = host_problems(with_table, include)
    if problems:
        packages = sorted({HEADERS[p.split(":", 1)[0]][1] for p in problems})
        raise SystemPackagesError(
            "this host cannot build UCX's RDMA parts: " + "; ".join(problems),
            fix=f"install {' '.join(packages)} (rdma-core 34 or newer), or turn the part off in a "
                f"--recipe-overlay ([components.ucx.with] verbs = false builds no RDMA at all)")


def rdma_core_version(env: Mapping[str, str] | None = None) -> str | None:
    """The build host's rdma-core as its libibverbs.pc says (e.g. "1.14.44.0" for 44), or None."""
    try:
        r = subprocess.run(
            ["pkg-config", "--modversion", "libibverbs"],
            capture_output=True,
            text=True,
            timeout=30,
            env=dict(env) if env is not None else None,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None
