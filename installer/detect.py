"""Which platform this host is: an NVIDIA driver means cuda, an Intel GPU that Level Zero can
drive means xpu, anything else cpu. `root` lets tests point at a fake /proc and /sys tree."""
from __future__ import annotations

import shutil
from pathlib import Path

INTEL_VENDOR = "0x8086"
DISPLAY_CLASS = "0x03"


def detect_platform(root: Path = Path("/"), which=shutil.which) -> tuple[str, str]:
    """Return (platform, reason)."""
    nvidia = root / "proc/driver/nvidia/version"
    if nvidia.exists():
        return "cuda", f"NVIDIA driver found ({nvidia})"
    if root == Path("/") and which("nvidia-smi"):
        return "cuda", "nvidia-smi found on PATH"
    for render in sorted((root / "sys/class/drm").glob("renderD*")):
        vendor = _read(render / "device/vendor")
        klass = _read(render / "device/class")
        if vendor == INTEL_VENDOR and klass.startswith(DISPLAY_CLASS):
            return "xpu", f"Intel GPU at {render.name} (vendor {vendor})"
    return "cpu", "no NVIDIA driver and no Intel GPU found"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip().lower()
    except OSError:
        return ""
