"""The lite profile's person and head-pose stages against a baseline source tree, side by side in one run on the same
images.

    python benchmarks/bench_lite_people.py --baseline /path/to/older/checkout [--n 60]

The baseline is any checkout of this repository (for instance a worktree of the commit before the lite models
changed); its own ``curation`` package and ``configs/curate/lite.yaml`` run in a subprocess on the same files:

(a) the person filter on the labelled check of shipped photos (``generators/labelled_photos.py``): precision and
    recall of "at least one prominent person", and the person stage's images per second (one core, in process);
(b) head pose on the people of that check: the head-pose stage's images per second, and on each photo and its
    mirror image whether the main person's yaw class mirrors (frontal stays frontal, left and right profile swap)
    and, where the stage gives degrees, whether the yaw's sign flips;
(c) where the stage gives degrees: the yaw of every prominent person against the full profile's head-pose fit
    (``curation.stages.yolo.estimate_head_pose``) run on the same person's nose, eye and ear keypoints (the lite
    keypoints: the full profile's YOLO pose weights are not in a package);
(d) lite scoring end to end on the sample pool (``jobs.make_sample_pool``, default size): every lite stage in one
    process, batch by batch (``curation.score.chain.score_in_process``), images per second, and how many inputs end
    otherwise than the pool's manifest expects; with ``--ray`` also phase 1 on a local Ray: images per second, and
    when the first shard committed (the actors' start-up, the same at any pool size).

Both sides run one after the other at the same priority; the machine may be shared, so compare the ratios. With
``--concurrent`` the in-process measurements of both trees run at the same time, each pinned to a core of its own:
on a machine whose speed drifts between minutes both are slowed alike. Each tree's runtimes are printed with its
figures (the networks' ``auto`` runtime is timed per node: ``curation/models/runtimes.py``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIRROR = {
    "frontal": "frontal",
    "left_profile": "right_profile",
    "right_profile": "left_profile",
    "not_visible": "not_visible",
}


# -- the side that runs in each tree -------------------------------------------------------------------------------


def _rows(folder: Path) -> tuple[list[dict], list[dict]]:
    from PIL import Image

    labels = json.loads((folder / "labels.json").read_text())
    rows = []
    for item in labels:
        data = (folder / item["file"]).read_bytes()
        w, h = Image.open(io.BytesIO(data)).size
        rows.append({"image": {"bytes": data, "path": item["file"]}, "width": w, "height": h})
    return labels, rows


def _timed_batches(stage, rows: list[dict], size: int) -> tuple[float, list[dict]]:
    out: list[dict] = []
    start = time.perf_counter()
    for i in range(0, len(rows), size):
        out += stage.process_batch(rows[i : i + size])
    return time.perf_counter() - start, out


def _module(name: str):
    """A module of the tree being measured, by its name in this tree or in a baseline before ``curation/`` had
    sub-packages (``curation.score.phase`` was ``curation.score``, ``curation.score.stage`` ``curation.stage``)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        older = "curation.score" if name == "curation.score.phase" else name.replace("curation.score.", "curation.")
        return importlib.import_module(older)


def _chain():
    """The score chain's processes: ``curation.score.chain``, or the phase module of a baseline that held them."""
    import importlib

    try:
        return importlib.import_module("curation.score.chain")
    except ImportError:
        return _module("curation.score.phase")


def _runner(stage_name: str, cfg):
    """A set-up stage runner, in this tree or in a baseline that builds runners from the config's JSON."""
    chain = _chain()
    if hasattr(chain, "stage_runner"):
        return chain.stage_runner(stage_name, cfg)
    return _module("curation.score.stage").StageRunner(stage_name, cfg.model_dump_json())


def scoring_in_process(cfg, pool: Path) -> dict:
    """Phase 1 in this process, batch by batch, as ``curation.score.chain.score_in_process`` runs it, with the CPU time
    of each stage (its native threads included) and the rows it saw still pending."""
    import pyarrow as pa

    chain = _chain()
    finalise, _shard_reader = chain.finalise, chain._shard_reader

    runners = [(name, _runner(name, cfg), cfg.stages[name].batch_size) for name in cfg.enabled_stages]
    reader = _shard_reader(cfg, str(pool))
    cpu = dict.fromkeys(cfg.enabled_stages, 0.0)
    seen = dict.fromkeys(cfg.enabled_stages, 0)
    tables = []
    start = time.perf_counter()
    for shard in _shards(pool, cfg):
        table = reader.read_table(shard)
        for name, runner, size in runners:
            seen[name] += table.column("status").to_pylist().count("pending")
            t0 = time.process_time()
            table = pa.concat_tables([runner(table.slice(i, size)) for i in range(0, table.num_rows, size)])
            cpu[name] += time.process_time() - t0
        tables.append(finalise(table))
    wall = time.perf_counter() - start
    rows = pa.concat_tables(tables).select(["source", "status", "stage", "reason"]).to_pylist()
    runtimes = {name: _runtime(runner.stage) for name, runner, _ in runners}
    return {
        "e2e_s": wall,
        "e2e_rows": rows,
        "stage_cpu_s": cpu,
        "stage_rows": seen,
        "runtimes": {name: r for name, r in runtimes.items() if r},
    }


