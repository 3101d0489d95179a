"""installer/image.py: option checks and the Containerfile's build-argument mapping (no daemon)."""
import pytest

from installer import image
from installer.errors import RecipeError, UsageError


def test_default_base_image_per_platform():
    for p in image.PLATFORMS:
        req = image.request(p)
        assert req.base_image == image.BASE_IMAGES[p]
        assert req.tag == f"kvstack:{p}"
        args = image.build_args(req)
        rdma = (
            "libibverbs1 librdmacm1 ibverbs-providers",
            "libibverbs.so.1",
        )  # every platform's UCX links it
        pkgs, lib = (f"libze1 {rdma[0]}", f"libze_loader.so.1 {rdma[1]}") if p == "xpu" else rdma
        assert args == {"PLATFORM": p, "VARIANT": "", "BASE_IMAGE": image.BASE_IMAGES[p],
                        "RUNTIME_BASE_IMAGE": image.BASE_IMAGES[p], "WITH_MIRROR": "0",
                        "WITH_CA": "0", "WITH_OVERLAYS": "0", "WITH_WHEELS": "0",
                        "WITH_BINARY_CACHE": "0", "OFFLINE": "0",
                        "RUNTIME_PACKAGES": pkgs, "RUNTIME_LIBRARY": lib,
                        "KVSTACK_STAGED": "1"}
    assert "cuda" in image.BASE_IMAGES["cuda"] and "devel" in image.BASE_IMAGES["cuda"]


def test_mirror_and_ca_map_to_args(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "SHA256SUMS").write_text("")
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    req = image.request("cpu", "me/kv:1", "local/debian:12", str(tmp_path / "m"), str(ca))
    assert image.build_args(req) == {
        "PLATFORM": "cpu",
        "VARIANT": "",
        "BASE_IMAGE": "local/debian:12",
        "RUNTIME_BASE_IMAGE": "local/debian:12",
        "WITH_MIRROR": "1",
        "WITH_CA": "1",
        "WITH_OVERLAYS": "0",
        "WITH_WHEELS": "0",
        "WITH_BINARY_CACHE": "0",
        "OFFLINE": "0",
        "RUNTIME_PACKAGES": image.RDMA_CORE[0],
        "RUNTIME_LIBRARY": image.RDMA_CORE[1],
        "KVSTACK_STAGED": "1",
    }


def test_a_binary_cache_maps_to_its_arg_and_one_without_a_build_is_one_line(tmp_path):
    (tmp_path / "cache" / "cpu-0123456789ab").mkdir(parents=True)
    with pytest.raises(UsageError) as e:
        image.request("cpu", binary_cache=str(tmp_path / "cache"))
    assert (
        "--binary-cache" in e.value.line()
        and "no published build" in e.value.line()
        and "\n" not in e.value.line()
    )
    (tmp_path / "cache" / "cpu-0123456789ab" / "manifest.json").write_text("{}")
    req = image.request("cpu", binary_cache=str(tmp_path / "cache"))
    assert (
        req.binary_cache == (tmp_path / "cache").resolve()
        and image.build_args(req)["WITH_BINARY_CACHE"] == "1"
    )


def test_offline_builds_with_no_network_and_needs_wheels(tmp_path):
    with pytest.raises(UsageError) as e:
        image.request("cpu", offline=True)
    line = e.value.line()
    assert "--offline" in line and "--wheels" in line and "\n" not in line
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "numpy-2.0.0-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    req = image.request("cpu", wheels=str(tmp_path / "w"), offline=True,
                        runtime_base_image="local/runtime:12")
    assert image.build_args(req)["OFFLINE"] == "1" and image.network_mode(req) == "none"
    assert image.build_args(req)["RUNTIME_BASE_IMAGE"] == "local/runtime:12"
    req = image.request("cpu", wheels=str(tmp_path / "w"))
    assert image.build_args(req)["OFFLINE"] == "0" and image.network_mode(req) == "host"


