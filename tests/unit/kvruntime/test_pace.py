"""pace.Pace: how long a request's ``wait`` spins before it naps, from the fastest its peer
has moved bytes. Pure arithmetic (the spin itself is measured by the bench, never timed here)."""

import pytest

from kvruntime.pace import SPIN_CAP, SPIN_MARGIN, SPIN_SECONDS, Pace


def test_a_new_peer_spins_the_floor():
    assert Pace().spin_seconds("pull", 1 << 30) == SPIN_SECONDS


def test_the_spin_covers_what_the_fastest_request_promises():
    pace = Pace()
    pace.seen("pull", 1 << 30, 0.004)  # 268 GB/s
    assert pace.spin_seconds("pull", 1 << 30) == pytest.approx(SPIN_MARGIN * 0.004)
    assert pace.spin_seconds("pull", 1 << 20) == SPIN_SECONDS  # small: the floor
    assert pace.spin_seconds("push", 1 << 30) == SPIN_SECONDS  # another op: its own pace


def test_only_a_faster_request_moves_the_pace():
    pace = Pace()
    pace.seen("pull", 1 << 30, 0.004)
    pace.seen("pull", 1 << 30, 0.040)  # a busy link: slower, forgotten
    pace.seen("pull", 64 << 20, 0.0001)  # 671 GB/s: the new best
    assert pace.spin_seconds("pull", 1 << 30) == pytest.approx(SPIN_MARGIN * (1 << 30) / 671e9,
                                                               rel=1e-3)


def test_the_spin_is_capped_and_nonsense_is_ignored():
    pace = Pace()
    pace.seen("pull", 1 << 20, 1.0)  # 1 MB/s: a GiB would take minutes
    assert pace.spin_seconds("pull", 1 << 30) == SPIN_CAP
    for nbytes, seconds in ((0, 1.0), (1 << 20, 0.0), (1 << 20, -1.0)):
        fresh = Pace()
        fresh.seen("pull", nbytes, seconds)
        assert fresh.spin_seconds("pull", 1 << 30) == SPIN_SECONDS
