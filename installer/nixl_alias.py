"""kvstack's `nixl` package: written by the installer as nixl/__init__.py beside the NIXL module
a build made (nixl_cpu, nixl_xpu, nixl_cu13), in the build's site-packages and in its wheel.
Standalone: it imports nothing from kvstack.

Engines (vLLM, SGLang, Dynamo) import `from nixl._api import nixl_agent`. NIXL's own `nixl`
(PyPI's meta package) picks a CUDA backend, nixl_cu12 or nixl_cu13, each with its own UCX, and
knows nothing of nixl_cpu or nixl_xpu. This one binds `nixl` to the one backend its build made:
every submodule of it is the backend's own module object (`nixl._api is nixl_cpu._api`), so one
copy of each extension and one UCX are loaded, whichever name the engine imports.

It refuses, in one line naming what it found and what to do, what would put two NIXLs (two
UCXs) in one process or the wrong one under the engine: another NIXL backend already imported;
the backend it names found elsewhere than beside it; a CUDA backend for another CUDA major than
the process's torch. Other NIXLs installed but unused are named in one warning.

CONFIG is filled in when the package is written (installer/nixlpackage.py)."""
import importlib
import importlib.machinery
import importlib.util
import os
import pkgutil
import re
import sys
import warnings

CONFIG = {}  # filled in by the installer: {"backend": "nixl_cpu", "platform": ..., "build_id": ...}
HERE = os.path.dirname(os.path.abspath(__file__))
SITE = os.path.dirname(HERE)
# NIXL's module names: meson's wheel_variant (cpu, xpu) or, with CUDA, the CUDA major
BACKEND = re.compile(r"nixl_(cpu|xpu|cu(\d+))")


def _where(spec) -> str:
    if spec is None:
        return "?"
    if spec.submodule_search_locations:
        return os.path.realpath(list(spec.submodule_search_locations)[0])
    return os.path.realpath(spec.origin or "?")


def loaded_other_backends(backend, modules):
    """Other NIXL backends already imported: {name: file}."""
    return {n: getattr(m, "__file__", None) or "?" for n, m in list(modules.items())
            if BACKEND.fullmatch(n) and n != backend}


def installed_others(backend, paths, here=HERE):
    """NIXLs on `paths` this package does not use: other backends, and other `nixl` packages
    (PyPI's meta package, an older kvstack one). {name: directory}, first found of each."""
    found = {}
    for d in paths:
        if not d or not os.path.isdir(d):
            continue
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in sorted(names):
            p = os.path.join(d, n)
            if not os.path.isfile(os.path.join(p, "__init__.py")):
                continue
            if n == "nixl" and os.path.realpath(p) != os.path.realpath(here):
                found.setdefault("nixl", os.path.realpath(p))
            elif BACKEND.fullmatch(n) and n != backend:
                found.setdefault(n, os.path.realpath(p))
    return found


def torch_cuda_major(modules=sys.modules, find_spec=importlib.util.find_spec):
    """(CUDA major torch was built for, torch's file), or (None, None): read from an imported
    torch, else from torch/version.py on disk (importing torch here would cost a second)."""
    torch = modules.get("torch")
    if torch is not None:
        cuda = getattr(getattr(torch, "version", None), "cuda", None)
        m = re.match(r"(\d+)\.", str(cuda or ""))  # "12.8"; None: a CPU torch
        return (int(m[1]), getattr(torch, "__file__", "?")) if m else (None, None)
    try:
        spec = find_spec("torch")
    except (ImportError, ValueError):
        return None, None
    if spec is None or not spec.origin:
        return None, None
    version_py = os.path.join(os.path.dirname(spec.origin), "version.py")
    try:
        with open(version_py) as f:
            text = f.read(65536)
    except OSError:
        return None, None
    m = re.search(r"^cuda(?:\s*:\s*[^=\n]+)?\s*=\s*['\"](\d+)\.", text, re.M)
    return (int(m[1]), version_py) if m else (None, None)


