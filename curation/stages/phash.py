"""Perceptual hash for near-duplicate detection: ``imagehash.phash`` (64-bit DCT hash) on a draft decode.

The hash only looks at a 32x32 grayscale thumbnail, so decoding the full image is wasted work: the JPEG is
decoded in draft mode (libjpeg's 1/2..1/8 scaled IDCT, straight to grayscale) to about
``cfg.models.phash.draft_side`` or more on the long side, EXIF-oriented, and hashed from there. On the package photos
this stays within a couple of bits of the hash of the full decode at a fraction of the cost.

Bit order of the stored ``uint64``: the 8x8 boolean hash (row-major, row 0 = lowest vertical frequencies) read
most significant bit first, exactly the order of ``str(imagehash.ImageHash)``. So
``imagehash.hex_to_hash(f"{value:016x}")`` gives the ImageHash back, and the Hamming distance of two hashes is
``(a ^ b).bit_count()``.

Sub-crop hashes (``phash_crops``): a light crop (keeping ~88-97% of each side) moves the pHash by ~12 bits at the
median on real photos, as far as unrelated pictures come by chance at 10^9 survivors. So each image also stores the
pHashes of ``CROP_COUNT`` sub-crops of its draft decode: for each of ``CROP_SCALES`` of each side, a
``CROP_STEPS`` x ``CROP_STEPS`` grid of windows, corner to corner. A cropped copy's own pHash then lies close to the
hash of the original's window that frames it most alike (``link_rule.crop_distances``: 2 bits at the median for
real crops and reposts, against 12 and 6 for the whole-image hashes, ``benchmarks/dedup_truth.py``). Of the grids
tried on those photos (crops within 4 bits: one scale of 0.92 in 4x4 windows 71%, 5x5 79%; 0.90 and 0.95 in 3x3
72%, in 4x4 86%; 0.88, 0.92 and 0.96 in 3x3 79%), two scales of 4x4 came closest, for crops and for reposts (a
crop then a resize). The 32 more hashes cost ~8 ms per image and 256 bytes per row (256 GB at 10^9).

PDQ (``pdq``): the 256-bit perceptual hash that industry hash-sharing programmes exchange (Meta's, through the
``pdqhash`` bindings), kept for takedowns and blocklists (``curation.phases.write.takedown``): a list line
``pdq:<64 hex>`` names every image within its distance. It is computed as the reference hasher does, on the decoded
RGB picture; a JPEG of 2048 px or more is decoded in draft mode to at least ``PDQ_DRAFT_SIDE`` (PDQ's own box filters
reduce it to 64x64: 0 bits from the full decode on the package photos, a 4320 px one included). ~5-15 ms per image.
The same stage rejects inputs ``filters.blocklists`` name (reason ``blocklisted``), so listed content never enters an
output.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from PIL import Image

from common import schema
from common.imageio import open_reduced
from curation.score.stage import REJECT, Row, Stage, StageSettings, Update, reject


def hash_to_int(hash_bits: np.ndarray) -> int:
    """An 8x8 boolean hash as an unsigned 64-bit integer, first bit most significant."""
    return int.from_bytes(np.packbits(np.asarray(hash_bits, dtype=bool).ravel()).tobytes(), "big")


def phash_of(image: np.ndarray | Image.Image) -> int:
    """pHash of a decoded image (uint8 array or PIL image; RGB converted as PIL does) as a uint64-ranged int."""
    import imagehash

    return hash_to_int(imagehash.phash(image if isinstance(image, Image.Image) else Image.fromarray(image)).hash)


CROP_SCALES = (0.90, 0.95)
CROP_STEPS = 4
CROP_COUNT = len(CROP_SCALES) * CROP_STEPS * CROP_STEPS


def crop_boxes(width: int, height: int) -> list[tuple[int, int, int, int]]:
    """The sub-crop windows of a ``width`` x ``height`` image, scale by scale, row by row (left, upper, right,
    lower)."""
    boxes = []
    for scale in CROP_SCALES:
        w, h = round(scale * width), round(scale * height)
        xs = np.linspace(0, width - w, CROP_STEPS).round().astype(int)
        ys = np.linspace(0, height - h, CROP_STEPS).round().astype(int)
        boxes += [(int(x), int(y), int(x) + w, int(y) + h) for y in ys for x in xs]
    return boxes


def phash_and_crops(image: Image.Image) -> tuple[int, list[int]]:
    """The pHash of a decoded image and of its ``CROP_COUNT`` sub-crops (``crop_boxes``)."""
    return phash_of(image), [phash_of(image.crop(box)) for box in crop_boxes(*image.size)]


PDQ_DRAFT_SIDE = 1024
PDQ_BYTES = 32
PDQ_MIN_QUALITY = 50  # below this the reference treats a hash as too weak to match on (flat or tiny pictures)


def pdq_of_image(image: Image.Image) -> tuple[bytes, int]:
    """The PDQ hash (32 bytes, most significant bit first: ``.hex()`` is the reference's hex) and its quality
    (0-100)."""
    import pdqhash

    bits, quality = pdqhash.compute(np.asarray(image if image.mode == "RGB" else image.convert("RGB")))
    return np.packbits(np.asarray(bits, bool)).tobytes(), int(quality)  # bits: bit 255 first


def pdq_of(data: bytes) -> tuple[bytes, int]:
    """The PDQ hash and quality of encoded image bytes (``pdq_of_image`` on the decode described above)."""
    return pdq_of_image(open_reduced(data, max_side=PDQ_DRAFT_SIDE))


# A copy cropped from a reported picture: PDQ moves 40-80 bits for a crop keeping 95% of each side (the package
# photos), as far as it moves for an unrelated picture's near neighbour. So a report lists, beside its picture's hash,
# those of windows of it a light crop frames: 93%, 95% and 97% of each side at every 0.5% step of position (a window
# 0.25% off the crop is within ~20 bits of it), and of the picture at 3/4 and 1/2 size (a small picture resized moves
# by resampling: of the real photos' resized copies PDQ misses, these find 20 of 24). 398 hashes a picture, ~0.9 s;
# their chance cost is counted per line.
REPORT_SCALES = (0.75, 0.5)
REPORT_WINDOW_SCALES = (0.93, 0.95, 0.97)
REPORT_WINDOW_STEP = 0.005
REPORT_WINDOW_SIDE = 512  # the windows are cut from a thumbnail of this long side


def report_windows(width: int, height: int) -> list[tuple[float, float, float, tuple[int, int, int, int]]]:
    """(scale, x offset, y offset, box) of each window ``pdq_report`` hashes, offsets as fractions of the side."""
    out = []
    for scale in REPORT_WINDOW_SCALES:
        w, h = round(scale * width), round(scale * height)
        steps = round((1 - scale) / REPORT_WINDOW_STEP)
        for j in range(steps + 1):
            for i in range(steps + 1):
                fx, fy = i * REPORT_WINDOW_STEP, j * REPORT_WINDOW_STEP
                x, y = round(fx * width), round(fy * height)
                out.append((scale, fx, fy, (x, y, min(width, x + w), min(height, y + h))))
    return out


def pdq_report(data: bytes) -> list[tuple[bytes, int, str]]:
    """A reported picture's PDQ hashes: its own (first), at ``REPORT_SCALES``, then its windows'
    (``report_windows``), each with its quality and what it is."""
    image = open_reduced(data, max_side=PDQ_DRAFT_SIDE)
    own, quality = pdq_of_image(image)
    small = image.convert("RGB")
    small.thumbnail((REPORT_WINDOW_SIDE, REPORT_WINDOW_SIDE))
    out = [(own, quality, "the picture")]
    for scale in REPORT_SCALES:
        size = (max(8, round(image.width * scale)), max(8, round(image.height * scale)))
        digest, q = pdq_of_image(image.convert("RGB").resize(size, Image.Resampling.LANCZOS))
        out.append((digest, q, f"the picture at {scale:g} size"))
    for scale, fx, fy, box in report_windows(*small.size):
        digest, q = pdq_of_image(small.crop(box))
        out.append((digest, q, f"window {scale:.0%} at ({fx:.1%}, {fy:.1%})"))
    return out


def hamming(a: int, b: int) -> int:
    """Number of differing bits between two stored hashes."""
    return (a ^ b).bit_count()


class PhashStage(Stage):
    """The perceptual hashes of each image; rejects the inputs ``filters.blocklists`` name."""

    name = "phash"
    reads = ("image", "key", "source", "metadata_json")  # the identity a blocklist may name
    # 64-bit DCT perceptual hash (imagehash bit order, big-endian), those of the sub-crops (``crop_boxes``), and PDQ
    columns = (
        pa.field("phash", pa.uint64()),
        pa.field("phash_crops", pa.list_(pa.uint64(), CROP_COUNT), metadata=schema.WORKING_ONLY),
        pa.field("pdq", pa.binary(PDQ_BYTES)),  # in the ledger too: a takedown marks rejected-or-kept rows by it
    )
    model_section = "phash"
    thresholds = ("blocklists", "blocklist_distance")
    default_settings = StageSettings(batch_size=32, num_cpus=0.25)
    default_order = 50

    def setup(self) -> None:
        import imagehash  # noqa: F401 - import (and its scipy) once per worker, not on the first image

        from curation.phases.write.takedown import blocklist

        f = self.cfg.filters
        self.blocklists = [named for uri in f.blocklists for named in blocklist(uri, f.blocklist_distance)]

    def process_batch(self, rows: list[Row]) -> list[Update]:
        side = self.cfg.models.phash.draft_side
        updates: list[Update] = []
        for row in rows:
            data = row["image"]["bytes"]
            # imagehash resamples to 32x32 itself: hand it the draft decode as is, without a resize in between
            full, crops = phash_and_crops(open_reduced(data, max_side=side, mode="L"))
            updates.append({"phash": full, "phash_crops": crops, "pdq": pdq_of(data)[0]})
        if self.blocklists:
            table = pa.table(
                {
                    "key": pa.array([r.get("key") for r in rows], pa.string()),
                    "source": pa.array([r["source"] for r in rows], pa.string()),
                    "metadata_json": pa.array([r.get("metadata_json") for r in rows], pa.string()),
                    "pdq": pa.array([u["pdq"] for u in updates], pa.binary(PDQ_BYTES)),
                }
            )
            for listing, name in self.blocklists:
                for update, entry in zip(updates, listing.named_by(table), strict=True):
                    if entry is not None and REJECT not in update:
                        update.update(reject("blocklisted", f"{name}: {entry}"))
        return updates
