"""ci/nixl_suite.py's judgement, without a build: an example passes only when every process
exited 0, said NIXL's "Test Complete." and its own verification line, and logged no ERROR (NIXL's
basic_two_peers.py exits 0 after "Data verification failed."); only NIXL's test/python and
examples/python come out of the archive, and nothing lands outside the directory given."""
from __future__ import annotations

import importlib.util
import io
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1].parent
spec = importlib.util.spec_from_file_location("nixl_suite", ROOT / "ci" / "nixl_suite.py")
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)

OK = "NIXL INFO Data verification passed\nNIXL INFO Test Complete.\n"
MARKS = suite.TWO_PEERS["basic_two_peers.py"]


def test_a_clean_pair_passes():
    assert suite._verdict({"target": (0, "NIXL INFO Test Complete.\n"), "initiator": (0, OK)},
                          MARKS) == ""


def test_exit_zero_after_a_failed_verification_fails():
    bad = "NIXL ERROR Data verification failed.\n"  # then exit(): status 0
    said = suite._verdict({"target": (0, "Test Complete.\n"), "initiator": (0, bad)}, MARKS)
    assert said.startswith("initiator: missing") and "Data verification passed" in said


def test_an_error_line_or_a_status_fails():
    assert "ERROR" in suite._verdict({"p": (0, OK + "x NIXL ERROR boom\n")}, {})
    assert suite._verdict({"p": (3, "Traceback\n")}, {}).startswith("p exited 3")


def _tar(path: Path, members: dict[str, bytes], link: str | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        if link:
            info = tarfile.TarInfo("nixl-1/test/python/evil.py")
            info.type, info.linkname = tarfile.SYMTYPE, link
            tf.addfile(info)
    return path


def test_only_nixls_python_tests_and_examples_are_extracted(tmp_path):
    tar = _tar(tmp_path / "n.tar.gz", {
        "nixl-1/test/python/test_a.py": b"ok", "nixl-1/examples/python/b.py": b"ok",
        "nixl-1/src/x.cc": b"no", "nixl-1/test/python/../../../../escape.py": b"no"},
        link="/etc/passwd")
    out = suite.extract(tar, tmp_path / "out")
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == ["examples/python/b.py", "test/python/test_a.py"]
    assert not (tmp_path / "escape.py").exists()


def test_nixls_own_skip_reason_is_the_comment_above(tmp_path):
    src = tmp_path / "t.py"
    src.write_text("x = 1\n\n# needs GDS\n# and CUDA\n@pytest.mark.skip\ndef test_a():\n    pass\n")
    assert suite.own_skip_reason(src, 6) == "NIXL's source skips it: needs GDS and CUDA"
