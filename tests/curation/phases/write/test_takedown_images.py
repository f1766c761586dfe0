"""Takedowns by what a picture looks like: ``pdq:`` lines made from a report's pictures name its copies (re-encoded,
resized, cropped, watermarked) and no unrelated real photo; a takedown with ``--images`` removes them from an output,
and the list it saves keeps them out of a new curation as a blocklist."""

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageDraw, ImageFont

from common import schema
from common import takedown_lists as td
from common.pdq import pdq_of
from curation.audit.verify import audit
from curation.score.ledger import read_ledger
from generators.sample_pool import _font_path
from jobs import takedown as job
from tests.package_photos import package_photo_files


def copies(data: bytes) -> dict[str, bytes]:
    """The copies a reported picture is found again as: re-encoded at quality 40, resized to half, cropped 5% (2.5%
    off each side), with a semi-transparent corner watermark."""
    with Image.open(io.BytesIO(data)) as im:
        rgb = im.convert("RGB")
    w, h = rgb.size
    dx, dy = round(0.025 * w), round(0.025 * h)
    layer = Image.new("RGBA", rgb.size, (0, 0, 0, 0))
    font = ImageFont.truetype(str(_font_path()), max(10, h // 20))
    draw = ImageDraw.Draw(layer)
    box = draw.textbbox((0, 0), "(c) photographer.example", font=font)
    at = (w - (box[2] - box[0]) - 8, h - (box[3] - box[1]) - 8)
    draw.text(at, "(c) photographer.example", font=font, fill=(255, 255, 255, 128), stroke_width=2,
              stroke_fill=(0, 0, 0, 64))  # fmt: skip
    marked = Image.alpha_composite(rgb.convert("RGBA"), layer).convert("RGB")
    variants = {
        "q40": rgb,
        "half": rgb.resize((w // 2, h // 2), Image.Resampling.LANCZOS),
        "crop5": rgb.crop((dx, dy, w - dx, h - dy)),
        "watermark": marked,
    }
    out = {}
    for name, image in variants.items():
        buf = io.BytesIO()
        image.save(buf, "JPEG", quality=40 if name == "q40" else 90)
        out[name] = buf.getvalue()
    return out


def test_a_reported_photos_copies_match_and_no_unrelated_real_photo_does(tmp_path):
    photos = package_photo_files()
    unrelated_hits = []
    for name, data in photos.items():
        (tmp_path / f"{name}.jpg").write_bytes(data)
        lst = td.make_list("report", td.picture_lines([str(tmp_path / f"{name}.jpg")]))
        assert f"pdq:{pdq_of(data)[0].hex()}" in lst.entries  # the picture's own hash, then its windows'
        listing = lst.listing
        table = pa.table(
            {
                "source": [f"{n}/{kind}" for n in photos for kind in ("original", *copies(photos[n]))],
                "pdq": pa.array(
                    [pdq_of(d)[0] for n in photos for d in (photos[n], *copies(photos[n]).values())], pa.binary(32)
                ),
            }
        )
        named = dict(zip(table.column("source").to_pylist(), listing.named_by(table), strict=True))
        mine = {s: e for s, e in named.items() if s.startswith(f"{name}/")}
        assert all(e is not None for e in mine.values()), (name, mine)  # every copy of the reported photo
        unrelated_hits += [s for s, e in named.items() if e is not None and not s.startswith(f"{name}/")]
    assert not unrelated_hits  # no copy of another real photo


def test_pdq_lines_are_checked_and_the_distance_is_part_of_a_lists_identity():
    line = "pdq:" + "ab" * 32
    assert td.make_list("l", [line], 31).id != td.make_list("l", [line], 20).id
    assert td.make_list("l", ["somekey"], 31).id == td.make_list("l", ["somekey"], 20).id  # no hashes: as before
    assert td.make_list("l", [line.upper().replace("PDQ:", "pdq:")]).entries == (line,)
    with pytest.raises(td.TakedownError, match="line 2 is not pdq:<64 hex digits>"):
        td.make_list("l", ["# a comment", "pdq:abc"])


def test_a_flat_picture_is_refused_for_a_pdq_line(tmp_path):
    flat = tmp_path / "flat.png"
    Image.fromarray(np.full((400, 400, 3), 128, np.uint8)).save(flat)
    with pytest.raises(td.TakedownError, match=r"PDQ quality \d+ < 50 .* list it by key or URL instead"):
        td.picture_lines([str(flat)])
    (tmp_path / "notes.txt").write_text("not a picture")
    with pytest.raises(td.TakedownError, match=r"notes\.txt: not a picture that decodes"):
        td.picture_lines([str(tmp_path / "notes.txt")])


@pytest.mark.slow  # a takedown on the session's curated output, and a curation (score phase, cheap stages) after it
def test_an_images_takedown_removes_a_kept_image_and_its_list_keeps_it_out_of_a_new_curation(
    out, wds_curated_run, tmp_path, capsys, manifest_of, ledger_of, repo_root
):
    from jobs import curate

    first = manifest_of(out)["shards"][0]["file"]
    row = pq.read_table(out / "shards" / first, columns=["source", "image", "pdq"]).slice(0, 1).to_pylist()[0]
    assert row["pdq"] == pdq_of(row["image"]["bytes"])[0]  # stored at scoring time, as a report is hashed
    report = tmp_path / "report"
    report.mkdir()
    (report / "reported.jpg").write_bytes(copies(row["image"]["bytes"])["q40"])  # the report came with a copy
    saved = tmp_path / "blocklist.txt"
    before = manifest_of(out)["totals"]["rows"]
    argv = ["--output", str(out), "--images", str(report), "--save-list", str(saved), "--grace-minutes", "0"]
    assert job.main(argv) == 0
    printed = capsys.readouterr().out
    assert f"written to {saved}" in printed and "pdq: lines from the pictures of" in printed
    (record,) = td.takedown_records(*td.resolve(str(out)))
    assert record["distance"] == td.PDQ_DISTANCE and row["source"] in {r["source"] for r in record["removed"]}
    # every image removed is within the distance of a listed hash; the rest of the output is not
    assert manifest_of(out)["totals"]["rows"] == before - len(record["removed"])
    ledger = ledger_of(out)
    assert ledger[row["source"]]["status"] == schema.TAKEN_DOWN
    assert f"listed in {saved}" in ledger[row["source"]]["reason"] and "pdq:" in ledger[row["source"]]["reason"]
    result = audit(str(out))
    assert result.ok, result.summary()

    # the saved list as a blocklist: the image never enters a new curation of the same pool
    pool, fresh = wds_curated_run[0], tmp_path / "fresh"
    cheap = [
        f"stages.{s}.enabled=false" for s in ("person", "head_pose", "quality", "text_overlay", "nsfw", "embedding")
    ]
    args = ["--config", str(repo_root / "configs/curate/lite.yaml"), "--input", str(pool), "--output", str(fresh)]
    assert curate.main([*args, "--phases", "score", *cheap, f"filters.blocklists=[{saved}]"]) == 0
    fates = {r["source"]: r for r in read_ledger(str(fresh), ["source", "status", "reason"]).to_pylist()}
    blocked = {s for s, r in fates.items() if (r["reason"] or "").startswith("blocklisted: ")}
    assert blocked >= {r["source"] for r in record["removed"]}
    # and the pool's other copies of that photo (the output had kept one of them), nothing else: the sample pool
    # names each input <kind>-<photo>[_<change>]
    photo = row["source"].split("#")[1].split("-", 1)[1].split("_")[0].split(".")[0]
    assert len(blocked) > 1 and all(s.split("#")[1].split("-", 1)[1].startswith(photo) for s in blocked), blocked
    assert f"blocklisted: {saved}: pdq:" in fates[row["source"]]["reason"]


def test_shards_written_before_the_pdq_column_are_hashed_from_their_images(tmp_path, caplog):
    photos = package_photo_files()
    (tmp_path / "bus.jpg").write_bytes(photos["bus"])
    listing = td.make_list("report", td.picture_lines([str(tmp_path / "bus.jpg")])).listing
    older = pa.table(  # a shard of an output curated before the column: the image bytes, no pdq
        {
            "source": list(photos),
            "image": [{"bytes": copies(d)["half"], "path": None} for d in photos.values()],
        }
    )
    with caplog.at_level("INFO"):
        named = listing.named_by(older)
    assert [s for s, e in zip(photos, named, strict=True) if e is not None] == ["bus"]
    assert f"{len(photos)} images stored before the pdq column: hashing them" in caplog.text
    assert td.pdq_column(older.drop_columns(["image"])) is None  # neither: nothing to match by hash


def test_the_card_counts_what_the_blocklists_kept_out():
    from curation.phases.write.card import safety_markdown

    funnel = {"score/phash/rejected/blocklisted": 3, "score/phash/kept/": 5, "score/decode/rejected/too_small": 2}
    text = safety_markdown({"curation": {"safety": [], "blocklists": ["s3://lists/report.txt"]}, "funnel": funnel})
    assert "`s3://lists/report.txt`" in text and "kept 3 of 10 inputs out (30" in text
