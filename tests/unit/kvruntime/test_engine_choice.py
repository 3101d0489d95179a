"""An engine is chosen once (kvruntime/engines/choice.py) and asked, never asked about: outside
the choice no library module compares an engine's name with a string (``peer.engine ==
"nixl"``, ``route.engine == "host_staged"``, ``engine.startswith("samenode")``), read from the
source (ast, no import). The tools compare the mode names they are given (``--engines``), not a
peer's engine, and are not the library."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
LIBRARY = ROOT / "kvruntime"
CHOICE = LIBRARY / "engines" / "choice.py"


def _names_engine(node) -> bool:
    """Whether the expression is a name or attribute that says "engine"."""
    if isinstance(node, ast.Name):
        return "engine" in node.id
    if isinstance(node, ast.Attribute):
        return "engine" in node.attr
    if isinstance(node, ast.Subscript):
        key = node.slice
        return isinstance(key, ast.Constant) and key.value == "engine"
    return False


def _strings(node) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_strings(e) for e in node.elts)
    return False


def _branches(tree) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(map(_names_engine, sides)) and any(map(_strings, sides)):
                lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith")
              and _names_engine(node.func.value)):
            lines.append(node.lineno)
    return lines


def test_the_checker_sees_each_form():
    for source in ('peer.engine == "nixl"', 'route.engine != "host_staged"',
                   'engine in ("nixl", "host_staged")', 'peer.engine.startswith("samenode")',
                   'r["engine"] in ("nixl",)'):
        assert _branches(ast.parse(source)), source
    for source in ('o.kv_buffer == "host_staged"', "engine not in ENGINES",
                   'self.engine = "nixl"'):
        assert not _branches(ast.parse(source)), source


def test_no_branch_on_an_engine_name_outside_the_choice():
    found = []
    for path in sorted(LIBRARY.rglob("*.py")):
        if path == CHOICE or "tools" in path.relative_to(LIBRARY).parts:
            continue
        found += [f"{path.relative_to(ROOT)}:{line}"
                  for line in _branches(ast.parse(path.read_text(), str(path)))]
    assert not found, ("asks which engine a peer has outside engines/choice.py (ask the "
                       "peer's Engine instead, engines/engine.py): " + ", ".join(found))


def _root(node) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def test_engines_write_no_field_of_a_peer_or_a_handle():
    """engines/ gives what it finds back (return values, a handle's methods), never sets a
    ``PrefillPeer``'s or a ``TransferHandle``'s fields from outside (``peer.route = ...``)."""
    found = []
    for path in sorted((LIBRARY / "engines").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno}" for t in targets
                      if isinstance(t, ast.Attribute) and _root(t) in ("peer", "handle")]
    assert not found, "engines/ writes a peer's or a handle's field: " + ", ".join(found)
