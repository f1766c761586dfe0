"""Write the configuration reference (docs/reference/configuration.md) from the settings classes.

    python tools/config_reference.py            # rewrite the page
    python tools/config_reference.py --check    # exit 1 if the page is out of date (tests/test_docs.py runs it)

Every key of every job's config, with its type, its default and the description its field declares
(``Field(..., description=...)``: the one source), is listed a section at a time; each stage's entry under
``stages`` with the defaults its class declares.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.config import FIELD_REQUIRED, SettingsField, settings_fields  # noqa: E402

PAGE = REPO / "docs" / "reference" / "configuration.md"
LONGEST_DEFAULT = 120  # characters of a default shown in a table cell; a longer one points at its class


def _configs() -> list[tuple[str, str, type[BaseModel]]]:
    from curation.config import CurateConfig
    from finetune.config import FinetuneConfig
    from pretrain.config import PretrainConfig

    return [
        ("Curation", "`jobs.curate`, `jobs.audit`: configs/curate/*.yaml", CurateConfig),
        ("Pretraining", "`jobs.pretrain`: configs/pretrain/*.yaml", PretrainConfig),
        ("Fine-tuning", "`jobs.finetune`: configs/finetune/*.yaml", FinetuneConfig),
    ]


def type_name(annotation: object) -> str:
    """A field's type as a reader writes it in YAML terms: ``int``, ``list[str]``, ``"a" | "b"``, ``float | null``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_member_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_member_name(a) for a in args)}]" if args else name
    if isinstance(annotation, type):
        return "section" if issubclass(annotation, BaseModel) else annotation.__name__
    return re.sub(r"\b(typing|[a-z_]+(\.[a-z_]+)*)\.", "", str(annotation))


def _member_name(annotation: object) -> str:
    """A type inside another (a union's member, a list's item): a settings class by its name."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _member_name(typing.get_args(annotation)[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation.__name__
    return type_name(annotation)


def _plain(value: object) -> object:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def default_text(field: SettingsField) -> str:
    if field.default is FIELD_REQUIRED:
        return "required"
    if type_name(field.annotation) == "section":
        return ""  # its keys follow
    value = _plain(field.default)
    text = value if isinstance(value, str) and value else json.dumps(value)
    if len(text) > LONGEST_DEFAULT:
        return f"(see `{field.owner.__module__}.{field.owner.__name__}`)"
    return f"`{text}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _rows(fields: list[SettingsField]) -> list[str]:
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for f in fields:
        rows.append(
            f"| `{f.key}` | {_cell(type_name(f.annotation))} | {_cell(default_text(f))} | {_cell(f.description or '')} |"
        )
    return rows


def _stage_defaults() -> list[str]:
    from curation.stages import stage_classes

    stages = [s for s in stage_classes().values() if not s.internal]
    stages.sort(key=lambda s: (s.default_order is None, s.default_order or 0, s.name))
    keys = list(type(stages[0].default_settings).model_fields)
    rows = [
        "| stage | " + " | ".join(f"`{k}`" for k in keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for s in stages:
        values = s.default_settings.model_dump(mode="json")
        rows.append(f"| `{s.name}` | " + " | ".join(f"`{json.dumps(values[k])}`" for k in keys) + " |")
    return rows


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "Every key of every job's config, generated from the settings classes by `tools/config_reference.py` (a test",
        "fails when this page is out of date). A YAML config sets any of them, and so does an override on the command",
        "line: `filters.min_short_side=512`, `stages.person.actors=[2,8]`. `<name>` stands for a key of a mapping,",
        "`[]` for an item of a list. A misspelt key or a bad value stops the job before it starts, naming the key.",
    ]
    for title, where, model in _configs():
        fields = list(settings_fields(model))
        out += ["", f"## {title}", "", f"{where}.", ""]
        top = [f for f in fields if "." not in f.key.replace("[]", "")]
        plain = [f for f in top if type_name(f.annotation) != "section"]
        if plain:
            out += _rows(plain)
        for section in (f for f in top if type_name(f.annotation) == "section"):
            inner = [f for f in fields if f.key.startswith(section.key + ".")]
            out += ["", f"### `{section.key}`", ""]
            if section.description:
                out += [section.description, ""]
            out += _rows(inner)
        if title == "Curation":
            out += ["", "### The stages' own defaults", ""]
            out += ["What each stage's class declares for `stages.<name>` where a config states no value:", ""]
            out += _stage_defaults()
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if the page is out of date, writing nothing")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(REPO)} is out of date: run python tools/config_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
