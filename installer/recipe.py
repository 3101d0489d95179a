"""Recipes: TOML data per platform, laid over defaults.toml, checked against schema.json.

A recipe is data only. Loading refuses malformed TOML, unknown keys (with a "did you mean"),
sources without a pin and references to things that do not exist, each with one clear line.
"""
from __future__ import annotations

import copy
import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import jsonschema
import tomllib

from .errors import RecipeError

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
PLATFORMS = ("cpu", "cuda", "xpu", "tpu")
DEFAULTS = "defaults.toml"
SCHEMA = "schema.json"
VARIANTS = "variants"   # <platform>-<variant>.toml: a named choice within a platform, laid over it
# What a source's tag and pull_request say is about one commit: a layer that pins another commit
# drops them unless it sets them itself (an unreleased pull request's head has no release tag).
COMMIT_NAMES = ("tag", "pull_request")
PLACEHOLDER = re.compile(r"\{([a-z_]+)(?::([a-z][a-z0-9_-]*))?\}")
PLACEHOLDER_NAMES = {"prefix", "cuda_home", "python"}


@dataclass(frozen=True)
class Recipe:
    platform: str
    data: dict[str, Any]
    files: tuple[Path, ...]

    @property
    def variant(self) -> str | None:
        return self.data.get("variant")

    @property
    def sources(self) -> dict[str, dict[str, Any]]:
        return self.data["sources"]

    @property
    def components(self) -> dict[str, dict[str, Any]]:
        return self.data["components"]

    def build_order(self) -> list[str]:
        """Components in dependency order (stable: recipe order where free)."""
        order: list[str] = []
        state: dict[str, str] = {}

        def visit(name: str, chain: tuple[str, ...]) -> None:
            if state.get(name) == "done":
                return
            if state.get(name) == "visiting":
                raise RecipeError(f"components form a cycle: {' -> '.join(chain + (name,))}",
                                  fix="remove one of the depends entries")
            state[name] = "visiting"
            for dep in self.components[name].get("depends", []):
                visit(dep, chain + (name,))
            state[name] = "done"
            order.append(name)

        for name in self.components:
            visit(name, ())
        return order


def variants(platform: str, recipes_dir: Path = RECIPES_DIR) -> list[str]:
    """The named variants of a platform (recipes/variants/<platform>-<variant>.toml)."""
    return sorted(
        p.stem[len(platform) + 1 :] for p in (recipes_dir / VARIANTS).glob(f"{platform}-*.toml")
    )


