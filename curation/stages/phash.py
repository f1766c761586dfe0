"""Perceptual hash for near-duplicate detection: ``imagehash.phash`` (64-bit DCT hash) on a draft decode.

The hash only looks at a 32x32 grayscale thumbnail, so decoding the full image is wasted work: the JPEG is
decoded in draft mode (libjpeg's 1/2..1/8 scaled IDCT, straight to grayscale) to about
``cfg.models.phash.draft_side`` or more on the long side, EXIF-oriented, and hashed from there. On the package photos
this stays within a couple of bits of the hash of the full decode at a fraction of the cost.

Bit order of the stored ``uint64``: the 8x8 boolean hash (row-major, row 0 = lowest vertical frequencies) read
most significant bit first, exactly the order of ``str(imagehash.ImageHash)``. So
``imagehash.hex_to_hash(f"{value:016x}")`` gives the ImageHash back, and the Hamming distance of two hashes is
``(a ^ b).bit_count()``.

Sub-crop hashes (``pdq_crops``): a light crop (keeping ~88-97% of each side) moves the pHash by ~12 bits and PDQ by
~90 at the median on real photos, as far as unrelated pictures come by chance at 10^9 survivors. So each image also
stores the PDQs of ``CROP_COUNT`` sub-crops of its draft decode: for each of ``CROP_SCALES`` of each side, a
``CROP_STEPS`` x ``CROP_STEPS`` grid of windows, corner to corner. A cropped copy's own PDQ then lies close to the
PDQ of the original's window that frames it most alike (``link_rule.crop_distances``: ~30 of 256 bits at the median
for real crops, 58 at the 99th percentile, against 111 +- 5 for unrelated photos; ``benchmarks/dedup_truth.py``).
Of the grids tried on those photos with the pHash (crops within 4 bits: one scale of 0.92 in 4x4 windows 71%, 5x5
79%; 0.90 and 0.95 in 3x3 72%, in 4x4 86%; 0.88, 0.92 and 0.96 in 3x3 79%), two scales of 4x4 came closest, for
crops and for reposts (a crop then a resize). PDQ rather than the pHash because 64 bits leave no room at 10^9
(``link_rule``). The 32 more hashes cost ~17 ms per image and 1 KiB per row (1 TB at 10^9), in the scored parts
only: the shards and the ledgers leave them out.

PDQ (``pdq``, ``common.pdq``): the 256-bit perceptual hash that takedowns and blocklists name copies by
(``common.takedown_lists``). The same stage rejects inputs ``filters.blocklists`` name (reason ``blocklisted``), so
listed content never enters an output.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from PIL import Image

from common import schema
from common.imageio import open_reduced
from common.pdq import PDQ_BYTES, pdq_of, pdq_of_image
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


def pdq_crops(image: Image.Image) -> bytes:
    """The PDQs of a decoded image's ``CROP_COUNT`` sub-crops (``crop_boxes``), one after another."""
    return b"".join(pdq_of_image(image.crop(box))[0] for box in crop_boxes(*image.size))


def hashes_of(data: bytes, draft_side: int) -> dict:
    """The stage's hash columns of encoded image bytes: ``phash``, ``pdq`` and ``pdq_crops``."""
    # imagehash resamples to 32x32 itself: hand it the draft decode as is, without a resize in between
    draft = open_reduced(data, max_side=draft_side, mode="L")
    return {"phash": phash_of(draft), "pdq": pdq_of(data)[0], "pdq_crops": pdq_crops(draft)}


def hamming(a: int, b: int) -> int:
    """Number of differing bits between two stored hashes."""
    return (a ^ b).bit_count()


class PhashStage(Stage):
    """The perceptual hashes of each image; rejects the inputs ``filters.blocklists`` name."""

    name = "phash"
    reads = ("image", "key", "source", "metadata_json")  # the identity a blocklist may name
    # 64-bit DCT perceptual hash (imagehash bit order, big-endian), PDQ, and the PDQs of the sub-crops
    columns = (
        pa.field("phash", pa.uint64()),
        pa.field("pdq", pa.binary(PDQ_BYTES)),  # in the ledger too: a takedown marks rejected-or-kept rows by it
        pa.field("pdq_crops", pa.binary(PDQ_BYTES * CROP_COUNT), metadata=schema.WORKING_ONLY),
    )
    model_section = "phash"
    thresholds = ("blocklists", "blocklist_distance")
    default_settings = StageSettings(batch_size=32, num_cpus=0.25)
    default_order = 50

    def setup(self) -> None:
        import imagehash  # noqa: F401 - import (and its scipy) once per worker, not on the first image

        from common.takedown_lists import blocklist

        f = self.cfg.filters
        self.blocklists = [named for uri in f.blocklists for named in blocklist(uri, f.blocklist_distance)]

    def process_batch(self, rows: list[Row]) -> list[Update]:
        side = self.cfg.models.phash.draft_side
        updates: list[Update] = []
        for row in rows:
            updates.append(hashes_of(row["image"]["bytes"], side))
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
