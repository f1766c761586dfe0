"""What the pretraining's decode path costs per image on one CPU core, and how many cores keep one GPU fed.

    python benchmarks/bench_decode_path.py [--sides 1280 1536 2048 3072] [--repeats 5]

The pretraining stream decodes every curated image in Ray Data tasks (``pretrain.data.decode_crop``: reduced-size
JPEG decode, the person-centred crop of the model's aspect, an antialiased resize to 1024x768). Side by side, on
the package photos re-encoded at web sizes, one thread each: that path, the same without the reduced-size decode
(full decode, then crop and resize), and torchvision's libjpeg-turbo decode (``torchvision.io.decode_jpeg``, the
API whose ``device="cuda"`` form is the GPU decode) with a tensor resize. Then the cores per GPU the project's path
needs at the step rates of the 0.4B config (global batch 16 per GPU): the one measured on an H200 (compiled, 0.760 s
a step, benchmarks/RESULTS.md) and the one at the 45% MFU goal.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu.curation_throughput import web_sized_photos
from benchmarks.timing import timed

OUT_HW = (1024, 768)
BATCH = 16
MEASURED_STEP_S = 0.760  # 0.4B, compiled, 31.3% MFU on one H200 (benchmarks/RESULTS.md)
STEP_RATES = {"H200 measured (31.3% MFU)": BATCH / MEASURED_STEP_S, "45% MFU goal": BATCH / MEASURED_STEP_S * 45 / 31.3}


def rows(sides: tuple[int, ...]) -> dict[int, list[dict]]:
    """Curated-shard rows (bytes, stored size, no person boxes: the crop centres on the image) per long side."""
    from PIL import Image

    out: dict[int, list[dict]] = {}
    for side in sides:
        out[side] = []
        for data in web_sized_photos(None, (side,)):
            w, h = Image.open(io.BytesIO(data)).size
            out[side].append({"image": {"bytes": data}, "width": w, "height": h, "persons": None})
    return out


def full_decode_crop(row: dict):
    """The project's crop and resize after a full-size decode: what the reduced-size decode saves."""
    import numpy as np
    from PIL import Image

    from pretrain.data import aspect_crop

    img = Image.open(io.BytesIO(row["image"]["bytes"])).convert("RGB")
    box = aspect_crop(img.width, img.height, OUT_HW, (img.width / 2, img.height / 2))
    return np.asarray(img.resize((OUT_HW[1], OUT_HW[0]), Image.Resampling.BILINEAR, box=box))


def torchvision_decode_crop(row: dict):
    """libjpeg-turbo through torchvision, the crop, then an antialiased tensor resize."""
    import warnings

    import torch
    import torch.nn.functional as F
    from torchvision.io import decode_jpeg

    from pretrain.data import aspect_crop

    with warnings.catch_warnings():  # deprecated since torchvision 0.29 for TorchCodec, not installed here
        warnings.simplefilter("ignore", DeprecationWarning)
        img = decode_jpeg(torch.frombuffer(bytearray(row["image"]["bytes"]), dtype=torch.uint8))
    h, w = img.shape[-2:]
    x0, y0, x1, y1 = (round(v) for v in aspect_crop(w, h, OUT_HW, (w / 2, h / 2)))
    crop = img[None, :, y0:y1, x0:x1].float()
    return F.interpolate(crop, size=OUT_HW, mode="bilinear", antialias=True).round().clamp(0, 255).byte()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sides", type=int, nargs="+", default=[1280, 1536, 2048, 3072])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    import torch

    from pretrain.data import decode_crop

    torch.set_num_threads(1)  # one core per decode task, as the stream's tasks run
    paths = {
        "project (reduced decode)": lambda row: decode_crop(row, OUT_HW),
        "full decode": full_decode_crop,
        "torchvision decode_jpeg": torchvision_decode_crop,
    }
    by_side = rows(tuple(args.sides))
    ms: dict[str, dict[int, float]] = {name: {} for name in paths}
    for side, side_rows in by_side.items():
        per_row: dict[str, list[float]] = {name: [] for name in paths}
        for row in side_rows:  # side by side, per photo: the machine's drift touches every path alike
            for name, fn in paths.items():
                per_row[name].append(timed(lambda fn=fn, row=row: fn(row), repeats=args.repeats, warmup=1)[0])
        for name in paths:
            ms[name][side] = 1000 * statistics.mean(per_row[name])
    print(f"ms per image to {OUT_HW[0]}x{OUT_HW[1]}, one thread, {len(by_side[args.sides[0]])} photos per size")
    print(f"{'long side':>10}  " + "  ".join(f"{n:>24}" for n in paths) + "  reduced vs full  vs torchvision")
    for side in args.sides:
        p, f, t = (ms[n][side] for n in paths)
        print(f"{side:>10}  {p:>24.1f}  {f:>24.1f}  {t:>24.1f}  {f / p:>14.2f}x  {t / p:>13.2f}x")
    mean_ms = statistics.mean(ms["project (reduced decode)"].values())
    per_core = 1000 / mean_ms
    print(f"\nproject path over these sizes: {mean_ms:.1f} ms/image, {per_core:.0f} images/s per core")
    for name, need in STEP_RATES.items():
        print(f"  {name}: {need:.1f} images/s per GPU -> {need / per_core:.2f} cores of decode per GPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
