"""The sample phase alone at pool scale: its tasks' longest wall time and largest peak RSS, and the driver's peak RSS,
as the number of survivors grows.

    python benchmarks/bench_sample_tasks.py --sizes 1000000,4000000 --work /tmp/bench-sample --keep
    python benchmarks/bench_sample_tasks.py --sizes 1000000 --work /tmp/bench-sample --trees . /tmp/other-checkout
    python benchmarks/bench_sample_tasks.py --sizes 1000000,4000000 sample.max_fanout=64 --trees .   # overrides first

For each size N, ``bench_scale``'s synthesised scored output of N survivors (reused when ``--work`` holds it) and its
dedup phase (run once); then the sample phase of each tree in ``--trees`` in turn, each in a fresh process on a
local Ray (``--cpus``) on the same dedup output, its previous sample outputs cleared. A sampler thread there polls
every worker of its own Ray every 50 ms: a worker runs one task at a time under the title ``ray::<task>``, so its RSS
while a title holds is that task's (with what the worker kept from its earlier tasks); each task's wall time is its
span in Ray's timeline. Printed per size and tree:
the phase's wall time, the driver's peak RSS, and per task name the tasks seen, the longest and the largest RSS.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


class TaskSampler(threading.Thread):
    """Per Ray task name: tasks seen, longest span and largest worker RSS; and this process's peak RSS."""

    def __init__(self, every_s: float = 0.05):
        super().__init__(daemon=True)
        import psutil

        self.psutil, self.every_s, self.me = psutil, every_s, psutil.Process()
        self.driver_rss = 0
        self.tasks: dict[str, dict] = {}
        self.running: dict[int, tuple[str, float]] = {}  # pid -> (task, start)
        self.lock = threading.Lock()

    def _close(self, pid: int, now: float) -> None:
        name, start = self.running.pop(pid)
        t = self.tasks[name]
        t["count"] += 1
        t["max_s"] = max(t["max_s"], now - start)

    def poll(self) -> None:
        now, seen = time.monotonic(), set()
        for p in self.me.children(recursive=True):  # this Ray's workers only (the machine may run others)
            try:
                cmd, mem = p.cmdline(), p.memory_info()
            except self.psutil.Error:
                continue
            if not cmd or not cmd[0].startswith("ray::") or not cmd[0].split()[0].endswith("_task"):
                continue
            name, pid = cmd[0].removeprefix("ray::").split()[0], p.pid
            seen.add(pid)
            if pid in self.running and self.running[pid][0] != name:
                self._close(pid, now)
            if pid not in self.running:
                self.running[pid] = (name, now)
            t = self.tasks.setdefault(name, {"count": 0, "max_s": 0.0, "max_rss": 0})
            t["max_rss"] = max(t["max_rss"], mem.rss)
        for pid in set(self.running) - seen:
            self._close(pid, now)
        self.driver_rss = max(self.driver_rss, self.me.memory_info().rss)

    def run(self) -> None:
        while True:
            with self.lock:
                self.poll()
            time.sleep(self.every_s)

    def report(self) -> dict:
        with self.lock:
            for pid in list(self.running):
                self._close(pid, time.monotonic())
            return {"driver_rss": self.driver_rss, "tasks": self.tasks}


def run_phase(out: str, phase: str, cpus: int, overrides: list[str]) -> dict:
    """One global phase of ``out`` with the code of the current directory's tree; the sample phase measured."""
    sys.path.insert(0, os.getcwd())
    import ray

    from common.config import load_config
    from curation.config import CurateConfig
    from curation.phases.pipeline import GlobalPhases
    from curation.steps.output import Output

    cfg = load_config(CurateConfig, str(Path.cwd() / "configs/curate/lite.yaml"), overrides)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level=logging.ERROR)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    sampler = TaskSampler()
    sampler.start()
    start = time.monotonic()
    record = GlobalPhases(cfg, Output.at(out)).run(phase)
    seconds = time.monotonic() - start
    time.sleep(2)  # workers report their task events every second
    report = sampler.report()
    for event in ray.timeline():  # exact task spans, where the sampler's titles would merge a worker's tasks
        name = str(event.get("cat", "")).removeprefix("task::")
        if name in report["tasks"] and "dur" in event:
            t = report["tasks"][name]
            t["timed"] = t.get("timed", 0) + 1
            t["max_task_s"] = max(t.get("max_task_s", 0.0), event["dur"] / 1e6)
    ray.shutdown()
    return {"seconds": seconds, "record": record, **report}


def _phase(tree: Path, out: Path, phase: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--run-phase", phase, str(out), "--cpus", str(args.cpus), *args.overrides]
    done = subprocess.run(cmd, cwd=tree, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ""})
    if done.returncode != 0:
        raise SystemExit(f"the {phase} phase failed in {tree} on {out} (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _clear_sample(out: Path) -> None:
    shutil.rmtree(out / "sample", ignore_errors=True)
    shutil.rmtree(out / "_state/steps/sample", ignore_errors=True)
    for later in ("sample", "write"):
        (out / f"_state/{later}.done.json").unlink(missing_ok=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000000", help="comma-separated numbers of survivors")
    p.add_argument("--rows-per-shard", type=int, default=10_000, help="survivors per input shard")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--work", default="/tmp/bench-sample", help="folder for the synthetic outputs (reused when there)")
    p.add_argument("--keep", action="store_true", help="keep the synthetic outputs")
    p.add_argument("--trees", nargs="+", default=[str(REPO)], help="checkouts whose sample phase is measured")
    p.add_argument("--run-phase", nargs=2, default=None, help=argparse.SUPPRESS)  # internal: one phase of one output
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = p.parse_args()
    if args.run_phase:
        print(json.dumps(run_phase(args.run_phase[1], args.run_phase[0], args.cpus, args.overrides), default=str))
        return 0

    from bench_scale import config, synthesise  # this tree's synthesis (bench_scale puts the repository on the path)

    cfg = config(args.overrides)
    for n in (int(s) for s in args.sizes.split(",")):
        out = Path(args.work) / f"n{n}"
        if not (out / "_state/dedup.done.json").exists():
            if not (out / "_state/score.done.json").exists():
                shutil.rmtree(out, ignore_errors=True)
                synthesise(out, n, args.rows_per_shard, cfg)
            dedup = _phase(REPO, out, "dedup", args)
            print(f"N = {n:,}: synthesised, dedup {dedup['seconds']:.0f} s", flush=True)
        for tree in args.trees:
            _clear_sample(out)
            r = _phase(Path(tree).resolve(), out, "sample", args)
            record = r["record"]
            print(
                f"N = {n:,} {tree}: sample {r['seconds']:.1f} s, {record.get('inputs')} alive, "
                f"{record.get('selected')} selected, clusters per level (finest first) "
                f"{', '.join(map(str, record.get('clusters_per_level') or [])) or 'none'}; "
                f"driver peak RSS {r['driver_rss'] / GIB:.2f} GiB",
                flush=True,
            )
            for name, t in sorted(r["tasks"].items(), key=lambda kv: -kv[1].get("max_task_s", 0)):
                rss, longest = t["max_rss"] / GIB, t.get("max_task_s", t["max_s"])
                print(f"    {name:<24} {t.get('timed', 0):5d} tasks, longest {longest:7.1f} s, peak RSS {rss:5.2f} GiB")
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
