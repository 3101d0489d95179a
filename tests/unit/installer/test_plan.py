"""The whole plan of every platform, compared with a reviewed snapshot (regenerate with
KVSTACK_UPDATE_SNAPSHOTS=1 and read the diff), plus the facts each platform must show."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from installer import recipe
from installer.errors import UsageError
from installer.plan import Target, make_plan

SNAPSHOTS = Path(__file__).parent / "snapshots"
TARGET = Target("/usr/bin/python3", "3.11", "cp311")


def _plan(platform, variant=None, **kw):
    args = dict(prefix=Path("/opt/kvstack"), cache_dir=Path("/cache"), jobs=2, target=TARGET,
                platform_reason="chosen with --platform", cuda_home="/usr/local/cuda")
    args.update(kw)
    return make_plan(recipe.load(platform, variant=variant), **args)


def _normalized(plan) -> dict:
    text = json.dumps(plan.to_dict(), indent=2, sort_keys=True)
    return json.loads(text.replace(str(recipe.RECIPES_DIR), "<recipes>"))


CHOICES = [(p, None) for p in recipe.PLATFORMS] + [
    (p, v) for p in recipe.PLATFORMS for v in recipe.variants(p)
]


@pytest.mark.parametrize("platform,variant", CHOICES)
def test_plan_matches_snapshot(platform, variant):
    got = _normalized(_plan(platform, variant))
    path = SNAPSHOTS / f"plan-{platform}{'-' + variant if variant else ''}.json"
    if os.environ.get("KVSTACK_UPDATE_SNAPSHOTS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=2, sort_keys=True) + "\n")
    assert got == json.loads(path.read_text())


def _step(plan, comp, name):
    c = next(c for c in plan.components if c.name == comp)
    return next(s for s in c.steps if s.name == name)


def test_xpu_plan_shows_what_the_issue_asks():
    plan = _plan("xpu")
    text = plan.render()
    for needle in [
        "8a6b06fb880accbb933a79cda893883872c68d9d",
        "--with-ze=yes",
        "--without-java",
        "--without-go",
        "UCX_MEMTYPE_CACHE=n",
        "c0a1102b94d173049a5478c23e765ba37681e2ca",
        "-Dwheel_variant=xpu",
        "--wrap-mode=nodownload",
        "libze-dev",
        "host (access",
    ]:
        assert needle in text, needle
    for sub in ("taskflow", "tomlplusplus", "abseil", "asio"):
        assert plan.sources[sub]["sha256"] in text


def test_xpu_ze_ipc_plan_marks_its_ucx_as_an_unreleased_pull_request():
    plan = _plan("xpu", "ze-ipc")
    text = plan.render()
    assert text.startswith("kvstack install plan: platform xpu, variant ze-ipc (")
    ucx = [line.strip() for line in text.splitlines()[text.splitlines().index("sources:") + 1:][:4]]
    assert ucx == [
        "ucx           "
        "https://github.com/openucx/ucx/archive/b8d6012325b5fe026a94be537009f486ed2b9d40.tar.gz",
        "sha256 6f74a01a1eafba230592a5d99dedfe550eedf4a5a9479534e210c098359f8b14",
        "commit b8d6012325b5fe026a94be537009f486ed2b9d40 (no tag: pinned by commit alone)",
        'UNRELEASED: upstream pull request 11218 "UCT/ZE/ZE_IPC: enable level zero ipc support for '
        'Intel GPUs" '
        "(https://github.com/openucx/ucx/pull/11218)",
    ]
    assert "v1.22.0" not in text
    assert "transports ['tcp', 'posix', 'sysv', 'cma', 'ze_copy', 'ze_ipc']" in text
    assert "--with-ze=yes" in _step(plan, "ucx", "configure").argv
    d = plan.to_dict()
    assert d["variant"] == "ze-ipc" and list(d["unreleased"]) == ["ucx"]
    assert d["unreleased"]["ucx"]["number"] == 11218
    # the release pin is untouched, and a variant is its own build
    release = _plan("xpu")
    assert release.to_dict()["unreleased"] == {} and release.to_dict()["variant"] is None
    assert "(tag v1.22.0)" in release.render() and release.build_id != plan.build_id


def test_cuda_has_cuda_and_cpu_has_neither():
    cuda = _step(_plan("cuda"), "ucx", "configure").argv
    assert "--with-cuda=/usr/local/cuda" in cuda and "--without-ze" in cuda
    cpu = _step(_plan("cpu"), "ucx", "configure").argv
    assert "--without-cuda" in cpu and "--without-ze" in cpu
    assert not any("-mavx" in a or a == "--enable-optimizations" for a in cpu)


def test_nixl_builds_against_the_ucx_it_just_built():
    plan = _plan("cpu")
    setup = _step(plan, "nixl", "meson-setup").argv
    assert f"-Ducx_path={plan.install_dir / 'ucx'}" in setup
    nixl = next(c for c in plan.components if c.name == "nixl")
    assert str(plan.install_dir / "abseil" / "lib" / "pkgconfig") in nixl.env["PKG_CONFIG_PATH"]
    assert nixl.env["CUDA_HOME"] == "/nonexistent"


def test_tpu_is_the_cpu_stack_with_host_staging():
    cpu, tpu = _plan("cpu"), _plan("tpu")

    def flags(plan):  # the command lines, less the paths that carry the build id
        return [[a for a in s.argv if "/" not in a] for c in plan.components for s in c.steps]
    assert flags(cpu) == flags(tpu)
    assert tpu.kv_buffer == "host_staged" and cpu.kv_buffer == "host"


def test_build_id_is_stable_and_changes_with_the_recipe(tmp_path):
    a, b = _plan("cpu"), _plan("cpu", jobs=7)
    assert a.build_id == b.build_id  # jobs do not change what is built
    o = tmp_path / "o.toml"
    o.write_text("[components.ucx.enable]\ndebug = true\n")
    c = make_plan(
        recipe.load("cpu", [o]),
        prefix=Path("/opt/kvstack"),
        cache_dir=Path("/cache"),
        jobs=2,
        target=TARGET,
        platform_reason="x",
    )
    assert c.build_id != a.build_id
    assert (
        _plan("cpu", target=Target("/usr/bin/python3.12", "3.12", "cp312")).build_id != a.build_id
    )


def test_prefix_is_a_link_to_a_build_directory():
    plan = _plan("cpu")
    assert plan.install_dir == Path("/opt/kvstack.builds") / plan.build_id


def test_bad_jobs_and_root_prefix_are_refused():
    with pytest.raises(UsageError, match="--jobs"):
        _plan("cpu", jobs=0)
    with pytest.raises(UsageError, match="root directory"):
        _plan("cpu", prefix=Path("/"))
