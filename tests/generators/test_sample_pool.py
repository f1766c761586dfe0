"""The sample pool: structure, byte-identical regeneration, the properties each bad input claims, and agreement of
the manifest with what the pool reader and the decode stage actually do, in all three formats."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import struct
import sys
import tarfile
from pathlib import Path

import imagehash
import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageOps, UnidentifiedImageError

from common.imageio import _to_mode, open_image
from curation.config import CurateConfig
from curation.score.pool import Pool, list_shards
from curation.score.reader import ShardReader
from curation.score.stage import REJECT
from curation.settings import InputSettings
from curation.stages.decode import DecodeStage
from generators import sample_pool as sp
from jobs import make_sample_pool as cli
from tests.stage_calls import decided

DECODE_REASONS = {
    "unreadable",
    "empty_file",
    "file_too_large",
    "not_an_image",
    "corrupt",
    "decompression_bomb",
    "animated",
    "too_small",
    "extreme_aspect",
}
LATER_REASONS = {
    "person": {"no_person", "no_prominent_person"},
    "quality": {"low_quality"},
    "text_overlay": {"text_overlay"},
}


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    """The default pool in all three formats: folder through the CLI, the others through the library."""
    base = tmp_path_factory.mktemp("pools")
    assert cli.main(["--out", str(base / "folder")]) == 0
    out = {"folder": base / "folder"}
    items = sp.build_pool()
    for fmt in ("parquet", "webdataset"):
        sp.write_pool(items, base / fmt, fmt)
        out[fmt] = base / fmt
    return out


@pytest.fixture(scope="module")
def rows(pools):
    return {r["name"]: r for r in sp.read_manifest(pools["folder"])}


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every file under ``root`` by relative path: bytes, or the target of a symlink."""
    out: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = path.read_bytes()
    return out


def _shown(path: Path) -> Image.Image:
    """What a viewer shows: EXIF orientation applied, any mode normalised to RGB as decode does."""
    return _to_mode(ImageOps.exif_transpose(open_image(path.read_bytes())), "RGB")


# --- structure ---------------------------------------------------------------------------------------------------


def _check_structure(by_name: dict[str, dict], n: int, with_symlink: bool) -> None:
    assert len(by_name) == n - (0 if with_symlink else 1)
    cats = {c: [r for r in by_name.values() if r["category"] == c] for c in sp.CATEGORIES}
    assert all(cats.values()), {c: len(v) for c, v in cats.items()}
    people = {(r["origin"], r["variant"]) for r in cats["people"]}
    assert {(p, "original") for p in sp.PERSON_PHOTOS} <= people
    assert {v for _, v in people} >= set(sp.VARIANT_KINDS) | {"exact_copy"}
    assert {r["origin"] for r in cats["no_person"] if r["variant"] == "original"} == set(sp.NO_PERSON_PHOTOS)
    assert {r["variant"] for r in cats["low_quality"]} == {"blur", "dark", "blown", "noise"}
    assert {r["variant"] for r in cats["text"]} == {"caption", "upscaled"}
    assert {r["origin"] for r in cats["text"] if r["variant"] == "upscaled"} == {"text", "page"}
    bad = {"empty", "truncated", "text_file", "random_bytes", "html_page", "huge_header", "animated"}
    assert {r["variant"] for r in cats["bad"]} == bad | ({"broken_symlink"} if with_symlink else set())
    odd = {"jpeg_named_png", "cmyk", "gray16", "palette_transparency", "exif_orientation_6"}
    assert {r["variant"] for r in cats["odd"]} == odd
    assert {r["reason"] for r in cats["tiny"]} == {"too_small", "extreme_aspect"}


