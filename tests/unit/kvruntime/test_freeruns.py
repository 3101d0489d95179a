"""A staging pool's free units as runs (freeruns.py), against the byte-a-unit map it replaced:
first fit by ``bytearray.find``, a give that marks units free whatever they were."""

import random

import pytest

from kvruntime.pools.freeruns import FreeRuns


class _ByteMap:
    """The straightforward model: one byte a unit, 1 free."""

    def __init__(self, units):
        self.free = bytearray(b"\x01") * units

    def take(self, n):
        at = self.free.find(b"\x01" * n)
        if at < 0:
            return None
        self.free[at:at + n] = bytes(n)
        return at

    def give(self, start, n):
        self.free[start:start + n] = b"\x01" * n

    def runs(self):
        out, at = [], 0
        for part in self.free.split(b"\x00"):
            if part:
                out.append((at, at + len(part)))
            at += len(part) + 1
        return out


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_byte_map(seed):
    rng = random.Random(seed)
    units = rng.randint(1, 300)
    runs, model, taken = FreeRuns(units), _ByteMap(units), []
    for _ in range(400):
        if taken and rng.random() < 0.45:
            start, n = taken.pop(rng.randrange(len(taken)))
            runs.give(start, n)
            model.give(start, n)
        elif rng.random() < 0.05:  # a range given back twice, or partly free: a union
            start = rng.randrange(units)
            n = rng.randint(0, units - start)
            runs.give(start, n)
            model.give(start, n)
            taken = [(s, k) for s, k in taken if s + k <= start or s >= start + n]
        else:
            n = rng.randint(1, max(1, units // 3))
            got = runs.take(n)
            assert got == model.take(n)
            if got is not None:
                taken.append((got, n))
        assert runs.runs() == model.runs()
        assert runs.free == model.free.count(1)
        assert runs.largest == max((e - s for s, e in model.runs()), default=0)
        start = rng.randrange(units)
        n = rng.randint(1, units - start)
        assert runs.is_free(start, n) == (model.free[start:start + n] == b"\x01" * n)


def test_first_fit_and_merging():
    runs = FreeRuns(10)
    assert [runs.take(3), runs.take(3), runs.take(3)] == [0, 3, 6]
    assert runs.take(2) is None and runs.runs() == [(9, 10)]
    runs.give(3, 3)
    assert runs.take(4) is None  # 3..5 and 9 are not consecutive
    runs.give(6, 3)  # touches both neighbours: one run
    assert runs.runs() == [(3, 10)] and runs.largest == 7 and runs.free == 7
    assert runs.take(7) == 3 and runs.runs() == [] and runs.take(1) is None


def test_units_outside_the_pool_and_empty_takes_are_refused():
    runs = FreeRuns(4)
    with pytest.raises(ValueError, match="outside the pool"):
        runs.give(3, 2)
    with pytest.raises(ValueError, match="outside the pool"):
        runs.give(-1, 1)
    with pytest.raises(ValueError, match="at least one"):
        runs.take(0)
    assert runs.runs() == [(0, 4)]
