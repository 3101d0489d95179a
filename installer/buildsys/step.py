"""A step of a component's build: an external command, or an action the installer does itself
(copy headers, stage meson subprojects, write a pkg-config file)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Step:
    phase: str                      # configure | build | install
    name: str                       # short name; also the log file's name
    argv: tuple[str, ...] = ()      # external command (empty for actions)
    cwd: Path | None = None
    action: str | None = None       # internal action name (see installer/steps.py)
    args: dict[str, Any] = field(default_factory=dict)
    unless_exists: Path | None = (
        None  # skip when this path exists (autogen when configure is there)
    )
    env: dict[str, str] = field(default_factory=dict)  # on top of the component's environment

    def describe(self) -> str:
        if self.action:
            detail = ", ".join(f"{k}={v}" for k, v in self.args.items())
            return f"[{self.action}] {detail}"
        cmd = " ".join(
            [*(f"{k}={_quote(v)}" for k, v in self.env.items()), *(_quote(a) for a in self.argv)]
        )
        where = f"(cd {self.cwd} && {cmd})" if self.cwd else cmd
        if self.unless_exists:
            where += f"   # only when {self.unless_exists} is missing"
        return where

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"phase": self.phase, "name": self.name}
        if self.action:
            d["action"] = self.action
            d["args"] = {k: str(v) for k, v in self.args.items()}
        else:
            d["argv"] = list(self.argv)
            d["cwd"] = str(self.cwd) if self.cwd else None
            if self.env:
                d["env"] = dict(self.env)
        if self.unless_exists:
            d["unless_exists"] = str(self.unless_exists)
        return d


def _quote(arg: str) -> str:
    import shlex
    return shlex.quote(arg)
