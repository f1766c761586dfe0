"""Other thresholds on stored scores against scoring the pool again: wall time side by side, and the inputs each
direction leaves needing model work.

    python benchmarks/bench_what_if.py [--sizes 60,2000] [--work out/bench_what_if]

For each size: the sample pool of that many inputs (``jobs.make_sample_pool --n``) curated with the lite profile
(every phase: what ``--new-run`` with other thresholds costs), then ``--what-if`` of a tightened and a relaxed
``filters.min_quality`` and ``filters.min_short_side`` (no model: each input walked from its stored scores; the
relaxed one counts the inputs that would need model work), then, in place, one after another (the same command with
them: every shard re-decided, the global phases run again): the tightened thresholds (no model call), the first ones
back (a relaxation within what was scored), the relaxed ones (the inputs they take further read from the pool and
run through the stages they need, counted per stage) and a tighter person rule (every input that reached the person
stage runs from it again); last, ``--new-run`` at the relaxed thresholds into a new output, every model call made.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import timed
from jobs import curate, make_sample_pool

REPO = Path(__file__).resolve().parents[1]
CHANGES = {
    "tighten": ["filters.min_quality=0.6", "filters.min_short_side=448"],
    "relax": ["filters.min_quality=0.25", "filters.min_short_side=160"],
}
# Applied in place one after another: each re-decides the output from the thresholds the one before left.
APPLIED = {
    "tightened": CHANGES["tighten"],
    "back to the first": [],
    "relaxed (model work for the inputs it takes further)": CHANGES["relax"],
    "person rule tightened (the person stage and after rerun)": [
        *CHANGES["relax"],
        "filters.person_min_height_frac=0.75",
        "filters.person_min_area_frac=0.4",
    ],
}


def _quiet(fn, *args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = fn(*args)
    if code != 0:
        raise SystemExit(f"{fn.__module__} exited {code}:\n{out.getvalue()[-2000:]}")
    return out.getvalue()


def stage_calls(out: Path) -> str:
    """The inputs each stage of the lite profile ran on in the output's phase 1, counted from its ledger: an input
    runs every stage up to the one that stopped it (a kept one, all of them)."""
    import pyarrow.parquet as pq

    from common.config import load_config
    from curation.config import CurateConfig
    from curation.score.ledger import committed_files

    stages = load_config(CurateConfig, REPO / "configs/curate/lite.yaml").enabled_stages
    place = {stage: i for i, stage in enumerate(stages)}
    stopped = Counter()
    for f in committed_files(str(out), "ledger"):
        stopped.update(
            place[s] for s in pq.read_table(out / f, columns=["stage"]).column("stage").to_pylist() if s in place
        )
    runs = [f"{stage} on {sum(n for i, n in stopped.items() if i >= k)}" for k, stage in enumerate(stages)]
    return "stages run on " + ", ".join(runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="60,2000")
    p.add_argument("--work", default="out/bench_what_if")
    args = p.parse_args(argv)
    work = Path(args.work)
    for n in [int(s) for s in args.sizes.split(",")]:
        pool, out = work / f"pool_{n}", work / f"curated_{n}"
        shutil.rmtree(out, ignore_errors=True)
        if not (pool / "_manifest.jsonl").exists():
            _quiet(make_sample_pool.main, ["--out", str(pool), "--n", str(n)])
        run = ["--config", str(REPO / "configs/curate/lite.yaml"), "--input", str(pool), "--output", str(out)]
        full_s, _ = timed(lambda: _quiet(curate.main, run))  # noqa: B023
        print(f"{n} inputs: a full run (every model call) {full_s:.1f} s")
        for name, changes in CHANGES.items():
            what_if = [a for change in changes for a in ("--what-if", change)]
            seconds, text = timed(lambda: _quiet(curate.main, [*run, "--phases", "score", *what_if]))  # noqa: B023
            lines = [line.removeprefix("[what-if] ") for line in text.splitlines() if line.startswith("[what-if]")]
            kept = next(line for line in lines if line.startswith("kept"))
            work_line = next(line for line in lines if line.startswith("need model work"))
            print(f"  {name}: what-if {seconds:.2f} s ({full_s / seconds:.0f}x less than a run); {kept}; {work_line}")
        for name, changes in APPLIED.items():
            seconds, text = timed(lambda: _quiet(curate.main, [*run, *changes]))  # noqa: B023
            said = [line for line in text.splitlines() if line.startswith(("[score] done", "[re-decide] done"))]
            print(f"  applied in place, {name}: {seconds:.1f} s ({full_s / seconds:.1f}x less than a run)")
            print("".join(f"    {line}\n" for line in said), end="")
        fresh = ["--output", str(work / f"fresh_{n}"), "--new-run"]
        seconds, _ = timed(lambda: _quiet(curate.main, [*run[:-2], *fresh, *CHANGES["relax"]]))  # noqa: B023
        print(f"  --new-run at the relaxed thresholds: {seconds:.1f} s; {stage_calls(work / f'fresh_{n}')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
