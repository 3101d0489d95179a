"""The installer's one argument parser class: every verb's parser is one of these."""
from __future__ import annotations

import argparse

from .errors import UsageError


class Parser(argparse.ArgumentParser):
    """No abbreviated options: ``--recipe`` would be ambiguous, ``--mirr`` would silently mean
    ``--mirror``, and an option added later could change what an old command line means. A bad
    argument is one line and the usage exit code (UsageError), not argparse's usage dump."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        raise UsageError(message, fix=f"see `{self.prog} --help`")
