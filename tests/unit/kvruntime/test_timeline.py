"""The timeline tool's reading of recorded steps (tools/timeline.py): a push's steps on both
sides become its phases (its answer the WRITE's notification, protocol 13), NIXL calls and
frames are counted by side, polls merged. The steps here are written out by hand (the tool
itself runs two processes: see its docstring)."""

from kvruntime.tools.timeline import phases, timeline


def step(side, name, start_us, us, thread="t"):
    return (side, thread, name, start_us / 1e6, (start_us + us) / 1e6)


PUSH = [
    step("decode", "start_push", 0, 300),
    step("decode", "frame out", 200, 50),
    step("prefill", "handle frame", 400, 900, "conn"),
    step("prefill", "nixl make_prepped_xfer", 500, 20, "conn"),
    step("prefill", "nixl transfer", 600, 30, "conn"),
    step("prefill", "nixl check_xfer_state", 700, 5, "loop"),
    step("prefill", "nixl check_xfer_state", 800, 5, "loop"),
    step("prefill", "nixl get_new_notifs", 810, 5, "loop"),
    step("prefill", "WRITE ended", 900, 100, "loop"),
    step("decode", "notification in", 1100, 10),
    step("prefill", "frame read (incl. idle)", -5000, 4000, "conn"),  # before: left out
]


def test_a_push_becomes_its_phases_on_one_time_axis():
    report = timeline(PUSH, 0.0, 1200e-6)
    assert report["total_us"] == 1200.0
    assert report["nixl_calls"] == {"prefill: make_prepped_xfer": 1, "prefill: transfer": 1,
                                    "prefill: check_xfer_state": 2}
    assert report["idle_polls"] == {"prefill: get_new_notifs": 1}
    assert report["frames"] == {"decode: frame out": 1}
    polls = [s for s in report["steps"] if s["step"] == "nixl check_xfer_state"]
    assert polls == [{"side": "prefill", "thread": "loop", "step": "nixl check_xfer_state",
                      "start_us": 700.0, "us": 105.0, "count": 2}]
    assert phases("push", report) == {
        "decode: plan": 200.0, "request frame to the prefill's handler": 200.0,
        "prefill: parse, plan, prepare": 200.0, "WRITE: posted to its notification in": 500.0,
        "decode: finish": 100.0, "(beside) WRITE: posted to seen done by the prefill": 300.0}


def test_a_write_done_in_its_post_leaves_no_poll_phase_and_a_pull_has_no_frames():
    pull = [step("decode", "nixl make_prepped_xfer", 100, 10),
            step("decode", "nixl transfer", 120, 500)]
    report = timeline(pull, 0.0, 700e-6)
    # polled by no one: the READ's phase needs its last poll, so it and what follows are out
    assert phases("pull", report) == {"decode: plan, prepare": 120.0}
    assert report["frames"] == {}