def test_default_pool_holds_every_category_and_a_well_formed_manifest(rows, pools):
    _check_structure(rows, sp.DEFAULT_N, with_symlink=True)
    for name, r in rows.items():
        assert r["path"] == name and not any(part.startswith(("_", ".")) for part in name.split("/"))
        assert name.split("/")[0] == r["category"]
        if r["expect"] == "kept":
            assert "stage" not in r and "stage_any" not in r
        elif r["expect"] == "rejected":
            stages = r.get("stage_any") or [r["stage"]]
            reasons = r.get("reason_any") or [r["reason"]]
            allowed = DECODE_REASONS if stages == ["decode"] else set().union(*(LATER_REASONS[s] for s in stages))
            assert set(reasons) <= allowed, name
        else:
            assert r["expect"] == "any" and r["stage_any"] and r["why"] and "decode" not in r["stage_any"], name
    outcomes = {r["expect"] for r in rows.values()}
    assert outcomes == {"kept", "rejected", "any"}
    # Every later stage has something the manifest says it must reject or may reject.
    named = {s for r in rows.values() for s in (r.get("stage_any") or [r.get("stage")])}
    assert {"decode", "person", "quality", "text_overlay"} <= named
    # Generated photos clear decode's size gate; the tiny ones do not (or fail the aspect ratio).
    for r in rows.values():
        if r["width"] is None:
            continue
        short, ratio = min(r["width"], r["height"]), max(r["width"], r["height"]) / min(r["width"], r["height"])
        if r["category"] in ("people", "no_person", "text", "low_quality", "odd"):
            assert short >= sp.MIN_SIDE and ratio <= 3, r["name"]
        if r["category"] == "tiny":
            assert short < 384 or ratio > 3, r["name"]
    assert all(rows[f"people/{p}.jpg"]["has_person"] is True for p in sp.PERSON_PHOTOS)
    assert all(rows[f"no_person/{p}.jpg"]["has_person"] is False for p in sp.NO_PERSON_PHOTOS)
    assert rows["text/page.jpg"]["has_person"] is False and rows["bad/notes.jpg"]["has_person"] is None
    copy = rows["people/zidane_copy.jpg"]
    assert (pools["folder"] / copy["name"]).read_bytes() == (pools["folder"] / copy["exact_copy_of"]).read_bytes()