def _runtime(stage) -> str | None:
    """What runs a stage's network, where the tree says (``runtime`` of the stage or of its network)."""
    return getattr(stage, "runtime", None) or getattr(getattr(stage, "network", None), "runtime", None)


def _pool(pool: Path):
    """The pool as the tree's phase 1 takes it: resolved once (a ``Pool``), or, in trees before it, its URI."""
    pools = _module("curation.score.pool")
    return pools.Pool.at(str(pool)) if hasattr(pools, "Pool") else str(pool)


def _shards(pool: Path, cfg) -> list:
    return _module("curation.score.pool").list_shards(_pool(pool), cfg.input)


def ray_scoring(cfg, pool: Path) -> dict:
    """Phase 1 on a local Ray with 2 CPUs, as a curation job runs it (the lite config's actor pools)."""
    from common.ray_utils import init_ray

    phase = _module("curation.score.phase")
    ScorePhase = phase.ScorePhase

    init_ray(num_cpus=2)
    out = pool.parent / f"scored-{os.getpid()}"
    if hasattr(phase, "claim_output"):  # a tree before the output was resolved once and handed down
        claim_output, output = phase.claim_output, str(out)
    else:
        resolved = _module("curation.steps.output")
        claim_output, output = resolved.claim_output, resolved.Output.at(str(out))
    claim_output(output, cfg.results_hash(), str(pool), new_run=True)
    shards = _shards(pool, cfg)
    # when each shard commits: the first waits for the actors to start (the same cost at any pool size)
    commits: list[float] = []
    commit = ScorePhase._commit

    def timed_commit(self, shard_id: str, receipts: list[dict]):
        commits.append(time.perf_counter() - start)
        return commit(self, shard_id, receipts)

    ScorePhase._commit = timed_commit
    start = time.perf_counter()
    ScorePhase(cfg, output, _pool(pool)).run(shards)
    return {"ray_s": time.perf_counter() - start, "ray_commits": commits}


def worker(images: Path, pool: Path | None, mode: str = "process") -> dict:
    """Measure the tree whose ``curation`` package is importable here (``mode``: see ``_start_tree``)."""
    from common.config import load_config
    from curation.config import CurateConfig

    REJECT = _module("curation.score.stage").REJECT

    root = Path(sys.modules["curation"].__file__).resolve().parents[1]
    cfg = load_config(CurateConfig, root / "configs" / "curate" / "lite.yaml", [])
    if mode == "ray":
        return ray_scoring(cfg, pool)
    person, head = _runner("person", cfg).stage, _runner("head_pose", cfg).stage
    labels, rows = _rows(images)
    person.process_batch(rows[:1])  # warm up outside the clock
    person_s, updates = _timed_batches(person, rows, cfg.stages["person"].batch_size)
    kept = [i for i, u in enumerate(updates) if REJECT not in u]
    head_rows = [{**rows[i], **updates[i]} for i in kept]
    head_s, head_updates = _timed_batches(head, head_rows, cfg.stages["head_pose"].batch_size)
    heads = {labels[i]["name"]: h["persons"][0] for i, h in zip(kept, head_updates)}
    result = {
        "tree": str(root),
        "names": [item["name"] for item in labels],
        "said": [REJECT not in u for u in updates],
        "person_s": person_s,
        "head_s": head_s,
        "head_n": len(head_rows),
        "heads": {
            n: {k: p.get(k) for k in ("head_yaw_class", "head_yaw", "head_pitch", "head_roll")}
            for n, p in heads.items()
        },
        # prominent persons with degrees and keypoints: (photo, yaw, their 17 COCO keypoints)
        "yaws": [
            (labels[i]["name"], p["head_yaw"], p["keypoints"])
            for i, h in zip(kept, head_updates)
            for p in h["persons"]
            if p["prominent"] and p.get("head_yaw") is not None and p.get("keypoints")
        ],
    }
    if pool is not None:
        result |= scoring_in_process(cfg, pool)
        if mode == "all":
            result |= ray_scoring(cfg, pool)
    return result


