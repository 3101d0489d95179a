from pathlib import Path

from installer.detect import detect_platform


def _render(root: Path, name: str, vendor: str, klass: str = "0x030000"):
    dev = root / "sys/class/drm" / name / "device"
    dev.mkdir(parents=True)
    (dev / "vendor").write_text(vendor + "\n")
    (dev / "class").write_text(klass + "\n")


def test_nvidia_driver_means_cuda(tmp_path):
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    (tmp_path / "proc/driver/nvidia/version").write_text("NVRM version: 580\n")
    _render(tmp_path, "renderD128", "0x8086")
    assert detect_platform(tmp_path)[0] == "cuda"


def test_intel_gpu_means_xpu(tmp_path):
    _render(tmp_path, "renderD128", "0x8086")
    platform, reason = detect_platform(tmp_path)
    assert platform == "xpu" and "renderD128" in reason


def test_other_gpu_or_intel_non_display_means_cpu(tmp_path):
    _render(tmp_path, "renderD128", "0x1af4")            # virtio-gpu
    _render(tmp_path, "renderD129", "0x8086", "0x120000")  # an Intel accelerator, not a GPU
    assert detect_platform(tmp_path)[0] == "cpu"


def test_nothing_means_cpu(tmp_path):
    assert detect_platform(tmp_path) == ("cpu", "no NVIDIA driver and no Intel GPU found")