def test_minimum_pool_through_the_cli_keeps_the_structure(tmp_path, capsys):
    out = tmp_path / "min"
    assert cli.main(["--out", str(out), "--n", str(sp.MIN_N), "--format", "webdataset", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert all(any(line.startswith(c) for line in printed.splitlines()) for c in sp.CATEGORIES)
    by_name = {r["name"]: r for r in sp.read_manifest(out)}
    _check_structure(by_name, sp.MIN_N, with_symlink=False)
    # Rerunning replaces our own pool, but a folder without our manifest is never cleared.
    assert cli.main(["--out", str(out), "--n", str(sp.MIN_N), "--format", "webdataset", "--seed", "3"]) == 0
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "keep.txt").write_text("x")
    assert cli.main(["--out", str(tmp_path / "theirs")]) == 2
    assert (tmp_path / "theirs" / "keep.txt").exists()
    with pytest.raises(SystemExit):
        cli.parse_args(["--out", str(tmp_path / "x"), "--n", str(sp.MIN_N - 1)])
    assert f"minimum {sp.MIN_N}" in cli.build_parser().format_help()


# --- determinism -------------------------------------------------------------------------------------------------


def test_same_seed_gives_identical_bytes_in_every_format(pools, tmp_path):
    items = sp.build_pool()
    for fmt in sp.FORMATS:
        sp.write_pool(items, tmp_path / fmt, fmt)
        again, first = _tree(tmp_path / fmt), _tree(pools[fmt])
        assert again.keys() == first.keys() and len(again) >= 3
        assert [k for k in again if again[k] != first[k]] == []


def test_another_seed_changes_the_seeded_content_only(pools):
    a = {name: data for name, data in _tree(pools["folder"]).items() if not name.startswith("_")}
    b = {it.name: it.data if it.link_target is None else "-> " + it.link_target for it in sp.build_pool(seed=1)}
    assert a.keys() == b.keys()
    changed = {k for k in a if a[k] != b[k]}
    assert {"bad/random.png", "low_quality/astronaut_noise.jpg", "tiny/bus_crop200x150.jpg"} <= changed
    assert "people/bus.jpg" not in changed and "bad/huge_header.png" not in changed


# --- each input has the property it claims -----------------------------------------------------------------------


def test_bad_and_odd_inputs_have_the_properties_they_claim(pools):
    root = pools["folder"]
    read = lambda name: (root / name).read_bytes()  # noqa: E731

    assert read("bad/empty.jpg") == b""
    truncated, whole = read("bad/truncated.jpg"), read("people/zidane.jpg")
    assert whole.startswith(truncated) and len(truncated) == len(whole) // 2
    img = Image.open(io.BytesIO(truncated))
    assert img.format == "JPEG"  # the header is intact ...
    with pytest.raises(OSError, match="truncated"):
        img.load()  # ... the pixels are not
    for name in ("bad/notes.jpg", "bad/random.png", "bad/error_page.jpg"):
        with pytest.raises(UnidentifiedImageError):
            Image.open(io.BytesIO(read(name)))
    assert read("bad/error_page.jpg").lstrip().lower().startswith(b"<!doctype html")
    huge = read("bad/huge_header.png")
    width, height = struct.unpack(">II", huge[16:24])
    assert huge[12:16] == b"IHDR" and width * height >= 1e10 and len(huge) < 10_000
    assert open_image(huge).size == (width, height)
    gif = Image.open(io.BytesIO(read("bad/animated.gif")))
    assert gif.format == "GIF" and gif.n_frames > 1 and gif.is_animated
    link = root / "bad/broken_link.jpg"
    assert link.is_symlink() and not link.exists()

    assert Image.open(io.BytesIO(read("odd/zidane_cmyk.jpg"))).mode == "CMYK"
    gray16 = read("odd/camera_gray16.png")
    assert gray16[24:26] == b"\x10\x00"  # IHDR: bit depth 16, colour type 0 (grey)
    assert Image.open(io.BytesIO(gray16)).mode.startswith("I")
    palette = Image.open(io.BytesIO(read("odd/astronaut_palette.png")))
    assert palette.mode == "P" and "transparency" in palette.info
    alpha = np.asarray(palette.convert("RGBA"))[..., 3]
    assert alpha.min() == 0 and alpha.max() == 255
    assert Image.open(io.BytesIO(read("odd/grace_hopper_jpeg.png"))).format == "JPEG"
    exif6 = Image.open(root / "odd/bus_exif6.jpg")
    assert exif6.getexif()[0x0112] == 6 and exif6.width > exif6.height  # stored landscape ...
    shown = np.asarray(ImageOps.exif_transpose(exif6), dtype=np.float32)
    bus = np.asarray(Image.open(root / "people/bus.jpg"), dtype=np.float32)
    assert shown.shape == bus.shape and np.abs(shown - bus).mean() < 4  # ... displayed as the portrait photo


def test_low_quality_and_caption_variants_are_what_they_say(pools):
    root = pools["folder"]

    def grey(name: str) -> np.ndarray:
        return np.asarray(_shown(root / name).convert("L"), dtype=np.float32)

    def sharpness(a: np.ndarray) -> float:
        return float(np.var(np.diff(a, axis=0)) + np.var(np.diff(a, axis=1)))

    zidane, astronaut = grey("people/zidane.jpg"), grey("people/astronaut.jpg")
    assert sharpness(grey("low_quality/zidane_blur.jpg")) < 0.1 * sharpness(zidane)
    assert grey("low_quality/astronaut_dark.jpg").mean() < 0.15 * astronaut.mean()
    assert (grey("low_quality/zidane_blown.jpg") >= 250).mean() > 0.4 > (zidane >= 250).mean()
    assert sharpness(grey("low_quality/astronaut_noise.jpg")) > 3 * sharpness(astronaut)
    # A caption is drawn over the lower part; the faces above it are untouched.
    caption = grey("text/zidane_caption.jpg")
    changed = np.abs(caption - zidane) > 60
    h = changed.shape[0]
    assert changed[h // 2 :].mean() > 0.05 and changed[: h // 3].mean() < 0.005


def test_near_duplicates_are_near_and_different_photos_are_not(pools, rows):
    """pHash distances (bits) between each near-duplicate and its original, undoing the mirror of flips."""
    root = pools["folder"]
    originals = {
        r["origin"]: imagehash.phash(_shown(root / r["name"])) for r in rows.values() if r["variant"] == "original"
    }
    apart = min(originals[a] - originals[b] for a in originals for b in originals if a < b)
    for r in rows.values():
        if not r["dup_group"] or r["variant"] == "original":
            continue
        img = _shown(root / r["name"])
        if r["params"].get("mirror"):
            img = ImageOps.mirror(img)
        distance = originals[r["dup_group"]] - imagehash.phash(img)
        # Crops and the framed palette copy move more bits than a re-encode, yet stay closer than any two photos.
        limit = apart - 2 if r["variant"] in ("crop", "palette_transparency") else 4
        assert distance <= limit, (r["name"], distance, apart)
    assert apart >= 20


def test_the_summary_says_what_the_lite_curation_keeps_and_which_stage_drops_the_rest(rows, repo_root):
    import yaml

    lite = yaml.safe_load((repo_root / "configs/curate/lite.yaml").read_text())
    assert sp.LITE_TARGET_FRACTION == lite["sample"]["target_fraction"]
    e = sp.expected_curation(list(rows.values()))
    # 29 rejected in phase 1; 31 reach dedup: 5 photos' linked copies (26) collapse to one each, 5 are not linked
    assert (sum(e.rejected.values()), e.duplicates, e.after_dedup, e.kept) == (29, 21, 10, 8)
    assert e.kept_copy == {  # the most pixels, then the best encoding: full-size re-saves at a higher quality win
        "astronaut": ("odd/astronaut_palette.png",),  # its white frame adds pixels
        "bus": ("odd/bus_exif6.jpg",),
        "camera": ("odd/camera_gray16.png",),
        "grace_hopper": ("odd/grace_hopper_jpeg.png",),
        "zidane": ("odd/zidane_cmyk.jpg",),
    }
    lines = sp.summary_lines(list(rows.values()))
    assert lines[0].startswith("people") and "phase 1 must keep 11 and may keep or reject 15 (borderline" in lines[0]
    assert any(line.startswith("no_person") and "phase 1 must reject all 9" in line for line in lines)
    assert any(line.startswith("odd") and "phase 1 may keep or reject all 5 (borderline" in line for line in lines)
    assert any(
        line.startswith("configs/curate/lite.yaml end to end: 8 of the 60 inputs should end up kept") for line in lines
    )
    assert any("sample selects 8 of the 10 left" in line for line in lines)


# --- the manifest agrees with the pool reader and the decode stage ------------------------------------------------


@pytest.fixture(scope="module")
def decode_stage():
    stage = DecodeStage(CurateConfig())
    stage.setup()
    return stage


@pytest.mark.parametrize("fmt", sp.FORMATS)
def test_reader_and_decode_stage_agree_with_the_manifest(pools, rows, decode_stage, fmt):
    root = pools[fmt]
    manifest = {r["path"]: r for r in sp.read_manifest(root)}
    shards = list_shards(Pool.at(str(root)), InputSettings())
    assert {s.kind for s in shards} == {"files" if fmt == "folder" else fmt}
    reader = ShardReader(str(root), InputSettings(), 8, max_file_bytes=64 * 2**20)
    read = [row for s in shards for row in reader.read_table(s).to_pylist()]
    # The reader names an input <pool root>/<manifest path>.
    assert all(row["source"].startswith(f"{root}/") for row in read)
    by_path = {row["source"][len(str(root)) + 1 :]: row for row in read}
    assert by_path.keys() == manifest.keys()
    updates = decided(decode_stage, [{"image": r["image"], "reason": r["reason"]} for r in by_path.values()])
    for (path, row), update in zip(by_path.items(), updates):
        m = manifest[path]
        assert rows[m["name"]]["sha256"] == m["sha256"]
        if row["image"] is not None:
            assert hashlib.sha256(row["image"]["bytes"]).hexdigest() == m["sha256"] == update["key"]
        if m.get("stage") == "decode":
            assert update.get(REJECT, "").split(":")[0] == m["reason"], (path, update.get(REJECT))
        else:
            assert REJECT not in update, (path, update[REJECT])
            assert (update["width"], update["height"], update["mode"], update["format"]) == (
                m["width"],
                m["height"],
                m["mode"],
                m["format"],
            ), path
            assert update["encoding_quality"] == m["encoding_quality"], path


def test_all_formats_hold_the_same_inputs(pools, rows):
    expected = {(r["name"], r["sha256"]) for r in rows.values() if r["variant"] != "broken_symlink"}
    tables = [pq.read_table(p) for p in sorted(pools["parquet"].glob("*.parquet"))]
    assert all(1 <= t.num_rows <= sp.SHARD_ROWS for t in tables) and len(tables) > 1
    found = set()
    for t in tables:
        for image, source in zip(t.column("image").to_pylist(), t.column("source").to_pylist()):
            assert image["path"] == source
            found.add((source, hashlib.sha256(image["bytes"]).hexdigest()))
    assert found == expected

    members = {}
    for shard in sorted(pools["webdataset"].glob("*.tar")):
        with tarfile.open(shard) as tar:
            names = [n for n in tar.getnames() if not n.endswith((".json", ".txt"))]  # img2dataset's sidecars
            assert 1 <= len(names) <= sp.SHARD_ROWS
            for name in names:
                members[name] = hashlib.sha256(tar.extractfile(name).read()).hexdigest()
                stem = name.split(".", 1)[0]
                sidecar = json.load(tar.extractfile(f"{stem}.json"))
                assert sidecar["url"].endswith(".".join(name.split(".")[1:]))
                assert tar.extractfile(f"{stem}.txt").read().decode() == sidecar["caption"]
    keys = [m.split(".", 1)[0] for m in members]
    assert len(set(keys)) == len(keys)  # one sample per key, and the key is everything before the first dot
    assert set(members.items()) == {(sp.wds_member(name), sha) for name, sha in expected}


# --- missing fixtures ----------------------------------------------------------------------------------------------


def test_a_missing_package_is_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ultralytics" else real(name, *a))
    with pytest.raises(sp.FixtureMissing, match="ultralytics"):
        sp.load_photos()
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "skimage", None)
    monkeypatch.setitem(sys.modules, "skimage.data", None)
    with pytest.raises(sp.FixtureMissing, match="scikit-image"):
        sp.load_photos()
    with pytest.raises(ValueError, match=f"at least {sp.MIN_N}"):
        sp.build_pool(sp.MIN_N - 1)


def test_an_interrupted_sample_pool_leaves_nothing_and_the_same_command_then_succeeds(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the pool is written: exit code 130, one line, no half pool (a folder without the manifest would
    refuse the rerun); the same command then writes the whole pool."""
    from jobs import make_sample_pool as job

    out = tmp_path / "pool"
    real = job.make_sample_pool

    def interrupted(folder, *args):
        (Path(folder) / "people").mkdir(parents=True)
        (Path(folder) / "people" / "half.jpg").write_bytes(b"\xff\xd8")
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "make_sample_pool", interrupted)
    assert job.main(["--out", str(out), "--n", "40"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[make_sample_pool] interrupted:") and "removed" in err[0], err
    assert not out.exists()
    monkeypatch.setattr(job, "make_sample_pool", real)
    assert job.main(["--out", str(out), "--n", "40"]) == 0
    assert len((out / "_manifest.jsonl").read_text().splitlines()) == 40