# -- the driver ----------------------------------------------------------------------------------------------------


def _write_images(folder: Path) -> list[dict]:
    from PIL import Image

    from generators.labelled_photos import person_check

    labels = []
    for p in person_check():
        file = f"{p.name}.jpg"
        Image.fromarray(p.rgb).save(folder / file, "JPEG", quality=95)
        labels.append({"name": p.name, "file": file, "person": p.person, "kind": p.kind})
    (folder / "labels.json").write_text(json.dumps(labels))
    return labels


_LARGE_FOLDERS = ("people", "no_person", "text", "low_quality")  # photos; the tiny, bad and odd inputs stay as made


def _enlarge_photos(pool: Path, side: int) -> int:
    """Re-encode the pool's photos at ``side`` px on their long side (4000: 12 MP at 4:3), as phone and camera photos
    on the web are: decoding then costs as much as the networks, which the sample pool's small photos hide."""
    from PIL import Image

    count = 0
    for folder in _LARGE_FOLDERS:
        for path in sorted((pool / folder).glob("*")):
            with Image.open(path) as img:
                fmt, w, h = img.format, *img.size
                scale = side / max(w, h)
                big = img.convert("RGB").resize((round(w * scale), round(h * scale)), Image.Resampling.BICUBIC)
            big.save(path, fmt, **({"quality": 92} if fmt == "JPEG" else {}))
            count += 1
    return count


def _start_tree(tree: Path, images: Path, pool: Path | None, mode: str, core: int | None = None):
    """The worker of one tree in a subprocess: ``mode`` "all" (in process, then on Ray), "process" (in process only)
    or "ray" (on Ray only); ``core`` pins it to that CPU. Returns (process, its result file)."""
    out = images / f"result-{abs(hash(str(tree)))}-{mode}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--images", str(images), "--result", str(out)]
    if pool is not None:
        cmd += ["--pool", str(pool), "--mode", mode]
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    pin = None if core is None else (lambda: os.sched_setaffinity(0, {core}))
    return subprocess.Popen(cmd, cwd=tree, env=env, preexec_fn=pin), out


def _results(started: list[tuple[subprocess.Popen, Path]]) -> list[dict]:
    for process, _ in started:
        if process.wait() != 0:
            raise SystemExit(f"a benchmark worker failed (exit {process.returncode}): {process.args}")
    return [json.loads(out.read_text()) for _, out in started]


def _run_trees(trees: list[tuple[str, Path]], images: Path, pool: Path | None, with_ray: bool, concurrent: bool):
    """Each tree's results. One after the other; or, with ``concurrent``, the in-process parts of all trees at the
    same time, each pinned to a core of its own, so that a machine whose speed drifts from minute to minute slows
    both alike (the Ray runs, which need every core, then follow one after the other)."""
    if not concurrent:
        mode = "all" if with_ray else "process"
        return {name: _results([_start_tree(tree, images, pool, mode)])[0] for name, tree in trees}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < len(trees):
        raise SystemExit(f"--concurrent needs a core per tree: {len(trees)} trees, {len(cores)} cores")
    started = [_start_tree(tree, images, pool, "process", core) for (_, tree), core in zip(trees, cores)]
    results = dict(zip((name for name, _ in trees), _results(started)))
    if with_ray and pool is not None:
        for name, tree in trees:
            results[name] |= _results([_start_tree(tree, images, pool, "ray")])[0]
    return results


def _person_metrics(labels: list[dict], r: dict) -> dict:
    from generators.labelled_photos import precision_recall

    truth = [item["person"] for item in labels]
    precision, recall = precision_recall(truth, r["said"])
    wrong = [item["name"] for item, s in zip(labels, r["said"]) if s != item["person"]]
    return {"precision": precision, "recall": recall, "wrong": wrong, "img_s": len(labels) / r["person_s"]}


