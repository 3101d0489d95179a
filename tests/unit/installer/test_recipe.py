"""Recipes: every platform loads; every kind of bad recipe is refused with one clear line."""
from __future__ import annotations

import pytest

from installer import recipe
from installer.errors import RecipeError


@pytest.mark.parametrize("platform", recipe.PLATFORMS)
def test_every_platform_loads_and_pins_every_source(platform):
    r = recipe.load(platform)
    assert r.platform == platform
    for name, src in r.sources.items():
        assert len(src["sha256"]) == 64, name
    # cuda's UCX builds against gdrcopy's user library, built first from its pinned source
    first = ["gdrcopy"] if platform == "cuda" else []
    assert r.build_order() == [*first, "ucx", "abseil", "asio", "nixl"]


def test_xpu_pins_a_ucx_holding_the_level_zero_commit_and_says_why():
    r = recipe.load("xpu")
    assert r.sources["ucx"]["commit"] == "8a6b06fb880accbb933a79cda893883872c68d9d"
    assert r.components["ucx"]["with"]["ze"] == "yes"
    assert r.data["runtime"]["env"]["UCX_MEMTYPE_CACHE"] == "n"
    text = (recipe.RECIPES_DIR / "defaults.toml").read_text()
    assert "e5d9887970" in text and "PR 11180" in text


def _overlay(tmp_path, text):
    p = tmp_path / "overlay.toml"
    p.write_text(text)
    return p


def test_unknown_key_is_refused_with_did_you_mean(tmp_path):
    o = _overlay(tmp_path, '[sources.ucx]\nsha265 = "x"\n')
    with pytest.raises(RecipeError) as e:
        recipe.load("cpu", [o])
    line = e.value.line()
    assert "unknown key 'sources.ucx.sha265'" in line and "did you mean 'sha256'" in line
    assert str(o) in line


def test_unknown_component_key_is_refused(tmp_path):
    o = _overlay(tmp_path, '[components.ucx]\nwtih = {ze = true}\n')
    with pytest.raises(RecipeError, match="did you mean 'with'"):
        recipe.load("cpu", [o])


def test_unknown_top_level_key(tmp_path):
    o = _overlay(tmp_path, 'plattform = "cpu"\n')
    with pytest.raises(RecipeError, match="did you mean 'platform'"):
        recipe.load("cpu", [o])


def test_malformed_toml_names_file_and_position(tmp_path):
    o = _overlay(tmp_path, '[sources.ucx\nurl = 1\n')
    with pytest.raises(RecipeError) as e:
        recipe.load("cpu", [o])
    assert "malformed TOML" in str(e.value) and str(o) in str(e.value) and "line 1" in str(e.value)


def test_source_without_pin_is_refused(tmp_path):
    o = _overlay(
        tmp_path,
        '[sources.extra]\nurl = "https://example.invalid/x.tar.gz"\nfilename = "x.tar.gz"\n',
    )
    with pytest.raises(RecipeError, match="source 'extra' has no pin"):
        recipe.load("cpu", [o])


def test_git_source_without_commit_is_refused(tmp_path):
    o = _overlay(
        tmp_path,
        '[sources.extra]\nkind = "git"\nurl = "https://example.invalid/x.git"\ntag = "v1"\n',
    )
    with pytest.raises(RecipeError, match="git source 'extra' has no pin"):
        recipe.load("cpu", [o])


def test_malformed_sha256_is_refused(tmp_path):
    o = _overlay(tmp_path, '[sources.ucx]\nsha256 = "abc"\n')
    with pytest.raises(RecipeError, match="sources.ucx.sha256 is not a valid pin"):
        recipe.load("cpu", [o])


def test_short_commit_is_refused(tmp_path):
    o = _overlay(tmp_path, '[sources.ucx]\ncommit = "e5d9887970"\n')
    with pytest.raises(RecipeError, match="not a valid pin.*40"):
        recipe.load("cpu", [o])


def test_unknown_platform_suggests_the_closest():
    with pytest.raises(RecipeError) as e:
        recipe.load("xpuu")
    assert "unknown platform 'xpuu'" in e.value.line() and "did you mean 'xpu'" in e.value.line()


def test_overlay_may_not_change_platform(tmp_path):
    o = _overlay(tmp_path, 'platform = "cuda"\n')
    with pytest.raises(RecipeError, match="may not change the platform"):
        recipe.load("cpu", [o])


def test_dependency_on_unknown_component(tmp_path):
    o = _overlay(tmp_path, '[components.nixl]\ndepends = ["ucx", "abseill"]\n')
    with pytest.raises(RecipeError, match="unknown component 'abseill'.*did you mean 'abseil'"):
        recipe.load("cpu", [o])


