"""The command-line convention both programs follow (docs/exit-codes.md): parser classes of one
shape — no abbreviated options, a bad argument in one line ``usage error: <what>; see `<prog>
--help``` and exit code 2 — and each program's exit codes in one table that README lists whole.
The two parsers are separate classes because kvruntime and the installer never import each
other; this test is what keeps them alike."""

import re
from pathlib import Path

import pytest

from installer.errors import EXIT_CODES as INSTALLER_CODES
from installer.errors import UsageError as InstallerUsage
from installer.usage import Parser as InstallerParser
from kvruntime.tools.cli import EXIT_CODES as KVRUNTIME_CODES
from kvruntime.tools.cli import USAGE
from kvruntime.tools.cli import Parser as KvruntimeParser

ROOT = Path(__file__).resolve().parents[2]


def _parser(cls):
    p = cls(prog="prog")
    p.add_argument("--device-ids", type=int)
    return p


def test_both_parsers_refuse_alike(capsys):
    with pytest.raises(InstallerUsage) as inst:
        _parser(InstallerParser).parse_args(["--device", "1"])  # no abbreviation
    with pytest.raises(SystemExit) as kvr:
        _parser(KvruntimeParser).parse_args(["--device", "1"])
    line = capsys.readouterr().err
    assert line == inst.value.line() + "\n"
    assert re.fullmatch(r"usage error: unrecognized arguments: --device 1; see `prog --help`\n",
                        line)
    assert kvr.value.code == inst.value.exit_code == USAGE == 2


def _readme_table(after: str) -> set[int]:
    text = (ROOT / "docs" / "exit-codes.md").read_text()
    table = text[text.index(after):].split("\n\n")[1]
    return {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)}


def test_readme_lists_each_programs_codes():
    assert _readme_table("`python -m installer` (each error") == set(INSTALLER_CODES)
    assert _readme_table("`python -m kvruntime selftest|bench` (and") == set(KVRUNTIME_CODES)
