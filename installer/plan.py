"""The resolve phase: a recipe plus this host's choices become a Plan, the whole install written
out before anything runs (`--dry-run` prints it, `--json` as JSON).

Where things go. `--prefix P` is a symbolic link to one immutable install directory per build,
`P.builds/<build id>/`, with a directory per component inside. Everything is configured for its
final path (RUNPATHs, UCX's module dir, pkg-config files), so verification runs in place before
the link switches, and the switch is one rename: the previous install stays whole until then.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import rdma
from .buildsys import STEP_MAKERS
from .buildsys.step import Step
from .errors import UsageError
from .recipe import PLACEHOLDER, Recipe

PLAN_FORMAT = 1
# raised whenever the code changes what one recipe builds, so the build id (and every cache keyed
# by it) changes with it: 2 = file-prefix maps in every compile (installer/buildsys/filemap.py)
BUILD_RULES = 2


@dataclass(frozen=True)
class Target:
    """The Python environment that receives NIXL's module and runs kvruntime's self-test."""
    python: str
    version: str          # "3.11"
    tag: str              # "cp311"

    @classmethod
    def probe(cls, python: str) -> "Target":
        code = "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"
        try:
            out = subprocess.run(
                [python, "-c", code], capture_output=True, text=True, timeout=30, check=True
            )
        except (OSError, subprocess.SubprocessError) as e:
            raise UsageError(
                f"--python {python} does not run ({e.__class__.__name__})",
                fix="give the path of a Python 3 interpreter, e.g. --python /usr/bin/python3",
            ) from None
        version = out.stdout.strip()
        if not re.fullmatch(r"3\.\d+", version):  # /bin/true runs and prints nothing
            raise UsageError(
                f"--python {python} is not a Python 3 interpreter (it printed "
                f"{version[:40]!r} for its version)",
                fix="give the path of a Python 3 interpreter, e.g. --python /usr/bin/python3",
            )
        return cls(python, version, "cp" + version.replace(".", ""))


@dataclass
class ComponentPlan:
    name: str
    build: str
    source: str
    spec: dict[str, Any]
    depends: list[str]
    subprojects: list[str]
    install_dir: Path
    src_dir: Path
    build_dir: Path
    jobs: int
    env: dict[str, str] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)


WORK = ".work"  # the build's own source and build trees, inside its install directory


@dataclass
class Plan:
    platform: str
    platform_reason: str
    recipe: Recipe
    build_id: str
    prefix: Path
    install_dir: Path
    work_dir: Path
    cache_dir: Path
    jobs: int
    component_jobs: (
        int  # components built side by side at most (the dependency graph allows the rest)
    )
    target: Target
    cuda_home: str
    components: list[ComponentPlan]
    runtime_env: dict[str, str]

    @property
    def sources(self) -> dict[str, dict[str, Any]]:
        return self.recipe.sources

    @property
    def system_packages(self) -> dict[str, dict[str, str]]:
        return self.recipe.data["system_packages"]

    @property
    def verify(self) -> dict[str, Any]:
        return self.recipe.data["verify"]

    @property
    def kv_buffer(self) -> str:
        return self.recipe.data["runtime"]["kv_buffer"]

    def used_sources(self) -> list[str]:
        """Sources this plan needs, in build order (subprojects right after their user)."""
        names: list[str] = []
        for comp in self.components:
            for n in [comp.source, *comp.subprojects]:
                if n not in names:
                    names.append(n)
        lz = self.verify.get("level_zero")
        if lz and lz["null_driver_source"] not in names:
            names.append(lz["null_driver_source"])
        return names

    def unreleased(self) -> dict[str, dict[str, Any]]:
        """Sources this plan builds that are no release: upstream pull requests, by source."""
        return {
            n: self.sources[n]["pull_request"]
            for n in self.used_sources()
            if "pull_request" in self.sources[n]
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "platform": self.platform,
            "variant": self.recipe.variant,
            "platform_reason": self.platform_reason,
            "recipe_files": [str(f) for f in self.recipe.files],
            "build_id": self.build_id,
            "prefix": str(self.prefix),
            "install_dir": str(self.install_dir),
            "work_dir": str(self.work_dir),
            "cache_dir": str(self.cache_dir),
            "jobs": self.jobs,
            "component_jobs": self.component_jobs,
            "python": {"path": self.target.python, "version": self.target.version},
            "sources": {n: self.sources[n] for n in self.used_sources()},
            "unreleased": self.unreleased(),
            "components": [
                {"name": c.name, "build": c.build, "source": c.source, "depends": c.depends,
                 "subprojects": c.subprojects, "install_dir": str(c.install_dir), "env": c.env,
                 "steps": [s.to_dict() for s in c.steps]}
                for c in self.components
            ],
            "system_packages": self.system_packages,
            "runtime": {"kv_buffer": self.kv_buffer, "env": self.runtime_env},
            "verify": self.verify,
        }

    def render(self) -> str:
        variant = f", variant {self.recipe.variant}" if self.recipe.variant else ""
        lines = [
            f"kvstack install plan: platform {self.platform}{variant} ({self.platform_reason})",
            f"  recipe:      {', '.join(str(f) for f in self.recipe.files)}",
            f"  build id:    {self.build_id}",
            f"  prefix:      {self.prefix} -> {self.install_dir}",
            f"  python:      {self.target.python} ({self.target.version})",
            f"  jobs:        {self.jobs} (one component's compile at a time; up to "
            f"{self.component_jobs} components side by side, as dependencies allow)",
            f"  cache:       {self.cache_dir}",
            "",
            "sources:",
        ]
        for name in self.used_sources():
            s = self.sources[name]
            pin = [f"sha256 {s['sha256']}"] if "sha256" in s else []
            if "commit" in s:
                pin.append(
                    f"commit {s['commit']}"
                    + (f" (tag {s['tag']})" if "tag" in s else " (no tag: pinned by commit alone)")
                )
            if "pull_request" in s:
                pr = s["pull_request"]
                pin.append(
                    f"UNRELEASED: upstream pull request {pr['number']} \"{pr['title']}\" "
                    f"({pr['url']})"
                )
            lines.append(f"  {name:13} {s['url']}")
            lines += [f"  {'':13} {p}" for p in pin]
        ucx = next((c for c in self.components if c.name == "ucx"), None)
        if ucx is not None:
            lines += ["", "RDMA (UCX between hosts):", *rdma.plan_lines(ucx.spec.get("with", {}))]
        lines += [
            "",
            "system packages (debian):",
            *(f"  {pkg:13} {why}" for pkg, why in self.system_packages.get("debian", {}).items()),
        ]
        for comp in self.components:
            lines += [
                "",
                f"component {comp.name} ({comp.build}, source {comp.source}) -> {comp.install_dir}",
            ]
            if comp.env:
                lines.append("  env: " + " ".join(f"{k}={v}" for k, v in comp.env.items()))
            lines += [f"  {s.phase:9} {s.describe()}" for s in comp.steps]
        lines += ["", f"runtime: kv_buffer = {self.kv_buffer}", "env.sh exports:",
                  *(f"  {k}={v}" for k, v in self.runtime_env.items())]
        v = self.verify
        lines += [
            "",
            "verification must prove:",
            f"  built:  ucx_info -b defines {v['ucx']['defines'] or '(none beyond the base)'}, "
            f"modules {v['ucx']['modules']}",
            f"  loaded: ucx_info -d transports {v['ucx']['transports']}, memory domains "
            f"{v['ucx']['memory_domains']}; NIXL module {v['nixl']['module']} with plugins "
            f"{v['nixl']['plugins']}",
        ]
        if "level_zero" in v:
            lines.append(
                "          (no Intel GPU: Level Zero null driver from "
                f"{v['level_zero']['null_driver_source']}, mark {v['level_zero']['mark']!r})"
            )
        if "policy" in v:
            lines.append(
                f"          kvruntime's UCX_TLS for {v['policy']['device']} memory on one node "
                f"from that list: {v['policy']['ucx_tls'] or '(left to UCX)'}"
            )
        if "rdma" in v:
            r = v["rdma"]
            lines.append(
                "          RDMA: the devices `ibv_devices` lists; with none, UCX's fake device "
                f"(contrib/ibmock) shows {r['memory_domains']} with {r['transports']} and NIXL's "
                "UCX backend comes up on it"
            )
        device = (
            ""
            if self.kv_buffer != "device"
            else f", {self.platform} memory where the device is here"
        )
        lines.append(
            f"  moved:  python -m kvruntime selftest on the new stack: host memory always{device}"
        )
        if "rdma" in v:
            lines.append(
                f"          RDMA: a READ held to UCX_TLS={v['rdma']['moved_tls']} on "
                f"{v['rdma']['net_device']} (one process, two NIXL agents), bit-exact, its lanes "
                "read back on that device; between hosts: not proven without an HCA"
            )
        return "\n".join(lines)


def default_prefix() -> Path:
    return Path(os.environ.get("KVSTACK_PREFIX", Path.home() / ".local" / "kvstack"))


def default_cache_dir() -> Path:
    env = os.environ.get("KVSTACK_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs
    return Path(platformdirs.user_cache_dir("kvstack"))


def make_plan(
    recipe: Recipe,
    *,
    prefix: Path,
    cache_dir: Path,
    jobs: int,
    target: Target,
    platform_reason: str,
    cuda_home: str | None = None,
    component_jobs: int | None = None,
) -> Plan:
    """component_jobs: how many components may build at once (None: as many as the dependency
    graph allows; 1: one after another). Neither it nor jobs enters the build id: they change
    when things are built, not what."""
    if jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {jobs}")
    if component_jobs is not None and component_jobs < 1:
        raise UsageError(f"--component-jobs must be at least 1, got {component_jobs}")
    cuda_home = cuda_home or os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    prefix = Path(os.path.abspath(prefix))
    if prefix == Path("/"):
        raise UsageError(
            "--prefix / would replace the root directory", fix="choose a directory of its own"
        )
    build_id = _build_id(recipe, target, cuda_home)
    install_dir = prefix.parent / f"{prefix.name}.builds" / build_id
    # The source and build trees live inside the build they make, removed once it is finished:
    # a compile there names its dependencies (../../../ucx/include) and sources by the same
    # relative paths in every build, whatever its prefix and id, so a compiler cache with a
    # base directory above the builds (ccache's base_dir: CI's pinned builds) hands one build
    # what another compiled (NIXL is the same source and flags in cpu, xpu and xpu ze-ipc).
    work_dir = install_dir / WORK
    comps = []
    for name in recipe.build_order():
        spec = recipe.components[name]
        comps.append(
            ComponentPlan(
                name=name,
                build=spec["build"],
                source=spec["source"],
                spec={},
                depends=list(spec.get("depends", [])),
                subprojects=list(spec.get("subprojects", [])),
                install_dir=install_dir / name,
                src_dir=work_dir / "src" / name,
                build_dir=work_dir / "build" / name,
                jobs=jobs,
            )
        )
    subst = _substituter(install_dir, cuda_home, target.python)
    by_name = {c.name: c for c in comps}
    for comp in comps:
        comp.spec = subst(recipe.components[comp.name])
        comp.env = _component_env(comp, by_name)
        comp.steps = STEP_MAKERS[comp.build](comp)
    runtime_env = subst(dict(recipe.data["runtime"].get("env", {})))
    return Plan(
        platform=recipe.platform,
        platform_reason=platform_reason,
        recipe=recipe,
        build_id=build_id,
        prefix=prefix,
        install_dir=install_dir,
        work_dir=work_dir,
        cache_dir=cache_dir,
        jobs=jobs,
        component_jobs=component_jobs or len(comps),
        target=target,
        cuda_home=cuda_home,
        components=comps,
        runtime_env=runtime_env,
    )


def _build_id(recipe: Recipe, target: Target, cuda_home: str) -> str:
    """Same recipe, same Python, same CUDA: same id, and a re-run finds the finished build."""
    key = json.dumps({"recipe": recipe.data, "python": target.tag, "cuda_home": cuda_home,
                      "plan_format": PLAN_FORMAT, "build_rules": BUILD_RULES}, sort_keys=True)
    return f"{recipe.platform}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _substituter(install_dir: Path, cuda_home: str, python: str):
    def one(text: str) -> str:
        def repl(m):
            base, arg = m.group(1), m.group(2)
            if base == "prefix":
                return str(install_dir / arg) if arg else str(install_dir)
            return {"cuda_home": cuda_home, "python": python}[base]
        return PLACEHOLDER.sub(repl, text)

    def walk(value):
        if isinstance(value, str):
            return one(value)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value
    return walk


def _component_env(comp: ComponentPlan, by_name: dict[str, ComponentPlan]) -> dict[str, str]:
    """What a component's build sees of its dependencies: their pkg-config files and cmake
    packages, then the recipe's own variables."""
    env: dict[str, str] = {}
    deps = [by_name[d].install_dir for d in _closure(comp.name, by_name)]
    if deps:
        env["PKG_CONFIG_PATH"] = os.pathsep.join(str(d / sub) for d in deps
                                                 for sub in ("lib/pkgconfig", "share/pkgconfig"))
        env["CMAKE_PREFIX_PATH"] = os.pathsep.join(str(d) for d in deps)
    env.update(comp.spec.get("env", {}))
    return env


def _closure(name: str, by_name: dict[str, ComponentPlan]) -> list[str]:
    out: list[str] = []
    for dep in by_name[name].depends:
        for d in [*_closure(dep, by_name), dep]:
            if d not in out:
                out.append(d)
    return out


def default_jobs() -> int:
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )


def current_python() -> str:
    return sys.executable
