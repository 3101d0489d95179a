"""Which of our GPUs a peer's exported region lives on: found by UUID, never by the peer's
device index (processes with other CUDA_VISIBLE_DEVICES number GPUs differently). Pure: the
GPU test (tests/integration/kvruntime/test_gpu.py) runs it with real devices."""

import pytest

from kvruntime.engines.samenode import SameNodeUnavailable, local_indices

VISIBLE = {"GPU-aaaa": 0, "GPU-bbbb": 1}


def test_regions_map_to_our_index_of_their_gpu_whatever_index_the_peer_used():
    # the peer saw only GPU-bbbb, as its device 0
    exported = [{"device": 0, "device_uuid": "GPU-bbbb"}, {"device": 0, "device_uuid": "GPU-bbbb"}]
    assert local_indices(exported, VISIBLE) == [1, 1]
    assert local_indices([{"device": 1, "device_uuid": "GPU-aaaa"}], VISIBLE) == [0]


def test_a_gpu_we_cannot_see_is_refused_with_what_to_expect():
    with pytest.raises(SameNodeUnavailable, match="GPU-cccc.*does not see.*NIXL moves it"):
        local_indices([{"device": 0, "device_uuid": "GPU-cccc"}], VISIBLE)


@pytest.mark.parametrize("entry", [{"device": 0}, {"device_uuid": 7}, "GPU-aaaa", None])
def test_a_region_without_a_gpu_uuid_is_refused(entry):
    with pytest.raises(SameNodeUnavailable, match="did not say which GPU"):
        local_indices([entry], VISIBLE)
