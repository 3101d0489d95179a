"""``python -m kvruntime.tools.modmap``: kvruntime's module map, made from the code.

Each folder's ``__init__`` docstring says what its layer holds; each module's first docstring
sentence says what the module holds. The map is printed as Markdown, one table a layer, bottom
layer first; ``docs/kvruntime-modules.md`` is this output, and a unit test fails when the two
differ (run ``python -m kvruntime.tools.modmap > docs/kvruntime-modules.md`` after a change).
Read from the source with ``ast``: nothing is imported."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
# the layers bottom up (tests/unit/kvruntime/test_import_graph.py holds the rule they follow);
# "" is the package's root: the model every layer may use
LAYERS = ("", "host", "wire", "nixl", "pools", "engines", "decode", "prefill", "tools")
HEADER = ("# kvruntime's module map\n\n"
          "Made from the code by `python -m kvruntime.tools.modmap` (a test keeps it current).\n"
          "Layers bottom up: a folder imports only from the root and the folders below it.\n")


def _docstring(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
    return " ".join(doc.split())


def first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence (not ``e.g.`` or a file name)."""
    match = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", text)
    return (text[:match.start() + 1] if match else text).replace("|", "\\|")


def layer_table(folder: str) -> str:
    base = PACKAGE / folder if folder else PACKAGE
    title = f"`kvruntime/{folder}/`" if folder else "`kvruntime/` (the root)"
    what = _docstring(base / "__init__.py") if folder else "The model: every layer may use it."
    rows = ["| module | lines | what it holds |", "|---|---|---|"]
    for path in sorted(base.glob("*.py")):
        if path.name == "__init__.py":
            continue
        lines = len(path.read_text().splitlines())
        rows.append(f"| `{path.stem}` | {lines} | {first_sentence(_docstring(path))} |")
    return f"## {title}\n\n{first_sentence(what)}\n\n" + "\n".join(rows) + "\n"


def module_map() -> str:
    found = sorted(p.name for p in PACKAGE.iterdir()
                   if p.is_dir() and (p / "__init__.py").exists())
    order = [f for f in LAYERS if f == "" or f in found] + [f for f in found if f not in LAYERS]
    return HEADER + "".join("\n" + layer_table(folder) for folder in order)


def main() -> int:
    sys.stdout.write(module_map())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