def _mirror_metrics(r: dict) -> dict:
    heads = r["heads"]
    pairs = [(n, n + "_mirrored") for n in heads if n + "_mirrored" in heads]
    classes = sum(MIRROR[heads[a]["head_yaw_class"]] == heads[b]["head_yaw_class"] for a, b in pairs)
    signed = [
        (heads[a]["head_yaw"], heads[b]["head_yaw"])
        for a, b in pairs
        if heads[a]["head_yaw"] is not None and heads[b]["head_yaw"] is not None
    ]
    signed = [(ya, yb) for ya, yb in signed if max(abs(ya), abs(yb)) >= 5]  # a sign only means something off zero
    flips = sum((ya > 0) != (yb > 0) for ya, yb in signed)
    gap = max((abs(ya + yb) for ya, yb in signed), default=None)
    return {
        "pairs": len(pairs),
        "class_ok": classes,
        "with_degrees": len(signed),
        "sign_flips": flips,
        "max_abs_yaw_sum": gap,
        "img_s": r["head_n"] / r["head_s"] if r["head_s"] else None,
    }


def _yaw_agreement(r: dict) -> dict | None:
    import numpy as np

    from curation.stages.yolo import estimate_head_pose

    if not r.get("yaws"):
        return None
    kp = np.array([k for _, _, k in r["yaws"]], np.float64).reshape(-1, 17, 3)
    fit = estimate_head_pose(kp[:, :5, :2], kp[:, :5, 2], min_conf=0.3)
    pairs = [(y, f) for (_, y, _), f, ok in zip(r["yaws"], fit.yaw, fit.valid) if ok]
    diffs = np.array([abs(y - f) for y, f in pairs])
    return {
        "n": len(pairs),
        "within_15": int((diffs <= 15).sum()),
        "median": float(np.median(diffs)) if len(diffs) else None,
    }