def test_xpu_image_takes_the_ze_ipc_variant():
    req = image.request("xpu", variant="ze-ipc")
    assert req.tag == "kvstack:xpu-ze-ipc" and req.base_image == image.BASE_IMAGES["xpu"]
    assert image.build_args(req)["VARIANT"] == "ze-ipc"
    with pytest.raises(RecipeError) as e:   # before any image is built
        image.request("xpu", variant="ze_ipc")
    assert "no variant 'ze_ipc'" in e.value.line() and "\n" not in e.value.line()


@pytest.mark.parametrize("kw,needle", [
    ({"platform": "rocm"}, "--platform"),
    ({"platform": "cpu", "tag": "Bad Tag"}, "--tag"),
    ({"platform": "cpu", "base_image": "x;rm -rf /"}, "--base-image"),
    ({"platform": "cpu", "runtime_base_image": "x;rm -rf /"}, "--runtime-base-image"),
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
    # the runtime stage installs the platform's runtime packages too (each stage declares its ARGs)
    runtime = text[text.index(" AS runtime"):]
    assert "ARG RUNTIME_PACKAGES" in runtime and "ARG RUNTIME_LIBRARY" in runtime


def test_staged_context_always_has_the_ca_file_and_the_wheels_directory(tmp_path):
    """The Containerfile copies both by name before the checkout (its platform-free layers)."""
    image.stage_context(image.request("cpu"), tmp_path)
    assert (tmp_path / image.CA_FILE).read_text() == "" and not any(
        (tmp_path / image.WHEEL_DIR).iterdir()
    )
    image.unstage_context(tmp_path)
    assert not (tmp_path / image.WHEEL_DIR).exists() and not (tmp_path / image.CA_FILE).exists()


def test_no_daemon_names_the_variable(monkeypatch):
    pytest.importorskip("docker")
    with pytest.raises(Exception) as e:
        image.connect({"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert "DOCKER_HOST" in str(e.value)


OVERLAY = """
[components.nixl]
enabled = false
[components.abseil]
enabled = false
[components.asio]
enabled = false
"""


def _wheels(tmp_path):
    w = tmp_path / "wheels"
    w.mkdir()
    (w / "nixl_cu12-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"PK")
    return w


def test_overlays_and_wheels_map_to_args_and_staged_files(tmp_path):
    a, b = tmp_path / "b-first.toml", tmp_path / "a-second.toml"
    a.write_text(OVERLAY)
    b.write_text('[runtime]\nkv_buffer = "host"\n')
    req = image.request("cpu", overlays=[str(a), str(b)], wheels=str(_wheels(tmp_path)))
    args = image.build_args(req)
    assert (
        args["WITH_OVERLAYS"] == "1" and args["WITH_WHEELS"] == "1" and args["WITH_MIRROR"] == "0"
    )
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    image.stage_context(req, ctx)
    # the Containerfile takes overlays in glob order: the order given must survive the names
    assert sorted(p.name for p in (ctx / image.OVERLAY_DIR).iterdir()) == [
        "00-b-first.toml",
        "01-a-second.toml",
    ]
    assert (ctx / image.OVERLAY_DIR / "00-b-first.toml").read_text() == OVERLAY
    assert [p.name for p in (ctx / image.WHEEL_DIR).iterdir()] == [
        "nixl_cu12-1.5.1-cp311-cp311-manylinux_2_28_x86_64.whl"
    ]
    image.unstage_context(ctx)
    assert not (ctx / "_work").exists() or not any((ctx / "_work").iterdir())


def test_bad_overlay_or_wheels_are_one_line(tmp_path):
    with pytest.raises(UsageError, match="no such file") as e:
        image.request("cpu", overlays=[str(tmp_path / "absent.toml")])
    assert "\n" not in e.value.line()
    bad = tmp_path / "bad.toml"
    bad.write_text("[components.ucx]\nsorce = 'x'\n")
    from installer.errors import InstallerError

    with pytest.raises(
        InstallerError
    ) as e:  # the recipe loader's own line (unknown key, did you mean)
        image.request("cpu", overlays=[str(bad)])
    assert "sorce" in e.value.line() and "\n" not in e.value.line()
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no .whl files"):
        image.request("cpu", wheels=str(tmp_path / "empty"))


def test_build_stage_tag():
    assert image.build_tag("kvstack:cpu") == "kvstack:cpu-build"
    assert image.build_tag("kvstack") == "kvstack:build"
    assert image.build_tag("localhost:5000/kv/stack") == "localhost:5000/kv/stack:build"
    assert image.build_tag("localhost:5000/kv:1") == "localhost:5000/kv:1-build"


MANIFEST = {
    "recipe": {
        "sources": {
            "ucx-debian": {
                "url": "https://debian.invalid/ucx_1.13.1-1.dsc",
                "filename": "ucx-1.13.1-1-debian.tar.gz",
                "sha256": "5e66" * 16,
            },
            "nixl": {
                "url": "https://github.com/ai-dynamo/nixl/archive/refs/tags/v1.4.0.tar.gz",
                "filename": "nixl-1.4.0.tar.gz",
                "sha256": "827f" * 16,
            },
        },
        "components": {"ucx": {"source": "ucx-debian"}},
    }
}


def test_parts_say_where_each_part_came_from():
    nixl = {
        "name": "nixl_cu12",
        "file": "/opt/venv/lib/python3.11/site-packages/nixl_cu12/__init__.py",
    }
    parts = image.parts(MANIFEST, {"nixl-cu12": "1.5.1", "torch": "2.13.0+cpu"}, nixl)
    assert parts[0] == {
        "part": "ucx",
        "from": "source",
        "source": "ucx-debian",
        "file": "ucx-1.13.1-1-debian.tar.gz",
        "sha256": "5e66" * 16,
        "url": "https://debian.invalid/ucx_1.13.1-1.dsc",
        "version": "1.13.1",
        "binary_cache": None,
    }
    assert (
        parts[1]["from"] == "wheel"
        and parts[1]["distribution"] == "nixl-cu12"
        and parts[1]["version"] == "1.5.1"
    )
    built = {
        "recipe": {
            **MANIFEST["recipe"],
            "components": {"ucx": {"source": "ucx-debian"}, "nixl": {"source": "nixl"}},
        }
    }
    assert image.parts(built, {}, nixl)[1]["from"] == "source"  # a built NIXL wins over any wheel
    assert image.parts(MANIFEST, {}, None)[1] == {"part": "nixl", "from": None}
    res = {"parts": parts, "tag": "kvstack:cpu", "size": 2 ** 30, "base_size": 2 ** 20,
           "build_stage": {"tag": "kvstack:cpu-build", "size": 2 ** 31}}
    lines = image.render_parts(res)
    assert lines[0].startswith(
        "ucx: 1.13.1 built from source ucx-debian (ucx-1.13.1-1-debian.tar.gz"
    )
    assert lines[1].startswith("nixl: nixl-cu12 1.5.1 wheel")
    assert (
        lines[2]
        == "sizes: runtime stage kvstack:cpu 1024 MiB, build stage kvstack:cpu-build 2048 MiB "
           "(base 1 MiB)"
    )
    cached = image.parts(
        {**built, "binary_cache": {"built_in": "/ci/_work/pinned/cpu.builds/cpu-1"}}, {}, nixl
    )
    assert [p["binary_cache"] for p in cached] == ["/ci/_work/pinned/cpu.builds/cpu-1"] * 2
    assert image.render_parts({**res, "parts": cached})[0].endswith(
        ", taken from a binary cache (built in /ci/_work/pinned/cpu.builds/cpu-1)")
