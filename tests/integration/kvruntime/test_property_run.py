"""A short property run (property_run.py): random layouts, TP pairs, KV buffers, engines and
coalesce modes, start_pull and start_pulls, canaries around every request's blocks; a real
prefill process a trial. The long run is the same script with more trials (README)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "property_run.py")


def test_a_short_property_run_finds_nothing_corrupt():
    done = subprocess.run([sys.executable, RUN, "--trials", "8", "--seed", "7"], text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    totals = json.loads(done.stdout.strip().splitlines()[-1])["totals"]
    assert totals["requests"] >= 40 and totals["batched"], totals
    assert totals["corrupt"] == 0 and totals["canary_hits"] == 0 and totals["failed"] == 0, totals
