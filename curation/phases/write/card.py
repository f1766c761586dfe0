"""The dataset card: ``<out>/README.md``, what the Hugging Face Hub shows and ``datasets.load_dataset("<out>")`` reads.

Its YAML header points ``datasets`` at the final shards only (the output also holds the ledger, the phase files and
``_state``, which are not the dataset), lists the features the shards carry and the split's size; the body gives
the run's funnel from the manifest. The write phase writes it atomically after switching the manifest, so a rerun
that rewrites the shards rewrites the card.
"""

from __future__ import annotations

import pyarrow as pa
import yaml

from common import schema
from common.console import plural
from common.layout import LAYOUT
from common.storage import join, resolve, write_bytes_atomic
from curation.score.ledger import download_note, funnel_steps, stopped_in_funnel

# The Hub's size categories: (upper bound, label), the first bound above the row count wins.
_SIZE_CATEGORIES = [
    (10**3, "n<1K"),
    (10**4, "1K<n<10K"),
    (10**5, "10K<n<100K"),
    (10**6, "100K<n<1M"),
    (10**7, "1M<n<10M"),
    (10**8, "10M<n<100M"),
    (10**9, "100M<n<1B"),
    (10**10, "1B<n<10B"),
    (10**11, "10B<n<100B"),
    (10**12, "100B<n<1T"),
]


def size_category(rows: int) -> str:
    return next((label for bound, label in _SIZE_CATEGORIES if rows < bound), "n>1T")


def card_header(manifest: dict) -> dict:
    rows = manifest["totals"]["rows"]
    return {
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": LAYOUT.shard_glob}]}],
        "dataset_info": {
            "features": schema.hf_card_features(card_schema(manifest)),
            "splits": [{"name": "train", "num_bytes": manifest["totals"]["bytes"], "num_examples": rows}],
            "download_size": manifest["totals"]["bytes"],
        },
        "license": "other",  # a placeholder: the images keep their sources' terms (see the card's Licence section)
        "size_categories": [size_category(rows)],
        "task_categories": ["image-feature-extraction"],
        "tags": ["humans", "people", "human-centric", "pretraining", "curated"],
        "pretty_name": "Humans-1B curated images",
    }


def _pct(n: int, total: int) -> str:
    return f"{100.0 * n / total:.1f}%" if total else "-"


def funnel_markdown(stages: list[str], funnel: dict[str, int]) -> str:
    """The manifest's funnel as a table: images reaching each stage, what stopped there, what was kept."""
    total = sum(funnel.values())
    kept = sum(n for name, n in funnel.items() if name.split("/")[2] == schema.KEPT)
    lines = [
        "| phase | stage | outcome | images | % of inputs |",
        "|---|---|---|---:|---:|",
        f"| | inputs | | {total} | {_pct(total, total)} |",
    ]
    steps = funnel_steps(stopped_in_funnel(funnel), total, stages)
    for step in steps:
        lines.append(f"| {step.phase} | {step.stage} | reached | {step.reached} | {_pct(step.reached, total)} |")
        for status, code, n in step.outcomes:
            outcome = status + (f": {code}" if code and code != status else "")
            lines.append(f"| | | {outcome} | {n} | {_pct(n, total)} |")
    lines.append(f"| write | final shards | kept | {kept} | {_pct(kept, total)} |")
    note = download_note(steps)
    return "\n".join(lines) + (f"\n\n{note}" if note else "")


def metadata_markdown(manifest: dict) -> str:
    """Which of the pool's metadata fields (sidecars, extra Parquet columns) the shards carry, and where."""
    fields = manifest.get("metadata_fields") or {}
    typed = ", ".join(f"`{name}` ({kind})" for name, kind in sorted(fields.items()))
    return (
        (
            f"Typed {'column' if len(fields) == 1 else 'columns'} of the `metadata` struct: {typed}. "
            if typed
            else "The `metadata` struct has no typed columns: no field of the pool's metadata has the same type in "
            "every input of the run (or the pool has no metadata). "
        )
        + "Fields of other or mixed types (lists, objects) are in `metadata_json`, one JSON object per row; "
        "`metadata_note` says where an input's metadata was dropped or altered (not JSON, not UTF-8, too large)."
    )


def card_schema(manifest: dict) -> pa.Schema:
    """The final shards' columns, as the manifest's first shard has them (the features a card lists)."""
    dim = manifest.get("embedding_dim")
    return schema.curated_schema(dim, manifest.get("metadata_fields"))


def dedup_markdown(manifest: dict) -> str:
    """How dedup decided: the link rule at this pool's N, and the chance links it was expected to make."""
    dedup = manifest.get("dedup") or {}
    chance, components = dedup.get("chance"), dedup.get("components") or {}
    if not chance:
        return "No near-duplicate search ran in this curation."
    rows = "\n".join(
        f"| {r['region']} | {r['configured_radius']} | {r['radius'] if r['radius'] >= 0 else 'off'} | "
        f"{r['expected_chance_links']:.3g} |"
        for r in chance["regions"]
    )
    over = " The bound was exceeded and allowed by `dedup.allow_chance`." if chance["allowed_over_bound"] else ""
    by_signal = ", ".join(f"{n} by {s}" for s, n in (components.get("by_signal") or {}).items())
    return f"""Two images are linked as copies of one picture when their pHash distance (of 64 bits) and the cosine of
their embeddings fall in one of the regions below; of each group of linked images one is kept. A region on the crop
distance measures, instead of the pHash distance, the least distance between either image's PDQ (256 bits) and the
other's PDQ or the PDQs of its sub-crops, so that a lightly cropped copy is found. Each region's
radius is lowered from the configured one to what this pool's size allows, so that the links expected between
unrelated images by chance, estimated from a sample of this run's own pairs, stay within the bound.

| region | configured radius | radius used | expected chance links |
|---|---|---|---|
{rows}

At N = {plural(chance["survivors"], "survivor")}: {_links(chance["expected_chance_links"])} expected in all
({chance["per_survivor"]:.2g} per survivor; bound {chance["bound"]:.3g}).{over} Dropped as copies:
{components.get("dropped", 0)}{f" ({by_signal})" if by_signal else ""}."""


