"""kvruntime's command-line convention: one parser class, one table of exit codes.

The installer has the same shape (installer/usage.py's ``Parser``, installer/errors.py's
``EXIT_CODES``): no abbreviated options, a bad argument is one line, ``usage error: <what>; see
`<prog> --help```, and exit code 2 (argparse's own). The two programs never import each other
(tests/unit/kvruntime/test_import_graph.py: kvruntime ships in the wheel, the installer runs from
a checkout), so each holds its ten lines rather than a third package holding them for both;
tests/unit/test_cli_convention.py keeps them the same.
"""

from __future__ import annotations

import argparse
import sys

OK, MODE_FAILED, USAGE, UNUSABLE, INTERRUPTED = 0, 1, 2, 3, 130
# exit code -> what it means (docs/exit-codes.md)
EXIT_CODES = {
    OK: "every mode passed (bench: measured)",
    MODE_FAILED: "a selftest mode failed (the report names it; demo: a case's tokens or logits "
                 "differ from one process's, or its connection was refused)",
    USAGE: "a bad argument: one line naming the option and what it accepts, before any process "
           "starts",
    UNUSABLE: "the stack is unusable: NIXL missing, a process failed to start (bench: any "
              "failure; policy: a UCX setting refused; demo: torch or transformers missing)",
    INTERRUPTED: "interrupted",
}


class UsageError(SystemExit):
    """A bad argument: the process exits with ``USAGE`` (its line is on stderr already)."""


class Parser(argparse.ArgumentParser):
    """No abbreviated options (``selftest --device cuda`` would be read as ``--device-ids`` and
    fail with a message about ids). A bad argument is one line and the usage exit code, not
    argparse's usage dump."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        print(f"usage error: {message}; see `{self.prog} --help`", file=sys.stderr)
        raise UsageError(USAGE)
