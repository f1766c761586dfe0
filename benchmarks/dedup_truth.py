"""Dedup truth on real photos: how often each signal, and the link rule, joins a photo to its own copies and to
other photos.

    python benchmarks/dedup_truth.py                    # package photos + Debian's opencv-doc and darknet photos
    python benchmarks/dedup_truth.py --no-debian        # the package photos only (no download)

Photos: the ones that ship in installed packages (``generators.sample_pool.load_photos``) and, unless
``--no-debian``, the photographs in Debian's ``opencv-doc`` and ``darknet`` packages (``apt-get download`` into
``--work``, unpacked there; the examples' data folders, 368 JPEGs and PNGs of 128 px or more on the short side).
Copies of one picture inside those packages (the same test image in several docs pages) are folded into one
original first (``_distinct``). Each original gets ``--variants`` copies of every kind in ``VARIANT_KINDS``: a
JPEG re-encode, a resize, a light crop, a watermark, a colour shift, a tone change and a combination, with
seeded parameters. The signals are the pipeline's own: the pHash stage's hashes (``stages.phash.hashes_of``: the
pHash, PDQ and sub-crop PDQs, whose crop distance is ``link_rule.crop_distances``), the lite embedding stage's decode
and descriptor.

Printed: per copy kind, the share of (original, copy) pairs each signal and the rule links (recall); over every
pair of different originals, how many each links (chance links on unrelated photos) and the precision of each
over all pairs; the rule's tail estimate (``curation.phases.dedup.chance``) from the unrelated pairs; and the
assumption behind a crop region's estimate (``crop_assumption``: sub-crop PDQs spread like whole-image PDQs over
unrelated pairs, so the crop distance links by chance at most ``comparisons(K)`` times as often as the PDQ).
``--json`` writes the figures for RESULTS.md; ``--calibration`` what ``bench_scale.py`` plants copies from.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from PIL import Image, ImageDraw, ImageEnhance, ImageFont

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.imageio import decode  # noqa: E402
from curation.phases.dedup.link_rule import LinkRule, comparisons, crop_distances, pdq_words  # noqa: E402
from curation.stages.embedding import embed  # noqa: E402
from curation.stages.phash import CROP_COUNT, PhashStage, hashes_of  # noqa: E402

DEBIAN_PACKAGES = ("opencv-doc", "darknet")
# folders of those packages that hold photographs (the docs pages' figures are mostly screenshots and plots)
PHOTO_FOLDERS = (
    "usr/share/doc/opencv-doc/examples/data",
    "usr/share/doc/opencv-doc/examples/text",
    "usr/share/doc/opencv-doc/examples/hfs/data",
    "usr/share/doc/opencv-doc/opencv4/html",
    "usr/share/darknet/data",
)
MIN_SIDE = 128
VARIANT_KINDS = ("reencode", "resize", "crop", "watermark", "colour", "tone", "combo")
DRAFT_SIDE = 192  # models.phash.draft_side's default
EMBED_SIDE = 256  # the lite embedding's decode side


def _jpeg(img: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    img.convert("RGB").save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _crop(img: Image.Image, frac: float, rng: np.random.Generator) -> Image.Image:
    cw, ch = round(img.width * frac), round(img.height * frac)
    x0, y0 = int(rng.integers(0, img.width - cw + 1)), int(rng.integers(0, img.height - ch + 1))
    return img.crop((x0, y0, x0 + cw, y0 + ch))


def _watermark(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A stock-photo mark: semi-transparent text, large across the centre or small in a corner."""
    from generators.sample_pool import _font_path

    out = img.convert("RGBA")
    layer = Image.new("RGBA", out.size, (0, 0, 0, 0))
    draw = ImageDraw.Draw(layer)
    large = bool(rng.integers(0, 2))
    size = max(10, (out.width // 9) if large else (out.height // 20))
    font = ImageFont.truetype(str(_font_path()), size)
    text = "(c) stockphoto" if large else "(c) photographer.example"
    box = draw.textbbox((0, 0), text, font=font)
    w, h = box[2] - box[0], box[3] - box[1]
    x, y = ((out.width - w) // 2, (out.height - h) // 2) if large else (out.width - w - 8, out.height - h - 8)
    alpha = int(rng.uniform(0.3, 0.6) * 255)
    draw.text((x, y), text, font=font, fill=(255, 255, 255, alpha), stroke_width=max(1, size // 15),
              stroke_fill=(0, 0, 0, alpha // 2))  # fmt: skip
    return Image.alpha_composite(out, layer).convert("RGB")


def _colour(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A hue rotation of 10-30 degrees either way and a saturation change (a filter, a white-balance fix)."""
    hsv = np.asarray(img.convert("RGB").convert("HSV")).astype(np.int16)
    shift = int(rng.uniform(7, 21)) * (1 if rng.integers(0, 2) else -1)  # of 255
    hsv[..., 0] = (hsv[..., 0] + shift) % 256
    hsv[..., 1] = np.clip(hsv[..., 1] * rng.uniform(0.7, 1.3), 0, 255)
    return Image.fromarray(hsv.astype(np.uint8), "HSV").convert("RGB")


def _tone(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    img = ImageEnhance.Brightness(img.convert("RGB")).enhance(rng.uniform(0.75, 1.25))
    return ImageEnhance.Contrast(img).enhance(rng.uniform(0.75, 1.25))


def variant(img: Image.Image, kind: str, rng: np.random.Generator) -> bytes:
    """One copy of ``img`` of ``kind`` (``VARIANT_KINDS``) as JPEG bytes."""
    if kind == "reencode":
        return _jpeg(img, int(rng.integers(25, 71)))
    if kind == "resize":
        s = rng.uniform(0.4, 0.85)
        return _jpeg(img.resize((max(8, round(img.width * s)), max(8, round(img.height * s))), Image.LANCZOS), 85)
    if kind == "crop":
        return _jpeg(_crop(img, rng.uniform(0.88, 0.97), rng), 90)
    if kind == "watermark":
        return _jpeg(_watermark(img, rng), 90)
    if kind == "colour":
        return _jpeg(_colour(img, rng), 90)
    if kind == "tone":
        return _jpeg(_tone(img, rng), 90)
    if kind == "combo":  # resized, lightly cropped and re-saved: a repost
        s = rng.uniform(0.5, 0.9)
        small = _crop(img, rng.uniform(0.93, 0.99), rng)
        small = small.resize((max(8, round(small.width * s)), max(8, round(small.height * s))), Image.LANCZOS)
        return _jpeg(small, int(rng.integers(40, 81)))
    raise ValueError(f"unknown copy kind {kind!r}")


def signals(data: bytes) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """The pHash, the PDQ (4 uint64 words), the sub-crop PDQs (``CROP_COUNT`` x 4) and the lite embedding exactly as
    the pipeline's stages compute them."""
    hashes = hashes_of(data, DRAFT_SIDE)
    pdq, crops = (pdq_words(pa.array([hashes[c.name]], c.type))[0][0] for c in PhashStage.columns[1:])
    return hashes["phash"], pdq, crops, embed(decode(data, max_side=EMBED_SIDE))


# --- photos -----------------------------------------------------------------------------------------------------------


def debian_photos(work: Path) -> list[tuple[str, bytes]]:
    """The photographs in Debian's packages (downloaded and unpacked under ``work`` once)."""
    root = work / "debian"
    if not (root / ".unpacked").exists():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["apt-get", "download", *DEBIAN_PACKAGES], cwd=root, check=True, capture_output=True)
        for deb in sorted(root.glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root / "x")], check=True)
        (root / ".unpacked").touch()
    out = []
    for folder in PHOTO_FOLDERS:
        for path in sorted((root / "x" / folder).rglob("*")):
            if path.suffix.lower() not in {".jpg", ".jpeg"}:  # the docs pages' PNGs are diagrams and plots
                continue
            data = path.read_bytes()
            try:
                img = Image.open(io.BytesIO(data))
                if min(img.size) < MIN_SIDE or img.mode not in {"RGB", "L", "RGBA", "P"}:
                    continue
            except Exception:  # noqa: BLE001 - not a picture Pillow reads: not a fixture
                continue
            out.append((f"{path.parent.name}/{path.name}", data))
    return out


def package_photos() -> list[tuple[str, bytes]]:
    from generators.sample_pool import load_photos

    return [(name, photo.data) for name, photo in load_photos().items()]


@dataclass
class Photos:
    names: list[str]
    images: list[Image.Image]
    phash: np.ndarray  # uint64
    pdq: np.ndarray  # N x 4 uint64 words
    crops: np.ndarray  # N x CROP_COUNT x 4 uint64: the sub-crop PDQs
    embedding: np.ndarray  # N x D


def _distinct(named: list[tuple[str, bytes]]) -> Photos:
    """One original per picture: byte-identical files once, and copies of one picture inside the packages (the
    same test image in several pages: pHash within 4 bits and cosine >= 0.98, well inside what any copy kind
    here reaches) folded into the first."""
    seen: set[str] = set()
    names, images, hashes, pdqs, crops, embs = [], [], [], [], [], []
    for name, data in named:
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        img = Image.open(io.BytesIO(data)).convert("RGB")
        h, pdq, hc, e = signals(_jpeg(img, 95))
        if hashes:
            d = np.bitwise_count(np.asarray(hashes, np.uint64) ^ np.uint64(h))
            if np.any((d <= 4) & (np.asarray(embs) @ e >= 0.98)):
                continue
        names.append(name)
        images.append(img)
        hashes.append(h)
        pdqs.append(pdq)
        crops.append(hc)
        embs.append(e)
    return Photos(
        names,
        images,
        np.asarray(hashes, np.uint64),
        np.asarray(pdqs, np.uint64).reshape(-1, 4),
        np.asarray(crops, np.uint64).reshape(-1, CROP_COUNT, 4),
        np.asarray(embs, np.float32),
    )


# --- evaluation -------------------------------------------------------------------------------------------------------


@dataclass
class Copies:
    """Each copy's original, kind, and its pHash distance, cosine, crop distance and PDQ distance to the original."""

    original: np.ndarray
    kind: np.ndarray
    distance: np.ndarray
    cosine: np.ndarray
    crop: np.ndarray  # ``link_rule.crop_distances`` of the copy and its original
    pdq: np.ndarray  # the whole PDQs' distance


def make_copies(photos: Photos, n_variants: int, seed: int) -> Copies:
    rng = np.random.default_rng(seed)
    rows = []
    for k, img in enumerate(photos.images):
        for kind in VARIANT_KINDS:
            for _ in range(n_variants):
                h, pdq, hc, e = signals(variant(img, kind, rng))
                crop = crop_distances(pdq[None], hc[None], photos.pdq[k : k + 1], photos.crops[k : k + 1])[0]
                whole = crop_distances(pdq[None], [], photos.pdq[k : k + 1], [])[0]
                d = int(np.bitwise_count(np.uint64(h) ^ photos.phash[k]))
                rows.append((k, kind, d, float(e @ photos.embedding[k]), int(crop), int(whole)))
    k, kind, d, c, crop, whole = zip(*rows)
    return Copies(*(np.asarray(v) for v in (k, kind, d, c, crop, whole)))


def unrelated_pairs(photos: Photos) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every pair of different originals: indices, pHash distance, cosine, crop distance."""
    i, j = np.triu_indices(len(photos.names), 1)
    d = np.bitwise_count(photos.phash[i] ^ photos.phash[j]).astype(np.int64)
    crop = crop_distances(photos.pdq[i], photos.crops[i], photos.pdq[j], photos.crops[j]).astype(np.int64)
    return i, j, d, np.einsum("ij,ij->i", photos.embedding[i], photos.embedding[j]), crop


def evaluate(photos: Photos, copies: Copies, rules: dict[str, LinkRule]) -> dict:
    """Per rule: recall per copy kind, links among different originals (chance links, and derived pictures the
    packages hold: a filter's result beside its input), precision over every pair of the set."""
    i, _, d_u, c_u, crop_u = unrelated_pairs(photos)
    out: dict = {"originals": len(photos.names), "copies": int(copies.kind.size), "unrelated_pairs": int(i.size)}
    for label, rule in rules.items():
        found = rule.links(copies.distance, copies.cosine, copies.crop)
        chance = rule.links(d_u, c_u, crop_u)
        true_pos, false_pos = int(found.sum()), int(chance.sum())
        out[label] = {
            "rule": rule.describe(),
            "recall": {"all": round(float(found.mean()), 4)}
            | {kind: round(float(found[copies.kind == kind].mean()), 4) for kind in VARIANT_KINDS},
            "links_between_originals": false_pos,
            "precision": round(true_pos / max(true_pos + false_pos, 1), 4),
        }
    out["copy_distances"] = {
        kind: {
            "phash_p50_p90_p99": [int(np.percentile(copies.distance[copies.kind == kind], q)) for q in (50, 90, 99)],
            "crop_p50_p90_p99": [int(np.percentile(copies.crop[copies.kind == kind], q)) for q in (50, 90, 99)],
            "pdq_p50_p90_p99": [int(np.percentile(copies.pdq[copies.kind == kind], q)) for q in (50, 90, 99)],
            "cosine_p1_p10_p50": [
                round(float(np.percentile(copies.cosine[copies.kind == kind], q)), 3) for q in (1, 10, 50)
            ],
        }
        for kind in VARIANT_KINDS
    }
    out["between_originals"] = {
        "phash_mean_sd": [round(float(d_u.mean()), 2), round(float(d_u.std()), 2)],
        "crop_mean_sd": [round(float(crop_u.mean()), 2), round(float(crop_u.std()), 2)],
        "cosine_mean_sd": [round(float(c_u.mean()), 3), round(float(c_u.std()), 3)],
    }
    return out


def chance_check(photos: Photos, copies: Copies, rule: LinkRule) -> list[dict]:
    """The chance estimate (``curation.phases.dedup.chance``) on the originals as a pool of their own, beside the
    links counted between them, per region and radius where they are observable."""
    from curation.phases.dedup import chance
    from curation.phases.dedup.embedding_clusters import default_cluster_size, kmeans, nearest

    n = len(photos.names)
    home = nearest(photos.embedding, kmeans(photos.embedding, max(1, n // default_cluster_size(n)), 0))
    pdq = chance.PdqSample(photos.pdq, np.ones(n, bool), CROP_COUNT)
    sample = chance.measure(n, photos.phash, np.ones(n, bool), photos.embedding, home, 1.0, 10**6, 0, pdq)
    i, j, d_u, c_u, crop_u = unrelated_pairs(photos)
    same = home[i] == home[j]
    # the same per-pair rates at 10^9 survivors: pairs of the pool, and pairs compared inside clusters of the size a
    # pool of 10^9 has (one row per survivor)
    big = 10**9
    scale_pool = big * (big - 1) / (n * (n - 1))
    scale_clusters = big * (default_cluster_size(big) - 1) / float((np.bincount(home) * (np.bincount(home) - 1)).sum())
    rows = []
    for region in rule.regions:
        estimate = chance.region_estimate(sample, region)  # a crop region's counts its comparisons (union bound)
        step = 8 if region.crops else 4
        for r in sorted({max(region.radius - 2 * step, 0), max(region.radius - step, 0), region.radius}):
            inside = ((crop_u if region.crops else d_u) <= r) & (same if region.min_cosine is not None else True)
            if region.min_cosine is not None:
                inside &= c_u >= region.min_cosine
            at_big = estimate.expected(r) * (scale_pool if region.min_cosine is None else scale_clusters)
            rows.append({"region": region.describe(), "radius": r, "estimated": round(estimate.expected(r), 2),
                         "counted": int(inside.sum()), "estimated_at_1e9": float(f"{at_big:.3g}")})  # fmt: skip
    return rows


def crop_assumption(photos: Photos, seed: int, sampled_pairs: int | None = None, radii=(48, 56, 64, 72)) -> dict:
    """The chance estimate of a crop region (``comparisons(CROP_COUNT)`` plain PDQ comparisons, a union bound) against
    the unrelated pairs of originals: the spread of whole-whole PDQ distances and of single cross comparisons (one
    image's PDQ against one sub-crop PDQ of the other, every sub-crop of both sides, on ``sampled_pairs`` random pairs
    or all), and how many distances are odd, and per radius the pairs counted within that crop distance beside
    ``comparisons(CROP_COUNT)`` x the pairs within that PDQ distance (counted, and from the normal fitted beyond the
    radius as the estimate fits it), over all the pairs and over those at cosine >= 0.85."""
    from curation.phases.dedup.chance import Tail

    i, j, _, c_u, crop_u = unrelated_pairs(photos)
    d_u = crop_distances(photos.pdq[i], [], photos.pdq[j], []).astype(np.int64)
    rng = np.random.default_rng([seed, 11])
    pick = rng.choice(i.size, min(sampled_pairs or i.size, i.size), replace=False)
    a, b = i[pick], j[pick]
    cross = np.concatenate(
        [
            np.bitwise_count(photos.pdq[a][:, None] ^ photos.crops[b]).sum(axis=-1).ravel(),
            np.bitwise_count(photos.pdq[b][:, None] ^ photos.crops[a]).sum(axis=-1).ravel(),
        ]
    ).astype(np.int64)
    k = comparisons(CROP_COUNT)
    hist = np.bincount(d_u, minlength=257)
    high = c_u >= 0.85
    rows = []
    for r in radii:
        tail = Tail.fit(hist, r, None)
        p = tail.p_within(r)
        normal_whole = float((d_u > r).sum()) / max(1 - p, 1e-12) * p
        rows.append(
            {
                "radius": r,
                "whole_share_within": float(f"{(d_u <= r).mean():.3g}"),
                "cross_share_within": float(f"{(cross <= r).mean():.3g}"),
                "crop_counted": int((crop_u <= r).sum()),
                "whole_counted": int((d_u <= r).sum()),
                "predicted_from_counted": k * int((d_u <= r).sum()),
                "predicted_from_normal": round(k * normal_whole, 2),
                "normal_fit_mean_sd": [round(tail.mean, 2), round(tail.sd, 2)],
                "at_cosine_0.85": {
                    "crop_counted": int(((crop_u <= r) & high).sum()),
                    "whole_counted": int(((d_u <= r) & high).sum()),
                    "predicted_from_counted": k * int(((d_u <= r) & high).sum()),
                },
            }
        )
    return {
        "pairs": int(i.size),
        "comparisons": k,
        "whole_mean_sd": [round(float(d_u.mean()), 2), round(float(d_u.std()), 2)],
        "cross_mean_sd": [round(float(cross.mean()), 2), round(float(cross.std()), 2)],
        "cross_comparisons": int(cross.size),
        "cross_sampled_pairs": int(pick.size),
        "odd_distances": {
            "whole": int((d_u % 2).sum()),
            "cross": int((cross % 2).sum()),
            "crop": int((crop_u % 2).sum()),
        },
        "crop_mean_sd": [round(float(crop_u.mean()), 2), round(float(crop_u.std()), 2)],
        "by_radius": rows,
    }


def calibration(photos: Photos, copies: Copies) -> dict:
    """What ``bench_scale.py`` plants from: each copy kind's measured (pHash distance, cosine) pairs (``copies``), the
    same copies as (pHash distance, cosine, PDQ crop distance, PDQ distance) in the same order (``copies_crop``), and the
    cosines of pairs of different originals that share a k-means cluster (clusters of ``default_cluster_size``)."""
    from curation.phases.dedup.embedding_clusters import default_cluster_size, kmeans, nearest

    n = len(photos.names)
    home = nearest(photos.embedding, kmeans(photos.embedding, max(1, n // default_cluster_size(n)), 0))
    i, j, _, c_u, _ = unrelated_pairs(photos)
    same = home[i] == home[j]
    return {
        "copies": {
            kind: [
                [int(d), round(float(c), 4)]
                for d, c in zip(copies.distance[copies.kind == kind], copies.cosine[copies.kind == kind])
            ]
            for kind in VARIANT_KINDS
        },
        "copies_crop": {
            kind: [
                [int(d), round(float(c), 4), int(x), int(w)]
                for d, c, x, w in zip(
                    copies.distance[copies.kind == kind],
                    copies.cosine[copies.kind == kind],
                    copies.crop[copies.kind == kind],
                    copies.pdq[copies.kind == kind],
                )
            ]
            for kind in VARIANT_KINDS
        },
        "within_cluster_cosine_quantiles": [round(float(q), 4) for q in np.quantile(c_u[same], np.linspace(0, 1, 101))],
        "within_cluster_pairs": int(same.sum()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="out/dedup_truth", help="where the Debian packages are unpacked")
    ap.add_argument("--no-debian", action="store_true", help="the package photos only")
    ap.add_argument("--variants", type=int, default=2, help="copies of each kind per original")
    ap.add_argument("--radii", action="append", default=[],
                    help="also the rule at these radii (comma-separated, one per region in order; -1: off; regions "
                    "left out are off), e.g. the ones a run at 10^9 fits; may be given more than once")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--calibration", help="write bench_scale.py's calibration here")
    args = ap.parse_args()
    from curation.settings import DedupSettings

    named = package_photos() + ([] if args.no_debian else debian_photos(Path(args.work)))
    photos = _distinct(named)
    print(f"{len(named)} photo files, {len(photos.names)} distinct originals", file=sys.stderr)
    copies = make_copies(photos, args.variants, args.seed)
    rule = DedupSettings().rule()
    rules = {
        "pHash <= 8 alone": LinkRule.of([(8, None)]),
        "cosine >= 0.95 alone": LinkRule.of([(64, 0.95)]),
        "cosine >= 0.80 and PDQ crop distance <= 64": LinkRule.of([(64, 0.80, True)]),
        "previous: pHash <= 8 or cosine >= 0.95": LinkRule.of([(8, None), (64, 0.95)]),
        "rule": rule,
    }
    for radii in args.radii:
        values = [int(r) for r in radii.split(",")]
        if len(values) > len(rule.regions):
            ap.error(f"--radii {radii}: the rule has {len(rule.regions)} regions")
        rules[f"rule at --radii {radii}"] = rule.with_radii(values + [-1] * (len(rule.regions) - len(values)))
    result = evaluate(photos, copies, rules)
    result["chance_check"] = chance_check(photos, copies, rule)
    result["crop_assumption"] = crop_assumption(photos, args.seed)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.calibration:
        Path(args.calibration).write_text(json.dumps(calibration(photos, copies)))


if __name__ == "__main__":
    main()
