"""`python -m installer --help` is where a user discovers every verb."""

import subprocess
import sys

from installer.cli import VERBS, build_parser


def test_help_lists_every_verb_with_a_line():
    text = build_parser()["install"].format_help()
    for verb, line in VERBS.items():
        assert f"  {verb}" in text and line.split()[0] in text


def test_every_verb_has_a_parser_and_help_runs():
    parsers = build_parser()
    assert set(parsers) == set(VERBS)
    out = subprocess.run([sys.executable, "-m", "installer", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "mirror" in out.stdout and "verify" in out.stdout
