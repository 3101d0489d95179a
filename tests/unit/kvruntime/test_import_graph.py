"""The package's import graph, read from the source (ast, no import): no circle among kvruntime's
modules, the library never imports its tools, and kvruntime and the installer never import each
other (the installer runs kvruntime's CLI in the target Python instead, DESIGN §2).

Every import counts, inside functions and under ``if TYPE_CHECKING:`` too: a circle for the type
checker is a circle for the reader."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _modules(package: str) -> dict[str, Path]:
    mods = {}
    for path in (ROOT / package).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """The absolute names of the modules and packages ``name`` imports at run time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (".".join(filter(None, (base, node.module))) if node.level
                      else node.module)
            # "from . import native" imports the submodule, not the package's own names
            found.update(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules
                         else target for alias in node.names)
    return found


def _graph(package: str) -> dict[str, set[str]]:
    mods = _modules(package)
    return {name: {t for t in _imports(name, path, mods) if t in mods and t != name}
            for name, path in mods.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_kvruntime_has_no_import_circle():
    graph = _graph("kvruntime")
    assert "kvruntime.decode" in graph and graph["kvruntime.decode"], "the graph was not read"
    assert _circles(graph) == []


def test_the_library_never_imports_its_tools():
    graph = _graph("kvruntime")
    library = [m for m in graph if not m.startswith(("kvruntime.tools", "kvruntime.__main__"))]
    offenders = {m: sorted(t for t in graph[m] if t.startswith("kvruntime.tools")) for m in library}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_kvruntime_and_the_installer_never_import_each_other():
    for package, other in (("kvruntime", "installer"), ("installer", "kvruntime")):
        mods = _modules(package)
        bad = {name: sorted(t for t in _imports(name, path, mods) if t.split(".")[0] == other)
               for name, path in mods.items()}
        assert {n: t for n, t in bad.items() if t} == {}, f"{package} imports {other}"