def _e2e_metrics(manifest: dict[str, dict], r: dict) -> dict:
    from common import schema

    kept = wrong = 0
    for row in r["e2e_rows"]:
        entry = manifest.get(Path(row["source"]).as_posix().split("/pool/", 1)[-1])
        survived = row["status"] == schema.KEPT
        kept += survived
        if entry is None:
            continue
        if entry["expect"] == "kept" and not survived:
            wrong += 1
        elif entry["expect"] == "rejected":
            stages = [entry["stage"]] if "stage" in entry else entry["stage_any"]
            wrong += survived or row["stage"] not in stages
        elif entry["expect"] == "any" and not survived and row["stage"] not in entry["stage_any"]:
            wrong += 1
    n = len(r["e2e_rows"])
    out = {
        "n": n,
        "kept": kept,
        "not_as_expected": wrong,
        "img_s": n / r["e2e_s"],
        "cpu_per_input": sum(r["stage_cpu_s"].values()) / n,
        "stage_cpu_s": r["stage_cpu_s"],
        "stage_rows": r["stage_rows"],
        "runtimes": r.get("runtimes", {}),
    }
    if "ray_s" in r:
        out["ray_img_s"] = n / r["ray_s"]
        out["ray_first_commit_s"] = min(r["ray_commits"], default=None)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, help="a checkout of this repository to compare against")
    ap.add_argument("--n", type=int, default=None, help="sample pool size for (d) (default: the pool's default)")
    ap.add_argument("--no-e2e", action="store_true", help="skip (d)")
    ap.add_argument("--ray", action="store_true", help="(d) also on a local Ray with 2 CPUs, as a job runs it")
    ap.add_argument("--large", type=int, default=None, metavar="SIDE",
                    help="(d) on the pool's photos re-encoded at SIDE px on the long side (4000: 12 MP)")  # fmt: skip
    ap.add_argument("--concurrent", action="store_true",
                    help="run the trees' in-process measurements at the same time, one core each")  # fmt: skip
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("all", "process", "ray"), default="process", help=argparse.SUPPRESS)
    ap.add_argument("--images", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--pool", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        args.result.write_text(json.dumps(worker(args.images, args.pool, args.mode)))
        return 0

    with tempfile.TemporaryDirectory(prefix="bench-lite-people-") as tmp:
        images = Path(tmp) / "images"
        images.mkdir()
        labels = _write_images(images)
        pool = None
        manifest: dict[str, dict] = {}
        if not args.no_e2e:
            from jobs import make_sample_pool

            pool = Path(tmp) / "pool"
            make_sample_pool.main(["--out", str(pool), "--seed", "0", *(["--n", str(args.n)] if args.n else [])])
            manifest = {e["path"]: e for e in map(json.loads, (pool / "_manifest.jsonl").read_text().splitlines())}
            if args.large:
                print(f"re-encoded {_enlarge_photos(pool, args.large)} photos of the pool at {args.large} px")
        trees = [("new", REPO)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
        results = _run_trees(trees, images, pool, args.ray, args.concurrent)

    from curation.models.runtimes import cpu_model  # the driver only: a worker imports from the tree it measures

    print(
        f"{time.strftime('%Y-%m-%d')}, {cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.1f}; {len(labels)} labelled photos "
        f"({sum(x['person'] for x in labels)} with a prominent person)"
    )
    rows = []
    metrics = {}
    for name, r in results.items():
        metrics[name] = {"person": _person_metrics(labels, r), "head": _mirror_metrics(r), "yaw": _yaw_agreement(r)}
        if pool is not None:
            metrics[name]["e2e"] = _e2e_metrics(manifest, r)
    for name, m in metrics.items():
        p, h = m["person"], m["head"]
        line = (
            f"{name:9s} person: {p['img_s']:.2f} img/s, precision {p['precision']:.3f}, recall {p['recall']:.3f}"
            f" (wrong: {', '.join(p['wrong']) or 'none'}); head pose: {h['img_s'] or 0:.2f} img/s, yaw class "
            f"mirrors on {h['class_ok']}/{h['pairs']} pairs"
        )
        if h["with_degrees"]:
            line += (
                f", yaw sign flips on {h['sign_flips']}/{h['with_degrees']}"
                f" (max |yaw + mirrored yaw| {h['max_abs_yaw_sum']:.1f} deg)"
            )
        if m["yaw"]:
            y = m["yaw"]
            line += (
                f"; yaw within 15 deg of the full profile's fit on the same face keypoints for {y['within_15']}/{y['n']}"
                f" prominent persons (median difference {y['median']:.1f} deg)"
            )
        if "e2e" in m:
            e = m["e2e"]
            line += (
                f"; end to end: {e['img_s']:.2f} img/s in one process ({e['kept']} of {e['n']} kept,"
                f" {e['not_as_expected']} not as the manifest expects)"
            )
            if "ray_img_s" in e:
                line += f", {e['ray_img_s']:.2f} img/s on a local Ray with 2 CPUs"
                if e["ray_first_commit_s"] is not None:
                    line += f" (the first shard committed at {e['ray_first_commit_s']:.1f} s)"
            if e["runtimes"]:
                line += "; runtimes " + ", ".join(f"{k} {v}" for k, v in e["runtimes"].items())
            line += (
                f"; CPU per input {e['cpu_per_input']:.3f} s ("
                + ", ".join(f"{k} {v / max(e['stage_rows'][k], 1):.3f}" for k, v in e["stage_cpu_s"].items())
                + " s per image it saw)"
            )
        rows.append(line)
    print("\n".join(rows))
    if "baseline" in metrics:
        new, old = metrics["new"], metrics["baseline"]
        ratios = [f"person stage {new['person']['img_s'] / old['person']['img_s']:.2f}x img/s"]
        if new["head"]["img_s"] and old["head"]["img_s"]:
            ratios.append(f"head pose {new['head']['img_s'] / old['head']['img_s']:.2f}x img/s")
        if "e2e" in new:
            ratios.append(f"end to end {new['e2e']['img_s'] / old['e2e']['img_s']:.2f}x img/s")
            ratios.append(f"CPU per input {old['e2e']['cpu_per_input'] / new['e2e']['cpu_per_input']:.2f}x less")
            if "ray_img_s" in new["e2e"]:
                ratios.append(f"end to end on Ray {new['e2e']['ray_img_s'] / old['e2e']['ray_img_s']:.2f}x img/s")
        ratios.append(
            f"precision {old['person']['precision']:.3f} -> {new['person']['precision']:.3f}, "
            f"recall {old['person']['recall']:.3f} -> {new['person']['recall']:.3f}"
        )
        print("new vs baseline: " + "; ".join(ratios))
        if "e2e_rows" in results["new"]:
            fates = {name: {r["source"]: (r["status"], r["stage"], r["reason"]) for r in results[name]["e2e_rows"]}
                     for name in ("new", "baseline")}  # fmt: skip
            differ = sorted(k for k in fates["new"].keys() | fates["baseline"].keys()
                            if fates["new"].get(k) != fates["baseline"].get(k))  # fmt: skip
            print(f"ledger rows that differ from the baseline's: {len(differ)} of {len(fates['new'])}"
                  + (f" ({', '.join(differ[:8])})" if differ else ""))  # fmt: skip
    for name, r in results.items():
        print(
            f"{name} heads: "
            + ", ".join(
                f"{n}={h['head_yaw_class']}" + (f"({h['head_yaw']:.0f})" if h["head_yaw"] is not None else "")
                for n, h in r["heads"].items()
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
