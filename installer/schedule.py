"""Builds the plan's components side by side where the dependency graph allows: UCX's autogen and
configure (single-threaded, a minute on a many-core host) run while Abseil builds; NIXL starts
when everything it depends on is installed.

The --jobs budget: a component's build phase (make, ninja or `cmake --build`, each run with
-j<jobs>) holds all of it, so two compiles never split the cores between them; single-threaded
steps (autogen, configure, meson setup, installs) run beside whichever build holds it. The order
components are started in, and what each one's steps are, do not depend on the schedule: a
component sees only its own source, build and install directories and those of the components
it depends on, which are finished before it starts.

When a component fails, the others are stopped (their running step's process group killed) and
the first failure is raised; Ctrl-C or SIGTERM stops them all the same way. While components
run, those signals only set a flag that the scheduler reads between its waits: raised wherever
the main thread happened to be, KeyboardInterrupt could land inside concurrent.futures' own lock
handling and leave a future's lock taken, so that the pool's threads, and the interrupted
installer with them, never finished (seen once in CI: no exit a minute after SIGINT)."""
from __future__ import annotations

import logging
import signal
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from .plan import ComponentPlan

log = logging.getLogger("kvstack.installer")


class JobBudget:
    """The --jobs budget, held whole by one component's build phase at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: str | None = None

    @contextmanager
    def hold(self, component: str) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            log.info(
                "    %s waits for %s to finish compiling (the -j budget)", component, self._holder
            )
            self._lock.acquire()
        self._holder = component
        try:
            yield
        finally:
            self._holder = None
            self._lock.release()


POLL_S = 0.25  # how soon the scheduler sees a Ctrl-C or SIGTERM


@contextmanager
def _signals_set(flag: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set ``flag`` instead of raising (main thread only; elsewhere Python
    gives no signal handlers), then the previous handlers come back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda _signum, _frame: flag.set())
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def build_all(
    components: Sequence[ComponentPlan],
    build_one: Callable[[ComponentPlan, threading.Event], None],
    *,
    at_once: int,
) -> None:
    """Run build_one(component, stop) for every component, each once all its dependencies
    returned, at most `at_once` at a time, in plan order where several are ready. build_one must
    return soon after `stop` is set (runner.run_step does)."""
    pending = list(components)
    done: set[str] = set()
    running: dict[Future, ComponentPlan] = {}
    stop, interrupted = threading.Event(), threading.Event()
    with _signals_set(interrupted), \
            ThreadPoolExecutor(max_workers=max(1, at_once), thread_name_prefix="component") as pool:
        try:
            while pending or running:
                for comp in [c for c in pending if all(d in done for d in c.depends)]:
                    if len(running) >= at_once:
                        break
                    pending.remove(comp)
                    running[pool.submit(build_one, comp, stop)] = comp
                if not running:  # only possible with a cycle, which recipe loading refuses
                    raise RuntimeError(
                        f"components {[c.name for c in pending]} wait for each other"
                    )
                finished, _ = wait(running, timeout=POLL_S, return_when=FIRST_COMPLETED)
                if interrupted.is_set():
                    raise KeyboardInterrupt  # here, between waits, never inside one
                for future in finished:
                    comp = running.pop(future)
                    future.result()  # the component's own error, raised here
                    done.add(comp.name)
            if interrupted.is_set():  # a signal as the last component ended
                raise KeyboardInterrupt
        except BaseException:
            stop.set()  # the others stop their running step; the pool's exit waits for them
            raise
