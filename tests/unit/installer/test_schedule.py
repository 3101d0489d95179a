"""The component scheduler on the cpu recipe's real graph (ucx, abseil, asio -> nixl): what starts
together, what waits, and how a failure ends the others."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from installer import recipe
from installer.plan import Target, make_plan
from installer.schedule import JobBudget, build_all


def _components(component_jobs=None):
    plan = make_plan(
        recipe.load("cpu"),
        prefix=Path("/opt/kvstack"),
        cache_dir=Path("/cache"),
        jobs=2,
        target=Target("/usr/bin/python3", "3.11", "cp311"),
        platform_reason="test",
        component_jobs=component_jobs,
    )
    return plan.components, plan.component_jobs


def test_independent_components_run_together_and_nixl_after_all_of_them():
    comps, at_once = _components()
    assert at_once == 4
    independent = {"ucx", "abseil", "asio"}
    started, gate = [], threading.Barrier(len(independent), timeout=30)

    def build_one(comp, stop):
        started.append(comp.name)
        if comp.name in independent:
            gate.wait()  # returns only when all three run at the same time
    build_all(comps, build_one, at_once=at_once)
    assert set(started[:3]) == independent and started[3] == "nixl"


def test_one_at_a_time_keeps_the_plan_order():
    comps, at_once = _components(component_jobs=1)
    assert at_once == 1
    running, order = [], []

    def build_one(comp, stop):
        running.append(comp.name)
        assert len(running) == 1, running
        order.append(comp.name)
        running.remove(comp.name)
    build_all(comps, build_one, at_once=at_once)
    assert order == [c.name for c in comps] == ["ucx", "abseil", "asio", "nixl"]


def test_a_failure_stops_the_others_and_is_what_is_raised():
    comps, at_once = _components()
    stopped, abseil_running = [], threading.Event()

    def build_one(comp, stop):
        if comp.name == "abseil":
            abseil_running.set()
            assert stop.wait(timeout=30), "never asked to stop"
            stopped.append(comp.name)
            raise RuntimeError("stopped (not the error anyone should see)")
        if comp.name == "ucx":
            assert abseil_running.wait(timeout=30)
            raise ValueError("ucx configure failed")
        if comp.name == "nixl":
            raise AssertionError("nixl must not start after a failure")
    with pytest.raises(ValueError, match="ucx configure failed"):
        build_all(comps, build_one, at_once=at_once)
    assert stopped == ["abseil"]


def test_the_budget_is_held_by_one_build_phase_at_a_time():
    budget, inside, most = JobBudget(), [], []
    release = threading.Event()

    def compile_(name):
        with budget.hold(name):
            inside.append(name)
            most.append(len(inside))
            release.wait(timeout=30)
            inside.remove(name)
    threads = [threading.Thread(target=compile_, args=(n,)) for n in ("ucx", "abseil")]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(timeout=30)
    assert max(most) == 1 and not inside


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_every_component_and_raises_keyboardinterrupt(sig):
    """Ctrl-C or SIGTERM while components build: each one's stop is set, all return, and
    build_all raises KeyboardInterrupt once they have (the signal only sets a flag that the
    scheduler reads between waits), then the previous handlers are back."""
    comps, at_once = _components()
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stopped, gate = [], threading.Barrier(3, timeout=30)

    def build_one(comp, stop):
        gate.wait()  # ucx, abseil and asio all running
        if comp.name == "ucx":
            os.kill(os.getpid(), sig)
        assert stop.wait(timeout=30), "never asked to stop"
        stopped.append(comp.name)
    with pytest.raises(KeyboardInterrupt):
        build_all(comps, build_one, at_once=at_once)
    assert sorted(stopped) == ["abseil", "asio", "ucx"]
    assert {s: signal.getsignal(s) for s in before} == before
