"""The dataset card's counts read as words: singular for one, plural otherwise, and a sentence where a list is empty."""

from curation.phases.write.card import card_text, dedup_markdown, metadata_markdown


def _manifest(rows: int, shards: int, fields: dict[str, str] | None = None) -> dict:
    return {
        "totals": {"rows": rows, "shards": shards, "bytes": 1000},
        "curation": {"min_short_side": 384, "profile": "lite", "stages": ["decode"], "safety": []},
        "config_hash": "abc",
        "embedding_model": "m",
        "embedding_dim": None,
        "metadata_fields": fields or {},
        "funnel": {"score/decode/rejected/corrupt": 1, "write/write/kept/kept": rows},
    }


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_one_image_in_one_shard_is_singular():
    text = _flat(card_text(_manifest(1, 1)))
    assert "1 human-centric image (at least one prominent person" in text
    assert "in 1 Parquet shard, curated by Humans-1B" in text
    assert "shards," not in text.split("curated by")[0]


def test_several_images_and_shards_are_plural():
    text = _flat(card_text(_manifest(5, 2)))
    assert "5 human-centric images (at least" in text and "in 2 Parquet shards, curated" in text


def test_no_typed_metadata_field_is_a_sentence():
    text = metadata_markdown(_manifest(1, 1))
    assert text.startswith(
        "The `metadata` struct has no typed columns: no field of the pool's metadata has the same type in every "
        "input of the run (or the pool has no metadata). "
    )
    assert "Typed column of the `metadata` struct: `camera` (string)." in metadata_markdown(
        _manifest(1, 1, {"camera": "string"})
    )
    two = metadata_markdown(_manifest(1, 1, {"camera": "string", "year": "int64"}))
    assert "Typed columns of the `metadata` struct: `camera` (string), `year` (int64)." in two


def test_the_dedup_section_counts_one_survivor_and_one_link():
    chance = {
        "survivors": 1,
        "expected_chance_links": 1.0,
        "per_survivor": 1.0,
        "bound": 2.0,
        "allowed_over_bound": False,
        "regions": [],
    }
    text = _flat(dedup_markdown({"dedup": {"chance": chance, "components": {"dropped": 0}}}))
    assert "At N = 1 survivor: 1 chance link expected in all" in text
    many = _flat(dedup_markdown({"dedup": {"chance": {**chance, "survivors": 31, "expected_chance_links": 0.498}}}))
    assert "At N = 31 survivors: 0.498 chance links expected in all" in many
