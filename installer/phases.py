"""Phase bookkeeping: each phase is timed, logged as it starts and ends, and recorded for the
manifest (status, seconds, and whatever the phase returns)."""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Iterator

log = logging.getLogger("kvstack.installer")

PHASES = (
    "resolve",
    "fetch",
    "check",
    "system-packages",
    "build-tools",
    "extract",
    "configure",
    "build",
    "install",
    "verify",
)


class PhaseLog:
    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[dict[str, Any]]:
        assert name in PHASES, name
        record: dict[str, Any] = {"status": "running"}
        self.records[name] = record
        log.info("==> %s", name)
        start = time.monotonic()
        try:
            yield record
        except BaseException:
            record["status"] = "failed"
            raise
        finally:
            record["seconds"] = round(time.monotonic() - start, 3)
        record["status"] = record.get("status_override", "done")
        record.pop("status_override", None)
        log.info("<== %s %.1fs", name, record["seconds"])
