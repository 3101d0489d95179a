"""installer/ibmock.py's device nodes: made only where no RDMA device exists, only as character
devices 1:3 (/dev/null's numbers), never over something else, and removed by the check that made
them. Runs in temporary directories standing for /dev/infiniband and /sys/class/infiniband (the
real ones are never touched here); making a character device needs root, as CI is."""
import os
import stat

import pytest

from installer import ibmock

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root")


@pytest.fixture
def paths(tmp_path):
    sysfs = tmp_path / "sys"
    sysfs.mkdir()
    return {"dev": tmp_path / "dev" / "infiniband", "sysfs": sysfs, "lock_dir": tmp_path}


def _nodes(dev):
    return sorted(p.name for p in dev.iterdir()) if dev.is_dir() else []


@root_only
def test_nodes_exist_as_dev_null_aliases_inside_the_block_and_are_removed_after(paths):
    (paths["dev"].parent).mkdir()
    with ibmock.device_nodes(**paths):
        assert _nodes(paths["dev"]) == ["uverbs0", "uverbs1"]
        st = os.stat(paths["dev"] / "uverbs0")
        assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3)
        assert os.access(paths["dev"] / "uverbs1", os.R_OK | os.W_OK)
    assert not paths["dev"].exists()  # the directory it made, gone with its nodes


@root_only
def test_nodes_someone_else_made_are_used_and_left(paths):
    paths["dev"].mkdir(parents=True)
    os.mknod(paths["dev"] / "uverbs0", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    with ibmock.device_nodes(**paths):
        assert _nodes(paths["dev"]) == ["uverbs0", "uverbs1"]
    assert _nodes(paths["dev"]) == ["uverbs0"]


def test_something_else_at_a_node_path_is_left_alone_and_refused(paths):
    paths["dev"].mkdir(parents=True)
    (paths["dev"] / "uverbs0").write_text("not a device")
    with pytest.raises(ibmock.Unavailable, match="is not a mock node"):
        with ibmock.device_nodes(**paths):
            pass
    assert (paths["dev"] / "uverbs0").read_text() == "not a device"


def test_a_host_with_real_rdma_devices_never_gets_the_mock(paths):
    (paths["sysfs"] / "mlx5_0").mkdir()
    with pytest.raises(ibmock.Unavailable, match=r"has RDMA devices \(mlx5_0\)"):
        with ibmock.device_nodes(**paths):
            pass
    assert not paths["dev"].exists()


def test_without_root_it_says_the_commands_instead(paths, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ibmock.Unavailable, match="only root can make it .*mknod .*uverbs0 c 1 3"):
        with ibmock.device_nodes(**paths):
            pass


def test_the_mock_comes_first_on_the_library_path_and_only_in_the_env_it_returns(tmp_path):
    base = {"LD_LIBRARY_PATH": "/prefix/ucx/lib", "PATH": "/bin"}
    env = ibmock.environment(tmp_path, base)
    assert env["LD_LIBRARY_PATH"] == f"{tmp_path}:/prefix/ucx/lib" and env["CLOUD_TYPE"] == "aws"
    assert base == {"LD_LIBRARY_PATH": "/prefix/ucx/lib", "PATH": "/bin"}
