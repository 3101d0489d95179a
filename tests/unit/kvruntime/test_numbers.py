"""numbers.py: what kvruntime takes for a number from a caller or a peer."""

import pytest

from kvruntime.errors import KVRuntimeError
from kvruntime.numbers import check_seconds, finite


@pytest.mark.parametrize("value,out", [(3, 3.0), (-2.5, -2.5), (10 ** 400, None), (True, None),
                                       ("1", None), (None, None), (float("nan"), None),
                                       (float("-inf"), None)], ids=str)
def test_a_number_is_finite_or_none(value, out):
    assert finite(value) == out


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), 10 ** 400, "5", True, None],
                         ids=str)
def test_a_duration_is_a_finite_positive_number(value):
    with pytest.raises(KVRuntimeError, match="^wait must be a finite positive number of "
                                             "seconds, got "):
        check_seconds("wait", value)


def test_a_good_duration_comes_back_as_given():
    assert check_seconds("wait", 2) == 2 and type(check_seconds("wait", 2)) is int
    assert check_seconds("wait", 0.25) == 0.25