def test_dependency_cycle(tmp_path):
    o = _overlay(tmp_path, '[components.ucx]\ndepends = ["nixl"]\n')
    with pytest.raises(RecipeError, match="cycle"):
        recipe.load("cpu", [o])


def test_unknown_placeholder(tmp_path):
    o = _overlay(tmp_path, '[components.nixl.options]\nucx_path = "{prefix:ucxx}"\n')
    with pytest.raises(RecipeError, match="unknown placeholder"):
        recipe.load("cpu", [o])


def test_wrong_value_type(tmp_path):
    o = _overlay(tmp_path, '[components.ucx.with]\nze = 3\n')
    with pytest.raises(RecipeError, match="components.ucx.with.ze"):
        recipe.load("cpu", [o])


def test_package_can_be_dropped_with_false(tmp_path):
    o = _overlay(tmp_path, '[system_packages.debian]\ngit = false\n')
    r = recipe.load("cpu", [o])
    assert "git" not in r.data["system_packages"]["debian"]


def test_xpu_ze_ipc_variant_pins_the_pull_request_head_by_commit_alone():
    r = recipe.load("xpu", variant="ze-ipc")
    assert r.platform == "xpu" and r.variant == "ze-ipc"
    ucx = r.sources["ucx"]
    assert ucx["commit"] == "b8d6012325b5fe026a94be537009f486ed2b9d40" and "tag" not in ucx
    assert ucx["pull_request"] == {
        "number": 11218,
        "url": "https://github.com/openucx/ucx/pull/11218",
        "title": "UCT/ZE/ZE_IPC: enable level zero ipc support for Intel GPUs",
    }
    assert r.components["ucx"]["with"]["ze"] == "yes"
    assert {"ze_ipc", "ze_copy"} <= set(r.data["verify"]["ucx"]["transports"])
    assert "ze_ipc" in r.data["verify"]["ucx"]["memory_domains"]
    assert r.data["verify"]["ucx"]["defines"] == ["HAVE_ZE"]   # the rest of xpu's proof is kept
    assert recipe.variants("xpu") == ["ze-ipc"] and recipe.variants("cpu") == []
    assert "variant" not in recipe.load("xpu").data   # the release pin stays the default


def test_unknown_variant_names_the_known_ones():
    with pytest.raises(RecipeError) as e:
        recipe.load("xpu", variant="zeipc")
    assert e.value.line().startswith(
        "recipe error: platform xpu has no variant 'zeipc'; choose one of ze-ipc "
        "(did you mean 'ze-ipc'?)"
    )
    with pytest.raises(RecipeError, match="cpu has no variants: leave --variant out"):
        recipe.load("cpu", variant="ze-ipc")


def test_overlay_may_not_change_the_variant(tmp_path):
    o = _overlay(tmp_path, 'variant = "ze-ipc"\n')
    with pytest.raises(
        RecipeError, match="overlay.toml: says variant = 'ze-ipc'.*may not change the variant"
    ):
        recipe.load("xpu", [o])


def test_a_layer_that_pins_another_commit_drops_the_tag_it_would_inherit(tmp_path):
    """The issue's overlay: filename, sha256 and commit of the pull request's head laid over the
    release pin. The defaults' tag v1.22.0 named the old commit; it must not stay."""
    o = _overlay(tmp_path, '[sources.ucx]\nfilename = "ucx-pr11218-b8d6012.tar.gz"\n'
                           f'sha256 = "{"b" * 64}"\ncommit = "{"b" * 40}"\n')
    ucx = recipe.load("xpu", [o]).sources["ucx"]
    assert ucx["commit"] == "b" * 40 and "tag" not in ucx
    # the same commit keeps its tag; a layer that names its own tag keeps that one
    same = _overlay(
        tmp_path, '[sources.ucx]\ncommit = "8a6b06fb880accbb933a79cda893883872c68d9d"\n'
    )
    assert recipe.load("xpu", [same]).sources["ucx"]["tag"] == "v1.22.0"
    own = _overlay(tmp_path, f'[sources.ucx]\ncommit = "{"c" * 40}"\ntag = "v9"\n')
    assert recipe.load("xpu", [own]).sources["ucx"]["tag"] == "v9"
    # and the variant's pull request mark goes with its commit, back to the release pin
    back = _overlay(
        tmp_path, '[sources.ucx]\ncommit = "8a6b06fb880accbb933a79cda893883872c68d9d"\n'
    )
    assert "pull_request" not in recipe.load("xpu", [back], variant="ze-ipc").sources["ucx"]


def test_pull_request_mark_is_checked(tmp_path):
    o = _overlay(tmp_path, '[sources.ucx.pull_request]\nnumber = "11218"\n')
    with pytest.raises(RecipeError, match="sources.ucx.pull_request.number"):
        recipe.load("xpu", [o], variant="ze-ipc")