def _links(expected: float) -> str:
    """An expected number of chance links, to three digits: "1 chance link", "0.498 chance links"."""
    shown = f"{expected:.3g}"
    return f"{shown} chance {'link' if shown == '1' else 'links'}"


def safety_markdown(manifest: dict) -> str:
    """Each safety filter that ran: its model, licence and threshold, and how many inputs it rejected."""
    safety = manifest["curation"].get("safety") or []
    entries = [safety] if isinstance(safety, dict) else safety  # manifests before the CLIP head held one filter
    total = sum(manifest["funnel"].values())
    paragraphs = [_safety_entry(e, manifest["funnel"], total) for e in entries]
    paragraphs.append(_SAFETY_CAVEAT if entries else "No safety (NSFW) filter ran in this curation.")
    if blocklists := manifest["curation"].get("blocklists"):
        blocked = sum(
            n for name, n in manifest["funnel"].items() if name.split("/")[2:4] == [schema.REJECTED, "blocklisted"]
        )
        named = ", ".join(f"`{b}`" for b in blocklists)
        paragraphs.append(
            f"Blocklists (`filters.blocklists`: {named}; keys, sources, URLs and PDQ hashes) kept {blocked} of "
            f"{plural(total, 'input')} out ({_pct(blocked, total)})."
        )
    return "\n\n".join(paragraphs)


_SAFETY_CAVEAT = (
    "A classifier misses some images and flags others: the filter lowers the chance of explicit content, "
    "it does not rule it out."
)


def _safety_entry(entry: dict, funnel: dict[str, int], total: int) -> str:
    stage, reason = entry["stage"], entry.get("reason")  # no reason: every rejection of its stage (open_nsfw's own)
    rejected = sum(
        n
        for name, n in funnel.items()
        if name.split("/")[1:3] == [stage, schema.REJECTED] and reason in (None, name.split("/")[3])
    )
    pinned = ", pinned by sha256" if entry.get("pinned", True) else ""
    setting = entry.get("setting", "filters.nsfw_max_score")
    scored = f"Stage `{stage}` scored each input that reached it with {entry['model']} (licence {entry['licence']}; "
    scored += f"weights `{entry['weights']}`{pinned})"
    if entry["max_score"] is None:
        return f"{scored}, kept as a score without a threshold (`{setting}` unset): it rejected none."
    return (
        f"{scored} and rejected those whose NSFW probability is above {entry['max_score']:g} (`{setting}`, on this "
        f"model's scale): {rejected} of {plural(total, 'input')} ({_pct(rejected, total)})."
    )


def card_text(manifest: dict) -> str:
    header = yaml.safe_dump(card_header(manifest), sort_keys=False, allow_unicode=True)
    totals, cfg = manifest["totals"], manifest["curation"]
    return f"""---
{header}---

# Humans-1B curated images

{plural(totals["rows"], "human-centric image")} (at least one prominent person, short side >= {cfg["min_short_side"]} px)
in {plural(totals["shards"], "Parquet shard")}, curated by Humans-1B with the `{cfg["profile"]}` profile (config hash
`{manifest["config_hash"]}`, embedding model `{manifest["embedding_model"]}`).

```python
from datasets import load_dataset

ds = load_dataset("<this folder or repository>", split="train")
ds[0]["image"]  # a PIL image, decoded from the original bytes
```

Each row holds the **original encoded bytes** of one image (`image`, never re-encoded; `key` is their sha256),
where it came from (`source`), what decode learned (`format`, `width`, `height`, ...) and every score of the
curation: person boxes and head pose, technical quality, text coverage, pHash, balanced-sampling cluster ids.
`shards/manifest.json` lists the shards with their sha256; `final_ledger/` records the fate of every input.

## The pool's metadata

{metadata_markdown(manifest)}

## Licence

`license: other` is a placeholder. The images keep the licences and terms of their sources (the `source` column
names each one); set the licence that applies before publishing.

## Safety

{safety_markdown(manifest)}

## Deduplication

{dedup_markdown(manifest)}

## Funnel

Each input stops at the first stage that rejects it; the counts are the run's final ledger.

{funnel_markdown(cfg["stages"], manifest["funnel"])}
"""


def write_card(out_uri: str, manifest: dict) -> str:
    """Write ``<out>/README.md`` for the manifest just committed; returns its path."""
    fs, root = resolve(out_uri)
    path = join(root, LAYOUT.card)
    write_bytes_atomic(fs, path, card_text(manifest).encode())
    return path
