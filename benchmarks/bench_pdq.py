"""PDQ takedowns on real photos: which copies of a reported picture its list names, how near unrelated real photos
come, the chance that a listed picture names an unrelated image of a 10^9 pool, and the hash's cost per image.

    python benchmarks/bench_pdq.py [--work out/dedup_truth] [--no-debian]

The photos are those of ``benchmarks/dedup_truth.py`` (the package photos, and the JPEGs of Debian's ``opencv-doc``
and ``darknet``), byte-identical files and pictures within 16 PDQ bits of an earlier one folded. Each is reported as
``jobs.takedown --images`` lists it (``common.pdq.pdq_report``: its hash and its light-crop windows), and its
copies (``dedup_truth.variant``: re-encode, resize, crop of 88-97% of each side, watermark, colour, tone, repost; and
the acceptance's four: quality 40, half size, 2.5% off each side, a corner watermark) are matched against every
list at ``--distance``. Chance: a normal fitted to the PDQ distances of unrelated pairs (the listed hashes of one
picture against the other pictures' own hashes) gives P(d <= distance); times the lines a picture lists and 10^9.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import math
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.dedup_truth import VARIANT_KINDS, debian_photos, package_photos, variant
from common.pdq import pdq_of, pdq_report
from common.takedown_lists import PDQ_DISTANCE
from curation.stages.phash import hashes_of
from tests.curation.phases.write.test_takedown_images import copies as acceptance_copies

POOL = 10**9


def _bits(digests: list[bytes]) -> np.ndarray:
    return np.unpackbits(np.frombuffer(b"".join(digests), np.uint8).reshape(-1, 32), axis=1)


def _min_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row of ``a`` (bits), the least Hamming distance to a row of ``b``."""
    return (a[:, None, :] != b[None, :, :]).sum(axis=2).min(axis=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="out/dedup_truth")
    ap.add_argument("--no-debian", action="store_true")
    ap.add_argument("--distance", type=int, default=PDQ_DISTANCE)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    named = package_photos() + ([] if args.no_debian else debian_photos(Path(args.work)))
    seen, photos, own = set(), [], []
    for name, data in named:
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        h = _bits([pdq_of(data)[0]])
        if own and _min_distance(h, np.concatenate(own))[0] <= 16:  # the same picture inside the packages
            continue
        photos.append((name, data))
        own.append(h)
    own_bits = np.concatenate(own)
    print(f"{len(photos)} distinct photos")

    rng = np.random.default_rng(args.seed)
    kinds = [*VARIANT_KINDS, "q40", "half", "crop5", "watermark_corner"]
    found = dict.fromkeys(kinds, 0)
    total = dict.fromkeys(kinds, 0)
    unrelated, lines, windows_found_crop = [], [], 0
    t_report = 0.0
    for k, (_, data) in enumerate(photos):
        t0 = time.perf_counter()
        report = pdq_report(data)
        t_report += time.perf_counter() - t0
        if report[0][1] < 50:  # too flat to list by its picture (jobs.takedown refuses it)
            continue
        listed = _bits([d for d, q, _ in report if q >= 50])
        lines.append(len(listed))
        img = Image.open(io.BytesIO(data)).convert("RGB")
        extra = acceptance_copies(data)
        variants = {kind: variant(img, kind, rng) for kind in VARIANT_KINDS}
        variants.update({"q40": extra["q40"], "half": extra["half"], "crop5": extra["crop5"]})
        variants["watermark_corner"] = extra["watermark"]
        for kind, copy in variants.items():
            d = _min_distance(_bits([pdq_of(copy)[0]]), listed)[0]
            total[kind] += 1
            found[kind] += int(d <= args.distance)
            if kind == "crop" and d <= args.distance and _min_distance(_bits([pdq_of(copy)[0]]), listed[:1])[0] > 31:
                windows_found_crop += 1
        others = np.delete(own_bits, k, axis=0)
        unrelated.append((listed[:, None, :] != others[None, :, :]).sum(axis=2).ravel())
    d = np.concatenate(unrelated)
    whole = np.concatenate([u.reshape(n, -1)[0] for n, u in zip(lines, unrelated, strict=True)])
    mu, sd = float(d.mean()), float(d.std())
    p = 0.5 * math.erfc((mu - args.distance) / (sd * math.sqrt(2)))
    per_line = float(np.mean(lines))
    print(
        f"{len(lines)} pictures listed ({len(photos) - len(lines)} too flat); lines a picture lists: {per_line:.0f} "
        f"(its hash and its windows); {t_report / len(photos):.2f} s a picture"
    )
    print("copies named by their original's list:")
    for kind in kinds:
        print(f"  {kind}: {found[kind]}/{total[kind]} ({found[kind] / total[kind]:.1%})")
    print(f"  crops named only through a window: {windows_found_crop}")
    print(
        f"unrelated: {len(d):,} listed-hash x photo comparisons, distance {mu:.1f} +- {sd:.1f}, least {d.min()}; "
        f"whole pictures {whole.mean():.1f} +- {whole.std():.1f}, least {whole.min()}; within {args.distance}: "
        f"{int((d <= args.distance).sum())}"
    )
    print(
        f"normal tail P(d <= {args.distance}) = {p:.2e}; expected unrelated images a listed picture names at "
        f"10^9: {per_line:.0f} x {POOL:.0e} x P = {per_line * POOL * p:.2e} (goal < 1e-3)"
    )
    sample = [data for _, data in photos[:60]]
    t0 = time.perf_counter()
    for data in sample:
        pdq_of(data)
    t_pdq = (time.perf_counter() - t0) / len(sample)
    t0 = time.perf_counter()
    for data in sample:
        hashes_of(data, 192)
    t_stage = (time.perf_counter() - t0) / len(sample)
    print(
        f"cost per image: PDQ {t_pdq * 1e3:.1f} ms; the phash stage's hashes (pHash, PDQ, sub-crop PDQs) {t_stage * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
