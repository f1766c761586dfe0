"""Render synthetic humanoids with labels for all five fine-tuning tasks, as labelled Parquet shards.

    python -m jobs.make_synthetic --out <dir or s3://...> --n 2000 [--val 200] [--test 200] [--height 128 --width 96]
        [--keypoints 308] [--max-yaw 3.14] [--seed 0] [--workers 2]
    python -m jobs.make_synthetic --out <dir or s3://...> --n 4000 --unlabelled --height 512 --width 384

Writes ``<out>/train/part-00000.parquet ...`` and ``<out>/val/...`` (``common.schema.labelled_schema``), each
folder with a ``manifest.json``; ``--test N`` adds ``<out>/test/``, a third split for reporting when the validation
set chose settings. Sample ``i`` of a split is a pure function of (seed, split, i), so the same command writes
byte-identical shards, a smaller ``--n`` writes a prefix of a larger one's training set, and no figure occurs in
two splits.

``--unlabelled`` writes an image pool for ``jobs.curate`` instead: ``<out>/pool-00000.tar ...``, WebDataset
shards of JPEG renders and nothing else, drawn from a split of their own, so no pool figure is a labelled one.
``--junk F`` makes a fraction F of it web junk (``JUNK_KINDS``), which a curation should drop.
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
from concurrent.futures import ProcessPoolExecutor
from hashlib import sha256

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
from PIL import Image, ImageDraw, ImageFont

from common import schema, storage
from common.config import hash_json
from common.console import configure_console, exit_code_interruptible
from finetune.data import encode_row
from finetune.labels import COCO_KEYPOINTS, PARTS, keypoints
from generators.humanoids import RenderConfig, background, render

SPLITS = {"train": 0, "val": 1, "pool": 2, "test": 3}
POOL_JPEG_QUALITY = 90


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jobs.make_synthetic", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="output folder (local or s3://); gets train/ and val/")
    p.add_argument("--n", type=int, required=True, help="training samples")
    p.add_argument("--val", type=int, default=None, help="validation samples (default: n / 5, at least 8)")
    p.add_argument("--test", type=int, default=0, help="test samples, in <out>/test (default: none)")
    p.add_argument("--height", type=int, default=128, help="image height in pixels (default 128)")
    p.add_argument("--width", type=int, default=96, help="image width in pixels (default 96)")
    p.add_argument(
        "--keypoints",
        type=int,
        default=308,
        help="the first K of the 308 keypoints (finetune.labels: 17 COCO, 25 body, 65 with hands, 308 all)",
    )
    p.add_argument(
        "--max-yaw", type=float, default=None,
        help="largest |yaw| of the view in radians (default: any direction; 1.2 keeps the face in view)",
    )  # fmt: skip
    p.add_argument("--unlabelled", action="store_true", help="write --n JPEG renders as a WebDataset image pool")
    p.add_argument(
        "--junk", type=float, default=0.0,
        help="with --unlabelled: this fraction of the pool is what a web pool carries besides human-centric photos "
        "(frames with no person, near-duplicates, text overlays, images under 384 px), in equal parts (default 0)",
    )  # fmt: skip
    p.add_argument(
        "--seed", type=int, default=0, help="sample i of a split depends on (seed, split, i) only (default 0)"
    )
    p.add_argument(
        "--rows-per-shard",
        type=int,
        default=256,
        help="samples per Parquet shard, or per tar with --unlabelled (default 256)",
    )
    p.add_argument(
        "--row-group-size", type=int, default=64, help="rows per Parquet row group, the shuffle unit (default 64)"
    )
    p.add_argument("--workers", type=int, default=1, help="rendering processes (default 1)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def render_rows(cfg_json: dict, seed: int, split: str, lo: int, hi: int) -> list[dict]:
    cfg = RenderConfig.model_validate(cfg_json)
    rows = []
    for i in range(lo, hi):
        r = render(cfg, np.random.default_rng([seed, SPLITS[split], i]))
        rows.append(
            encode_row(
                r.image,
                source=f"synthetic:{seed}:{split}:{i}",
                mask=r.mask,
                parts=r.parts,
                pointmap=r.points,
                normal=r.normals,
                albedo=r.albedo,
                keypoints=r.keypoints,
                visibility=r.visibility,
                area=float(r.mask.sum()),
                camera=r.camera,
            )
        )
    return rows


# What a web pool carries besides human-centric photos (``--junk``): frames with no person, near-duplicates of
# another image (re-encoded), a person under a text overlay, and images too small to keep (the 384-px rule).
JUNK_KINDS = ("no_person", "duplicate", "text", "tiny")
JUNK_TEXT = ("SALE 50% OFF", "CLICK HERE", "www.example.com", "BEST PRICE", "Subscribe now", "LIMITED OFFER")


def pool_image(cfg: RenderConfig, seed: int, i: int, junk: float) -> tuple[np.ndarray, int, str | None]:
    """Pool sample ``i``: its pixels, its JPEG quality and its junk kind (None: a clean render), a pure function of
    (seed, i, junk); its junk draw has its own stream, so the clean samples of a pool with junk are the renders of
    the pool without."""
    draw = np.random.default_rng([seed, SPLITS["pool"], i, 1])
    kind = JUNK_KINDS[draw.integers(len(JUNK_KINDS))] if draw.uniform() < junk else None
    rng = np.random.default_rng([seed, SPLITS["pool"], i])
    if kind == "no_person":
        return (background(rng, cfg.height, cfg.width) * 255).round().astype(np.uint8), POOL_JPEG_QUALITY, kind
    if kind == "duplicate" and i > 0:  # an earlier sample of the pool, at another JPEG quality
        rng = np.random.default_rng([seed, SPLITS["pool"], int(draw.integers(i))])
        return render(cfg, rng).image, 70, kind
    if kind == "tiny":
        small = cfg.model_copy(update={"height": cfg.height // 4, "width": cfg.width // 4})
        return render(small, rng).image, POOL_JPEG_QUALITY, kind
    image = render(cfg, rng).image
    if kind == "text":
        picture = Image.fromarray(image)
        pen = ImageDraw.Draw(picture)
        font = ImageFont.load_default(size=max(12, cfg.height // 12))
        for k in range(int(draw.integers(3, 6))):
            y = int(cfg.height * (0.1 + 0.8 * k / 5))
            pen.text((int(cfg.width * 0.05), y), JUNK_TEXT[int(draw.integers(len(JUNK_TEXT)))], font=font,
                     fill=(255, 255, 255), stroke_width=2, stroke_fill=(0, 0, 0))  # fmt: skip
        image = np.asarray(picture)
    return image, POOL_JPEG_QUALITY, kind if kind != "duplicate" else None  # sample 0 has nothing to duplicate


def render_jpegs(cfg_json: dict, seed: int, lo: int, hi: int, junk: float = 0.0) -> list[tuple[str, bytes]]:
    cfg = RenderConfig.model_validate(cfg_json)
    out = []
    for i in range(lo, hi):
        image, quality, _ = pool_image(cfg, seed, i, junk)
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, "JPEG", quality=quality)
        out.append((f"render-{seed}-{i:08d}.jpg", buf.getvalue()))
    return out


def write_pool(out: str, n: int, cfg: RenderConfig, seed: int, args: argparse.Namespace, pool) -> int:
    """``n`` unlabelled renders as tar shards of ``--rows-per-shard`` JPEGs; returns the number of shards."""
    fs, root = storage.resolve(out)
    ranges = [(lo, min(n, lo + args.rows_per_shard)) for lo in range(0, n, args.rows_per_shard)]
    jobs = [(cfg.model_dump(mode="json"), seed, lo, hi, args.junk) for lo, hi in ranges]
    results = pool.map(render_jpegs, *zip(*jobs)) if pool else (render_jpegs(*j) for j in jobs)
    for k, members in enumerate(results):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for name, data in members:
                tar.addfile(
                    storage.fixed_tarinfo(name, len(data)), io.BytesIO(data)
                )  # the same command, the same bytes
        storage.write_bytes_atomic(fs, storage.join(root, f"pool-{k:05d}.tar"), buf.getvalue())
        print(f"[make_synthetic] pool-{k:05d}.tar: {len(members)} renders", flush=True)
    return len(ranges)


def write_split(
    out: str,
    split: str,
    n: int,
    cfg: RenderConfig,
    seed: int,
    args: argparse.Namespace,
    pool: ProcessPoolExecutor | None,
) -> list[dict]:
    fs, root = storage.resolve(out)
    folder = storage.join(root, split)
    points = keypoints(cfg.num_keypoints)
    extra = {
        "parts": list(PARTS),
        "keypoint_names": [k.name for k in points],
        "keypoint_sigmas": [k.sigma for k in points],
        "keypoint_groups": [k.group for k in points],
        "image_size": [cfg.height, cfg.width],
        "renderer": cfg.model_dump(mode="json"),
        "seed": seed,
        "split": split,
    }
    table_schema = schema.with_metadata(
        schema.labelled_schema(), table=schema.LABELLED_TABLE, config_hash=hash_json(extra), extra=extra
    )
    ranges = [(lo, min(n, lo + args.rows_per_shard)) for lo in range(0, n, args.rows_per_shard)]
    jobs = [(cfg.model_dump(mode="json"), seed, split, lo, hi) for lo, hi in ranges]
    results = pool.map(render_rows, *zip(*jobs)) if pool else (render_rows(*j) for j in jobs)
    shards: list[dict] = []
    for k, rows in enumerate(results):
        name = f"part-{k:05d}.parquet"
        table = pa.Table.from_pylist(rows, schema=table_schema)
        digest = storage.write_parquet_atomic(fs, storage.join(folder, name), table, row_group_size=args.row_group_size)
        shards.append({"file": name, "rows": len(rows), "sha256": digest})
        print(f"[make_synthetic] {split}/{name}: {len(rows)} rows", flush=True)
    # A rerun with fewer samples leaves no stale parts behind.
    keep = {s["file"] for s in shards}
    if storage.exists(fs, folder):
        for info in fs.get_file_info(pafs.FileSelector(folder)):
            if info.base_name.startswith("part-") and info.base_name not in keep:
                fs.delete_file(info.path)
    manifest = {
        "table": schema.LABELLED_TABLE,
        "schema_version": schema.SCHEMA_VERSION,
        "shards": shards,
        "rows": n,
        "sha256": sha256("".join(s["sha256"] for s in shards).encode()).hexdigest(),
        **extra,
    }
    storage.write_json_atomic(fs, storage.join(folder, "manifest.json"), manifest)
    return shards


def main(argv: list[str] | None = None) -> int:
    configure_console()
    args = parse_args(argv)
    n_val = args.val if args.val is not None else max(8, args.n // 5)
    try:
        if args.n < 1 or n_val < 1 or args.test < 0:
            raise ValueError("--n and --val must be at least 1, --test at least 0")
        if not 0 <= args.junk <= 1 or (args.junk and not args.unlabelled):
            raise ValueError("--junk is a fraction from 0 to 1 of an --unlabelled pool")
        if args.rows_per_shard < 1 or args.row_group_size < 1:
            raise ValueError("--rows-per-shard and --row-group-size must be at least 1")
        shape = {"yaw": args.max_yaw} if args.max_yaw is not None else {}
        # A pool carries no labels: skip the landmark visibility work.
        keypoints = len(COCO_KEYPOINTS) if args.unlabelled else args.keypoints
        cfg = RenderConfig(height=args.height, width=args.width, num_keypoints=keypoints, **shape)
        storage.resolve(args.out)
    except (ValueError, storage.StorageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    written = f"what is written is in {storage.redact(args.out)}"
    return exit_code_interruptible("make_synthetic", lambda: _write(args, cfg, n_val), lambda: written,
                                   rerun="rerun the same command to write it again")  # fmt: skip


def _write(args: argparse.Namespace, cfg: RenderConfig, n_val: int) -> int:
    pool = ProcessPoolExecutor(args.workers) if args.workers > 1 else None
    try:
        if args.unlabelled:
            shards = write_pool(args.out, args.n, cfg, args.seed, args, pool)
            print(f"[make_synthetic] {args.n} unlabelled renders at {cfg.height}x{cfg.width} in {shards} shards "
                  f"in {storage.redact(args.out)}")  # fmt: skip
            return 0
        for split, n in (("train", args.n), ("val", n_val), ("test", args.test)):
            if n:
                write_split(args.out, split, n, cfg, args.seed, args, pool)
    finally:
        if pool:
            pool.shutdown()
    test = f" + {args.test} test" if args.test else ""
    print(f"[make_synthetic] {args.n} train + {n_val} val{test} samples at {cfg.height}x{cfg.width} in "
          f"{storage.redact(args.out)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
