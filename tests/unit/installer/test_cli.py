"""The CLI is discoverable: `--help` lists every verb with its line, each verb's own --help
works, and a mistyped verb gets one line naming the verbs. Real `python -m installer` processes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from installer import cli

ROOT = Path(__file__).resolve().parents[3]


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "installer", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_top_level_help_lists_every_verb_with_its_summary():
    r = _cli("--help")
    assert r.returncode == 0, r.stderr
    for name, verb in cli.VERBS.items():
        line = next((ln for ln in r.stdout.splitlines() if ln.strip().startswith(name + " ")), None)
        assert line is not None, f"{name} missing from --help:\n{r.stdout}"
        assert verb.summary in line
    assert "--prefix" in r.stdout  # install's options still shown: no verb means install


def test_known_verbs_are_there():
    assert {"install", "mirror", "verify"} <= set(cli.VERBS)


@pytest.mark.parametrize("verb", sorted(cli.VERBS))
def test_each_verb_has_its_own_help(verb):
    r = _cli(verb, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: python -m installer"), r.stdout


def test_a_new_verb_is_one_entry_and_shows_in_help(monkeypatch):
    verbs = dict(cli.VERBS)
    verbs["probe"] = cli.Verb("a verb added by this test", cli._verify_parser, lambda args: 0)
    monkeypatch.setattr(cli, "VERBS", verbs)
    assert "  probe" in cli.verbs_help() and "a verb added by this test" in cli.verbs_help()
    assert cli.main(["probe"]) == 0


def test_mistyped_verb_gets_one_line_naming_the_verbs():
    r = _cli("instal", "--prefix", "/tmp/x")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown verb 'instal'" in lines[0] and "mirror" in lines[0], (
        r.stderr
    )


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--platform", "cpu", "--dry-run", "--python", "/bin/true"],
            "--python /bin/true is not a Python 3 interpreter",
        ),
        (
            ["--platform", "cpu", "--dry-run", "--binary-cache", "gopher://x"],
            "'gopher://x' is no binary cache",
        ),
        (["image", "--platform", "bogus"], "invalid choice: 'bogus'"),
        (["--platform", "cpu", "--jobs", "many"], "argument --jobs/-j: invalid int value"),
    ],
)
def test_a_bad_value_is_one_line_and_the_usage_code(args, says):
    """Even a dry run checks its interpreter and its cache's scheme; every verb's parser is the
    one Parser class, so argparse's usage dump never reaches the user."""
    r = _cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], r.stderr


def test_every_verb_parser_is_the_one_parser_class():
    from installer.usage import Parser
    for name, verb in cli.VERBS.items():
        assert isinstance(verb.parser(), Parser), name
