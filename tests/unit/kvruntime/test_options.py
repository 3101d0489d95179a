"""Options: what both sides share, filled by keyword arguments or from the environment, and the
one reader of every KVRUNTIME_* variable (a module that reads one elsewhere fails here)."""

import re
from pathlib import Path

import pytest

from kvruntime import Options
from kvruntime.errors import KVRuntimeError
from kvruntime.options import ENV, environment

ROOT = Path(__file__).resolve().parents[3]


def test_keyword_arguments_fill_the_options():
    base = Options(timeout=2.0, tp_rank=1)
    o = Options.of(base, {"secret": b"s", "timeout": 3.0})
    assert (o.timeout, o.tp_rank, o.secret) == (3.0, 1, b"s")
    assert Options.of(None, {}) == Options()
    with pytest.raises(TypeError, match="unexpected keyword argument.*: colour"):
        Options.of(None, {"colour": "blue"})


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan"), 10 ** 400, "5", True,
                                     None], ids=str)
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused_at_once(timeout):
    with pytest.raises(KVRuntimeError, match=f"timeout must be a finite positive number of "
                                             f"seconds, got {re.escape(repr(timeout))}"):
        Options.of(None, {"timeout": timeout})


def test_from_env_reads_its_variables_and_the_caller_overrides():
    env = {"KVRUNTIME_KV_BUFFER": "host_staged", "KVRUNTIME_SECRET": "abc",
           "KVRUNTIME_NATIVE": "0"}
    o = Options.from_env(env)
    assert (o.kv_buffer, o.secret) == ("host_staged", b"abc")
    assert Options.from_env(env, secret=b"mine", timeout=1.0).secret == b"mine"
    assert Options.from_env({"KVRUNTIME_SECRET": ""}).secret is None  # empty: unset


def test_environment_knows_only_its_table():
    assert environment("KVRUNTIME_NATIVE", {"KVRUNTIME_NATIVE": "0"}) == "0"
    with pytest.raises(KeyError, match="not one of kvruntime's variables"):
        environment("KVRUNTIME_TYPO", {})


def test_every_variable_is_read_through_the_table():
    """No module reads a KVRUNTIME_* variable from os.environ itself, and every variable a module
    names for the user is in ENV (KVRUNTIME_UCX_LOG is kvruntime's own mark, set and read by
    ucxlog.py between its processes, not a setting)."""
    named = set()
    for path in (ROOT / "kvruntime").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"environ(\.get)?[\[(]\s*\"KVRUNTIME_", text), path
        named |= set(re.findall(r"KVRUNTIME_[A-Z_]+", text))
    assert named - {"KVRUNTIME_UCX_LOG"} == set(ENV)


def test_the_kv_buffer_values_documented_are_the_ones_taken():
    """What ENV's table (and README's from it) and Options' docstring say ``kv_buffer`` takes
    are the values resolve_kv_buffer accepts. (Before: "direct", which it refuses.)"""
    from kvruntime.options import Options
    from kvruntime.pools.staging import KV_BUFFERS, resolve_kv_buffer

    _field, what = ENV["KVRUNTIME_KV_BUFFER"]
    assert set(re.findall(r"`(\w+)`", what)) == set(KV_BUFFERS)
    doc = " ".join(Options.__doc__.split())
    said = re.search(r"``kv_buffer``: (.*?) \(", doc).group(1)
    assert set(re.findall(r'"(\w+)"', said)) == set(KV_BUFFERS)
    for value in KV_BUFFERS:
        assert resolve_kv_buffer(value) == value


def test_the_guide_lists_every_variable_options_reads():
    """docs/kvruntime.md's table of KVRUNTIME_* variables names exactly ENV's (options.py reads
    them all, and nowhere else does)."""
    guide = (Path(__file__).resolve().parents[3] / "docs" / "kvruntime.md").read_text()
    listed = set(re.findall(r"^\| `(KVRUNTIME_[A-Z_]+)` \|", guide, re.M))
    assert listed == set(ENV)
