"""`python -m kvruntime selftest|bench` refuses every bad value with one line and the usage exit
code (2), before any process starts: values that raised a traceback (a TP size that does not
split the model's heads, a negative size, a zero block), failed later (as the stack unusable), or
were accepted silently (nan seconds, split 0, -1 UCX threads, a TP pair the heads do not split)."""

import subprocess
import sys

import pytest

from kvruntime.__main__ import main
from kvruntime.tools.placement import SCENARIOS, Group

BAD = [
    "selftest --tp-pairs 8x1", "selftest --tp-pairs 1000000000x1", "selftest --tp-pairs 2x",
    "selftest --timeout -1", "selftest --timeout nan", "selftest --timeout inf",
    "selftest --device-ids -1 0", "selftest --pairs-at-once 0",
    "bench --sizes -5", "bench --sizes 0", "bench --block-kib 0", "bench --block-kib 3",
    "bench --iters 0", "bench --host-streams 0", "bench --inflight -1 5", "bench --inflight 0 5",
    "bench --split 0", "bench --ucx-threads -1", "bench --handshakes -3", "bench --tp-pairs 2x3",
    "bench --device-ids 0 -2", "bench --device-ids 1", "selftest --device-ids 0",
    "bench --placement 0,1 --tp-pairs 2x1", "bench --placement 0,x,1 --tp-pairs 2x1",
    "bench --placement 0,1,2 0,1,2 --tp-pairs 2x1", "bench --tp-pairs 2x1x0",
    "bench --scenario tp-8gpu", "bench --tp-engines rdma",
    "policy --device-id -1", "policy --device-id x",
]


@pytest.mark.parametrize("argv", BAD)
def test_a_bad_value_is_one_line_and_the_usage_code(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv.split())
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --" in err, err
    assert argv.split()[1] in err  # names the option


def test_good_values_still_parse(monkeypatch):
    """The same options with values they accept reach the command (stubbed here: running a
    bench is the integration tests' job)."""
    import kvruntime.__main__ as cli

    seen = []
    monkeypatch.setattr(cli, "_bench", lambda args, out: seen.append(args) or 0)
    assert main("bench --sizes 1 --block-kib 2 --iters 1 --split 2 --ucx-threads 0 "
                "--host-streams 3 --inflight 0 0 --tp-pairs 2x1,8x4 --handshakes 1".split()) == 0
    args = seen[0]
    assert args.inflight is None and args.block_kib == 2
    assert args.tp_pairs == (Group(2, 1), Group(8, 4)) and args.device_ids == [0, 0]
    assert main("bench --tp-pairs 2x1x2 --device-ids 0 1 2 3 --placement 0,1,2,2".split()) == 0
    assert seen[1].tp_pairs == (Group(2, 1, 2),) and seen[1].placement == [(0, 1, 2, 2)]


def test_a_scenario_is_its_groups_devices_and_sizes_alone(monkeypatch):
    import kvruntime.__main__ as cli

    seen = []
    monkeypatch.setattr(cli, "_bench", lambda args, out: seen.append(args) or 0)
    assert main("bench --scenario tp-4gpu".split()) == 0
    assert [g.label for g in seen[0].tp_pairs] == SCENARIOS["tp-4gpu"]["groups"]
    assert seen[0].device_ids == [0, 1, 2, 3] and seen[0].tp_only
    assert seen[0].sizes == SCENARIOS["tp-4gpu"]["sizes_mib"]
    assert main("bench --scenario tp-2gpu --device-ids 2 3".split()) == 0
    assert seen[1].device_ids == [2, 3]


def test_the_process_prints_no_traceback():
    r = subprocess.run([sys.executable, "-m", "kvruntime", "bench", "--sizes", "-5"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
