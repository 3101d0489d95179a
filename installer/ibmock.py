"""UCX's own fake RDMA device, for verification on a host without one.

No machine kvstack is tested on has an HCA (and CI's kernel has no InfiniBand at all). UCX ships
the answer its own CI uses (contrib/test_efa.sh): contrib/ibmock in the UCX source is a
libibverbs and a libefa of its own that show one process two EFA devices, rdmap0 and rdmap1,
with UD and SRD. Loaded before the host's libibverbs (its directory first on LD_LIBRARY_PATH),
it makes UCX's ib modules list memory domains rdmap0/rdmap1 with transports ud_verbs and srd,
and moves bytes through UCX's verbs code path between two endpoints of one process.

What it cannot prove: anything between two processes or two hosts, any real NIC's data path,
GPU memory registered by a NIC (GPUDirect). Verification says so instead of passing it.

It is built from the UCX source of the build being verified (never vendored), kept in the build
under verify/ibmock (so `installer verify` finds it later), and is used by verification only:
nothing puts its directory on a runtime path (env.sh, the wheel).

UCX opens a device only when /dev/infiniband/uverbsN is a character device it may read and
write (uct_ib_device_is_accessible). ``device_nodes`` makes them for the duration of a check, as
UCX's CI does: character devices 1:3, /dev/null's numbers (reads end at once, writes vanish),
only on a host with no RDMA device, only as root, and removes the ones it made.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Iterator, Mapping

from .buildsys.step import Step
from .runner import run_step

SOURCE_DIR = "contrib/ibmock"
LIBS = ("libibverbs.so.1", "libefa.so.1")
DEVICES = 2                       # ibmock's own count: rdmap0, rdmap1
NODE = (1, 3)                     # /dev/null's major and minor
ENV = {"CLOUD_TYPE": "aws"}       # as UCX's contrib/test_efa.sh runs it
SYSFS = Path("/sys/class/infiniband")
DEV = Path("/dev/infiniband")


class Unavailable(Exception):
    """The mock cannot run on this host; the message says why (a check reports it as not made)."""


def real_devices(sysfs: Path = SYSFS) -> list[str]:
    """This host's RDMA devices as the kernel lists them (what `ibv_devices` shows)."""
    try:
        return sorted(p.name for p in sysfs.iterdir())
    except OSError:
        return []


def build(ucx_src: Path, dest: Path, env: dict[str, str], log_dir: Path, work: Path) -> Path:
    """Compile ibmock from the UCX source tree ``ucx_src`` against the host's rdma-core headers
    and keep its libraries in ``dest``; returns ``dest``."""
    if all((dest / lib).exists() for lib in LIBS):
        return dest
    src = ucx_src / SOURCE_DIR
    if not (src / "Makefile").is_file():
        raise Unavailable(f"this UCX source has no {SOURCE_DIR} (UCX v1.19 and later carry it)")
    out = work / "ibmock"
    shutil.rmtree(out, ignore_errors=True)
    run_step(Step("build", "ibmock", ("make", "-C", str(src), f"BUILD={out}")), component="ucx",
             env=env, log_dir=log_dir, actions={})
    dest.mkdir(parents=True, exist_ok=True)
    for lib in out.glob("lib*.so*"):
        shutil.copy2(lib, dest / lib.name, follow_symlinks=False)
    return dest


def environment(libdir: Path, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with ibmock's libraries loaded before the host's."""
    path = [str(libdir)] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    return {**env, **ENV, "LD_LIBRARY_PATH": os.pathsep.join(path)}


def _is_mock_node(path: Path) -> bool:
    st = path.lstat()
    return stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == NODE


@contextlib.contextmanager
def device_nodes(dev: Path = DEV, sysfs: Path = SYSFS, count: int = DEVICES,
                 lock_dir: Path | None = None) -> Iterator[None]:
    """/dev/infiniband/uverbs0..count-1 as UCX wants them, for the duration of the block.
    Raises Unavailable (with why) where the mock must not or cannot run."""
    real = real_devices(sysfs)
    if real:
        raise Unavailable(
            f"this host has RDMA devices ({', '.join(real)}): they are checked, not the mock"
        )
    lock_path = (lock_dir or Path(tempfile.gettempdir())) / "kvstack-ibmock.lock"
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one maker at a time; users share it below
        made: list[Path] = []
        made_dir = False
        try:
            for i in range(count):
                node = dev / f"uverbs{i}"
                if node.exists() or node.is_symlink():
                    if not _is_mock_node(node):
                        raise Unavailable(f"{node} exists and is not a mock node (character device "
                                          f"{NODE[0]}:{NODE[1]}); it is left alone")
                    continue
                if os.geteuid() != 0:
                    raise Unavailable(
                        f"{node} is missing and only root can make it (as root: mkdir -p {dev} "
                        f"&& mknod {node} c {NODE[0]} {NODE[1]})"
                    )
                if not dev.is_dir():
                    dev.mkdir(mode=0o755)
                    made_dir = True
                os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(*NODE))
                os.chmod(node, 0o666)  # the umask must not take UCX's read-write access away
                made.append(node)
        except PermissionError as e:
            _remove(made, dev if made_dir else None)
            raise Unavailable(
                f"cannot make {dev}/uverbsN here ({e.strerror}): a container without CAP_MKNOD"
            )
        except BaseException:
            _remove(made, dev if made_dir else None)
            raise
        fcntl.flock(lock, fcntl.LOCK_SH)  # other checks may use the nodes beside this one
        try:
            yield
        finally:
            try:  # the last user removes what it made; a check still running keeps them
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            else:
                _remove(made, dev if made_dir else None)


def _remove(nodes: list[Path], directory: Path | None) -> None:
    for node in nodes:
        with contextlib.suppress(OSError):
            node.unlink()
    if directory is not None:
        with contextlib.suppress(OSError):
            directory.rmdir()  # only when empty
