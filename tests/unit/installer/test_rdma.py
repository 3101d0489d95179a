"""installer/rdma.py: the RDMA parts a recipe asks of UCX, and the one line a host that cannot
build them gets before anything builds. The headers are laid out as rdma-core installs them under
<include>/infiniband and <include>/rdma; the last test reads this host's own (CI installs
libibverbs-dev and librdmacm-dev)."""
import pytest

from installer import rdma, recipe
from installer.errors import SystemPackagesError

ALL = {"verbs": True, "rdmacm": "yes", "dm": "yes", "mlx5": "yes", "efa": "yes"}


def _headers(root, *, dmabuf=True, skip=()):
    for key, (header, _pkg) in rdma.HEADERS.items():
        if key in skip:
            continue
        path = root / header
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd);\n"
            if dmabuf and key == "verbs"
            else "/* older */\n"
        )
    return root


def test_a_host_with_every_header_and_the_floor_has_no_problem(tmp_path):
    assert rdma.host_problems(ALL, _headers(tmp_path)) == []


def test_a_missing_header_names_its_package_and_the_fix(tmp_path):
    include = _headers(tmp_path, skip={"rdmacm"})
    problems = rdma.host_problems(ALL, include)
    assert problems == [f"rdmacm: {include / 'rdma/rdma_cma.h'} is missing (package librdmacm-dev)"]
    with pytest.raises(SystemPackagesError) as e:
        rdma.check_host(ALL, include)
    line = e.value.line()
    assert "\n" not in line and "librdmacm-dev" in line and "verbs = false" in line


def test_an_rdma_core_without_dmabuf_registration_is_below_the_floor(tmp_path):
    problems = rdma.host_problems(ALL, _headers(tmp_path, dmabuf=False))
    assert (
        len(problems) == 1 and "ibv_reg_dmabuf_mr" in problems[0] and "rdma-core 34" in problems[0]
    )


def test_parts_turned_off_are_not_asked_for(tmp_path):
    assert rdma.wanted({"verbs": False, "rdmacm": "yes"}) == []
    assert rdma.host_problems({"verbs": False}, tmp_path) == []
    assert rdma.wanted({"verbs": True, "mlx5": "no", "efa": False}) == ["verbs"]
    assert rdma.plan_lines({"verbs": False})[0].startswith("  none:")


def test_verbs_from_a_directory_is_looked_for_there():
    assert str(rdma.include_dir({"verbs": "/opt/rdma"})) == "/opt/rdma/include"
    assert str(rdma.include_dir({"verbs": True})) == "/usr/include"


def test_every_platform_builds_rdma_and_the_dry_run_says_so():
    for platform in recipe.PLATFORMS:
        with_table = recipe.load(platform).components["ucx"]["with"]
        assert rdma.wanted(with_table) == ["verbs", "rdmacm", "mlx5", "efa"], platform
        text = "\n".join(rdma.plan_lines(with_table))
        assert "the host's rdma-core" in text and "ibv_reg_dmabuf_mr" in text


@pytest.mark.build  # after ci/test.sh's system packages: `ci/test.sh --quick` installs none
def test_this_host_can_build_the_recipes_rdma():
    """CI installs libibverbs-dev and librdmacm-dev (ci/test.sh); a host without them would get
    the one line above before anything builds. Marked build: it runs with the tests of the
    pinned builds, once the system packages are in, never in the quick run, which needs none."""
    assert rdma.host_problems(recipe.load("cpu").components["ucx"]["with"]) == []
