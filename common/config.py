"""Typed YAML configs with ``key=value`` overrides.

Configs are pydantic models that forbid unknown keys, so a typo in a YAML file or an override fails at start with
a message naming the field. Overrides use dotted paths (``filters.min_short_side=512``) and YAML value syntax
(``stages.text_overlay.enabled=false``, ``stages.person.actors=[1,4]``). A file may start from another with
``_base_: other.yaml`` (a path relative to it, as mmengine configs do): its mappings are merged key by key into
the base's, so a task's config states only what differs from the shared one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key and what to do."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def apply_override(tree: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r} is not of the form key=value (e.g. filters.min_short_side=512)")
    dotted, _, raw = override.partition("=")
    parts = [p for p in dotted.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {override!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {dotted}: cannot parse value {raw!r}: {exc}") from None
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _describe(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {where}: unknown key")
        elif err["type"] == "value_error" and isinstance(err.get("input"), dict):
            # a validator's own message about a whole section names what is wrong; the section would bury it
            lines.append(f"  {where}: {err['ctx']['error']}")
        else:
            lines.append(f"  {where}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A config file's mapping, with its ``_base_`` chain merged underneath."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (see configs/ for the shipped ones)")
    if path.resolve() in seen:
        raise ConfigError(f"config file {path} names itself as its own _base_ (through {' -> '.join(map(str, seen))})")
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    base = loaded.pop("_base_", None)
    if base is None:
        return loaded
    tree = _read_yaml(path.parent / str(base), (*seen, path.resolve()))
    _merge(tree, loaded)
    return tree


def _merge(tree: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            tree[key] = dict(tree[key])
            _merge(tree[key], value)
        else:
            tree[key] = value


def load_config(model: type[M], path: str | Path | None, overrides: Sequence[str] = (), base: dict | None = None) -> M:
    """Read ``path`` (YAML) into ``model``, applying ``key=value`` overrides on top."""
    tree: dict = dict(base or {})
    source = "defaults"
    if path is not None:
        _merge(tree, _read_yaml(Path(path)))
        source = str(path)
    for override in overrides:
        apply_override(tree, override)
    if overrides:
        source += " + overrides " + " ".join(overrides)
    try:
        return model.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None


def hash_json(obj) -> str:
    """A short stable hash of JSON-able data (sorted keys)."""
    payload = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def hash_json_each(items: Iterable) -> str:
    """``hash_json`` of a long sequence (10^6 commit records at 1B images) without one string of all of it: each
    item's JSON goes into one digest in turn."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(json.dumps(item, sort_keys=True, separators=(",", ":")).encode() + b"\n")
    return digest.hexdigest()[:16]


def config_hash(cfg: BaseModel, exclude: set[str] | None = None) -> str:
    """A short stable hash of the settings that change results (sorted JSON of the model)."""
    return hash_json(cfg.model_dump(mode="json", exclude=exclude))


@dataclass(frozen=True)
class SettingsField:
    """One key of a settings class, as the configuration reference lists it."""

    key: str  # dotted, as an override names it; ``<name>`` stands for a mapping's key, ``[]`` for a list's item
    annotation: object
    default: object  # the declared default (``FIELD_REQUIRED`` where there is none), or a default factory's value
    description: str | None
    owner: type[BaseModel]


FIELD_REQUIRED = object()


def settings_fields(model: type[BaseModel], prefix: str = "") -> Iterator[SettingsField]:
    """Every key of ``model``, nested settings classes walked into (a mapping of them as ``<name>``, a list as
    ``[]``), each key before the keys under it."""
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        if info.default_factory is not None:
            default = info.default_factory()  # type: ignore[call-arg]
        else:
            default = FIELD_REQUIRED if info.is_required() else info.default
        yield SettingsField(key, info.annotation, default, info.description, model)
        for inner, suffix in _nested_models(info.annotation):
            yield from settings_fields(inner, f"{key}{suffix}.")


def _nested_models(annotation: object) -> Iterator[tuple[type[BaseModel], str]]:
    """The settings classes a field's type holds, with how a key names an item of them."""
    origin, args = get_origin(annotation), get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, ""
    elif origin in (dict, Mapping) and len(args) == 2:
        for inner, suffix in _nested_models(args[1]):
            yield inner, ".<name>" + suffix
    elif origin in (list, tuple, Sequence) and args:
        for inner, suffix in _nested_models(args[0]):
            yield inner, "[]" + suffix
    else:
        for arg in args:  # a union (X | None), an Annotated
            yield from _nested_models(arg)