def load(platform: str, overlays: Iterable[Path] = (), recipes_dir: Path = RECIPES_DIR,
         variant: str | None = None) -> Recipe:
    if platform not in PLATFORMS:
        raise RecipeError(
            f"unknown platform {platform!r}",
            fix=f"choose one of {', '.join(PLATFORMS)}{_did_you_mean(platform, PLATFORMS)}",
        )
    schema = json.loads((recipes_dir / SCHEMA).read_text())
    layer_schema = _without_required(schema)
    files = [recipes_dir / DEFAULTS, recipes_dir / f"{platform}.toml"]
    if variant is not None:
        known = variants(platform, recipes_dir)
        if variant not in known:
            raise RecipeError(
                f"platform {platform} has no variant {variant!r}",
                fix=(
                    f"choose one of {', '.join(known)}{_did_you_mean(variant, known)}"
                    if known
                    else f"{platform} has no variants: leave --variant out"
                ),
            )
        files.append(recipes_dir / VARIANTS / f"{platform}-{variant}.toml")
    files += map(Path, overlays)
    merged: dict[str, Any] = {}
    for path in files:
        layer = _read_toml(path)
        _validate(layer, layer_schema, path)
        merged = _merge(_drop_other_commit_names(merged, layer), layer)
    _validate(merged, schema, files[-1] if len(files) > 2 else files[1])
    for key, want, where in (("platform", platform, files[1]), ("variant", variant, files[-1])):
        if merged.get(key) != want:
            raise RecipeError(
                f"{where}: says {key} = {merged.get(key)!r}",
                expected=repr(want),
                actual=repr(merged.get(key)),
                fix=f"a recipe overlay may not change the {key} (a variant file names its own)",
            )
    _drop_false_packages(merged)
    _drop_disabled_components(merged)
    recipe = Recipe(platform, merged, tuple(files))
    _check_references(recipe)
    recipe.build_order()
    return recipe


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise RecipeError(
            f"recipe file {path} does not exist",
            fix="check the path, or run from a kvstack checkout",
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(
            f"{path}: malformed TOML: {e}", fix="fix the syntax at that line"
        ) from None
    except IsADirectoryError:
        raise RecipeError(f"recipe file {path} is a directory", fix="pass a TOML file") from None
    except UnicodeDecodeError as e:  # tomllib decodes UTF-8 before it parses: a binary file
        raise RecipeError(
            f"{path}: not a UTF-8 text file (byte {e.start}: {e.reason})", fix="pass a TOML file"
        ) from None
    except OSError as e:
        raise RecipeError(
            f"recipe file {path} cannot be read: {e.strerror}",
            fix="check the path and its permissions",
        ) from None


def _merge(base: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _drop_other_commit_names(merged: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    """A source the layer pins at another commit keeps no tag or pull_request of the old one."""
    out = copy.deepcopy(merged)
    for name, src in layer.get("sources", {}).items():
        old = out.get("sources", {}).get(name, {})
        if "commit" in src and src["commit"] != old.get("commit"):
            for key in COMMIT_NAMES:
                if key not in src:
                    old.pop(key, None)
    return out


def _without_required(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {
            k: _without_required(v)
            for k, v in schema.items()
            if k not in ("required", "minProperties")
        }
    if isinstance(schema, list):
        return [_without_required(v) for v in schema]
    return schema


def _validate(data: dict[str, Any], schema: dict[str, Any], path: Path) -> None:
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(
        validator.iter_errors(data),
        key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))),
    )
    if not errors:
        return
    err = errors[0]
    where = ".".join(str(p) for p in err.absolute_path) or "(top level)"
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        allowed = list(err.schema.get("properties", {}))
        unknown = [k for k in err.instance if k not in allowed]
        key = unknown[0] if unknown else "?"
        full = f"{where}.{key}" if err.absolute_path else key
        raise RecipeError(f"{path}: unknown key {full!r}",
                          fix=f"allowed here: {', '.join(allowed)}{_did_you_mean(key, allowed)}")
    if err.validator == "required":
        raise RecipeError(f"{path}: {where}: {err.message}", fix="add the missing key")
    if err.validator == "pattern" and where.endswith((".sha256", ".commit")):
        raise RecipeError(f"{path}: {where} is not a valid pin: {err.instance!r}",
                          fix="sha256 takes 64 lowercase hex digits, commit 40")
    raise RecipeError(f"{path}: {where}: {err.message}", fix="see recipes/schema.json")


def _drop_false_packages(data: dict[str, Any]) -> None:
    for family, table in data.get("system_packages", {}).items():
        data["system_packages"][family] = {k: v for k, v in table.items() if v is not False}


def _drop_disabled_components(data: dict[str, Any]) -> None:
    """`enabled = false` removes a component (e.g. an overlay that builds UCX alone)."""
    comps = data["components"]
    off = [n for n, c in comps.items() if c.get("enabled") is False]
    for name in off:
        del comps[name]
    for name, comp in comps.items():
        for dep in comp.get("depends", []):
            if dep in off:
                raise RecipeError(f"component {name!r} depends on {dep!r}, which is disabled",
                                  fix=f"disable {name!r} too, or enable {dep!r}")
    if not comps:
        raise RecipeError(
            "every component is disabled: nothing to build", fix="enable at least one component"
        )


def _check_references(recipe: Recipe) -> None:
    sources, components = recipe.sources, recipe.components
    for name, src in sources.items():
        kind = src.get("kind", "archive")
        if kind == "archive" and "sha256" not in src:
            raise RecipeError(
                f"source {name!r} has no pin",
                fix="add sha256 = \"<64 hex>\" (archives) or kind = \"git\" with commit = \"<40 "
                "hex>\"",
            )
        if kind == "git" and "commit" not in src:
            raise RecipeError(
                f"git source {name!r} has no pin", fix="add commit = \"<full 40-hex commit>\""
            )
        if kind == "archive" and "filename" not in src:
            raise RecipeError(
                f"source {name!r} has no filename",
                fix="add filename = \"<name>.tar.gz\" (the name mirrors and caches use)",
            )
    for name, comp in components.items():
        if comp["source"] not in sources:
            raise RecipeError(
                f"component {name!r} uses unknown source {comp['source']!r}",
                fix=f"sources are: {', '.join(sources)}{_did_you_mean(comp['source'], sources)}",
            )
        for dep in comp.get("depends", []):
            if dep not in components:
                raise RecipeError(
                    f"component {name!r} depends on unknown component {dep!r}",
                    fix=f"components are: {', '.join(components)}{_did_you_mean(dep, components)}",
                )
        for sub in comp.get("subprojects", []):
            if sub not in sources:
                raise RecipeError(f"component {name!r} names unknown subproject source {sub!r}",
                                  fix=f"sources are: {', '.join(sources)}")
        for text in _strings(comp):
            for m in PLACEHOLDER.finditer(text):
                base, arg = m.group(1), m.group(2)
                if base not in PLACEHOLDER_NAMES or (
                    base == "prefix" and arg and arg not in components
                ):
                    raise RecipeError(
                        f"component {name!r}: unknown placeholder {m.group(0)!r}",
                        fix="placeholders: {prefix}, {prefix:COMPONENT}, {cuda_home}, {python}",
                    )
    lz = recipe.data["verify"].get("level_zero")
    if lz and lz["null_driver_source"] not in sources:
        raise RecipeError(f"verify.level_zero names unknown source {lz['null_driver_source']!r}",
                          fix=f"sources are: {', '.join(sources)}")


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
