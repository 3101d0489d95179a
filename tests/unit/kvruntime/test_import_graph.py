"""The package's import graph, read from the source (ast, no import): no circle among kvruntime's
modules, its folders stand in floors (no folder imports one above it, nor a sibling on its own
floor), the library never imports its tools, and kvruntime and the installer never import each
other (the installer runs kvruntime's CLI in the target Python instead, DESIGN §2).

Every import counts, inside functions and under ``if TYPE_CHECKING:`` too: a circle for the type
checker is a circle for the reader."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# kvruntime's folders, lowest floor first: a module imports only from its own folder and the
# floors below. Folders on one floor are siblings and never import each other.
FLOORS = [
    ("",),  # the root: the model (errors, numbers, options, layout, plan, tp, memory, jobs,
    #         native)
    ("host",),  # this host's calls: CUDA runtime, another process's memory, timer slack, peercred
    ("wire",),  # the side channel: frames, messages, handshake, channel, listener, mailbox
    ("nixl",),  # NIXL and UCX: binding, agent, transports, UCX's log, NICs, registration, transfer
    ("pools",),  # the staging pools: their units, copies and bounce ring
    ("engines",),  # what moves a request: Engine, its choice, same-node, gather, staged, coalesced
    ("decode", "prefill"),  # the two sides
    ("tools",),  # bench, selftest and their processes: the library never imports them
]
# the package's face: ``kvruntime`` (its public names, read lazily) and ``python -m kvruntime``
FACE = {"kvruntime", "kvruntime.__main__"}


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
    assert "kvruntime.decode.client" in graph and graph["kvruntime.decode.client"], (
        "the graph was not read"
    )
    assert _circles(graph) == []


def _folder(module: str, modules: dict[str, Path]) -> str:
    """The folder of kvruntime that holds ``module`` ("" for the package's root)."""
    parts = modules[module].relative_to(ROOT / "kvruntime").parts
    return parts[0] if len(parts) > 1 else ""


def _upward(graph: dict[str, set[str]], folder_of, floors) -> list[str]:
    """Every import of a folder above the importer's, or of a sibling folder on its floor."""
    floor = {folder: n for n, names in enumerate(floors) for folder in names}
    bad = []
    for module in sorted(set(graph) - FACE):
        mine = folder_of(module)
        for target in sorted(graph[module]):
            theirs = folder_of(target)
            if floor[theirs] > floor[mine] or (floor[theirs] == floor[mine] and theirs != mine):
                bad.append(f"{module} ({mine or 'root'}) imports {target} ({theirs or 'root'})")
    return bad


def test_the_floor_rule_finds_an_import_upward_and_across():
    floors = [("",), ("low",), ("left", "right")]
    folder = {"p.a": "", "p.low.b": "low", "p.left.c": "left", "p.right.d": "right"}.get
    assert _upward({"p.a": set(), "p.low.b": {"p.a"}, "p.left.c": {"p.low.b", "p.a"},
                    "p.right.d": {"p.low.b"}}, folder, floors) == []
    assert _upward({"p.a": {"p.low.b"}, "p.low.b": set(), "p.left.c": {"p.right.d"},
                    "p.right.d": set()}, folder, floors) == [
        "p.a (root) imports p.low.b (low)", "p.left.c (left) imports p.right.d (right)"]


def test_every_folder_of_kvruntime_has_a_floor():
    mods = _modules("kvruntime")
    declared = {folder for names in FLOORS for folder in names}
    assert {_folder(m, mods) for m in mods} - declared == set(), "add the folder to FLOORS"


def test_no_folder_imports_one_above_it():
    mods = _modules("kvruntime")
    assert _upward(_graph("kvruntime"), lambda m: _folder(m, mods), FLOORS) == []


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