def check_cuda(backend, major, torch_file):
    """A CUDA backend under a torch built for another CUDA major: one line, or None."""
    m = BACKEND.fullmatch(backend)
    if not m or not m[2] or major is None or int(m[2]) == major:
        return None
    return (f"nixl ({__file__}): this build's backend {backend} is for CUDA {m[2]}, but torch here "
            f"({torch_file}) is built for CUDA {major}: use a kvstack build or wheel made on a "
            f"CUDA {major} host (python -m installer --platform cuda), or a torch for CUDA {m[2]}")


def _refuse(message):
    raise ImportError(message)


def bind(config, modules=sys.modules, paths=None):
    """Import the backend named in config and make `nixl` and its submodules that backend's."""
    backend = str(config.get("backend", ""))
    about = f"kvstack's nixl ({__file__}, {config.get('platform', '?')} build " \
            f"{config.get('build_id', '?')})"
    if not BACKEND.fullmatch(backend):
        _refuse(f"{about} names no NIXL backend ({backend!r}): reinstall the build or wheel")
    paths = sys.path if paths is None else paths
    others = loaded_other_backends(backend, modules)
    if others:
        name, file = next(iter(others.items()))
        _refuse(f"{about}: {name} is already imported in this process ({file}), with its own "
                f"UCX; this build's is {backend}: import only `nixl`, or uninstall the other "
                f"(pip uninstall {name.replace('_', '-')} nixl)")
    said = check_cuda(backend, *torch_cuda_major(modules))
    if said:
        _refuse(said)
    mine = importlib.machinery.PathFinder.find_spec(backend, [SITE])
    if mine is None:
        _refuse(f"{about}: its backend {backend} is not beside it in {SITE}: reinstall the "
                f"build (python -m installer) or the wheel")
    if backend in modules:  # imported before `nixl`: from where?
        first = os.path.realpath(os.path.dirname(getattr(modules[backend], "__file__", "") or "?"))
    else:
        spec = importlib.util.find_spec(backend)
        if spec is None:
            _refuse(f"{about}: {backend} is beside it in {SITE}, which is not on sys.path: add "
                    f"it (the install's kvstack-nixl.pth and env.sh do)")
        first = _where(spec)
    if first != _where(mine):
        _refuse(f"{about}: two {backend} are installed, {_where(mine)} (this build's) and "
                f"{first} (first on sys.path): keep one (pip uninstall nixl, or remove the "
                f"kvstack-nixl.pth of the other build)")
    try:
        pkg = importlib.import_module(backend)
    except ImportError as e:
        _refuse(f"{about}: its backend {backend} does not import here ({e}): install the "
                f"build or wheel made for this host's platform")
    exported = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_kvstack"):
            continue  # the wheel's preload: the backend's own business
        try:
            sub = importlib.import_module(f"{backend}.{info.name}")
        except ImportError as e:  # an extension (_bindings, _utils) missing a library here
            _refuse(f"{about}: {backend}.{info.name} does not import here ({e}): install the "
                    f"build or wheel made for this host's platform")
        modules[f"nixl.{info.name}"] = sub
        exported[info.name] = sub
        for attr in dir(sub):
            if not attr.startswith("_"):
                exported.setdefault(attr, getattr(sub, attr))
    unused = installed_others(backend, paths)
    if unused:
        names = ", ".join(f"{n} ({p})" for n, p in unused.items())
        warnings.warn(f"`import nixl` is {about}: {backend} from {_where(mine)}; also installed "
                      f"and not used: {names}; to keep one NIXL, uninstall them (pip uninstall "
                      f"{' '.join(n.replace('_', '-') for n in unused)}) or remove the "
                      f"kvstack-nixl.pth naming their directory",
                      RuntimeWarning, stacklevel=3)
    exported["__kvstack__"] = {**config, "backend_file": _where(mine), "unused": unused}
    return exported


if __name__ == "nixl":
    globals().update(bind(CONFIG))
