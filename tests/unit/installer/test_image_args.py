"""installer/image.py: option checks and the Containerfile's build-argument mapping (no daemon)."""
import pytest

from installer import image
from installer.errors import UsageError


def test_default_base_image_per_platform():
    for p in image.PLATFORMS:
        req = image.request(p)
        assert req.base_image == image.BASE_IMAGES[p]
        assert req.tag == f"kvstack:{p}"
        args = image.build_args(req)
        assert args == {"PLATFORM": p, "BASE_IMAGE": image.BASE_IMAGES[p], "WITH_MIRROR": "0", "WITH_CA": "0"}
    assert "cuda" in image.BASE_IMAGES["cuda"] and "devel" in image.BASE_IMAGES["cuda"]


def test_mirror_and_ca_map_to_args(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "SHA256SUMS").write_text("")
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    req = image.request("cpu", "me/kv:1", "local/debian:12", str(tmp_path / "m"), str(ca))
    assert image.build_args(req) == {"PLATFORM": "cpu", "BASE_IMAGE": "local/debian:12",
                                     "WITH_MIRROR": "1", "WITH_CA": "1"}


@pytest.mark.parametrize("kw,needle", [
    ({"platform": "rocm"}, "--platform"),
    ({"platform": "cpu", "tag": "Bad Tag"}, "--tag"),
    ({"platform": "cpu", "base_image": "x;rm -rf /"}, "--base-image"),
])
def test_bad_options_are_one_line(kw, needle):
    with pytest.raises(UsageError) as e:
        image.request(**kw)
    assert needle in e.value.line() and "\n" not in e.value.line()


def test_bad_mirror_and_ca(tmp_path):
    with pytest.raises(UsageError, match="SHA256SUMS"):
        image.request("cpu", mirror=str(tmp_path))
    bad = tmp_path / "ca.pem"
    bad.write_text("not a cert")
    with pytest.raises(UsageError, match="PEM"):
        image.request("cpu", ca_bundle=str(bad))
    with pytest.raises(UsageError, match="cannot read"):
        image.request("cpu", ca_bundle=str(tmp_path / "absent.pem"))


def test_containerfile_declares_the_mapped_args():
    from pathlib import Path
    text = (Path(image.__file__).resolve().parent.parent / image.CONTAINERFILE).read_text()
    for arg in image.build_args(image.request("cpu")):
        assert f"ARG {arg}" in text, arg


def test_no_daemon_names_the_variable(monkeypatch):
    pytest.importorskip("docker")
    with pytest.raises(Exception) as e:
        image.connect({"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert "DOCKER_HOST" in str(e.value)
