"""Single-thread OpenVINO processes on one node, with OpenVINO's thread pinning on and off, side by side in one run.

    python benchmarks/bench_openvino_pinning.py [--processes N] [--calls 40]

Each process stands for one actor of the lite person stage: the person graph (``models.person.graph``) compiled with
``curation.models.runtimes.openvino_config`` (one thread), run ``--calls`` times on a 368x276 image. N processes
(default: every CPU this process may use) start together; per setting: the wall time until the last one ends, and
each process's CPU time against its wall time. With pinning on, every process pins its inference thread from the
first core up, so they take turns on one core (CPU/wall ~ 1/N); off, each has a core (~1). The two settings run
twice each, in both orders, so the machine's drift falls on both; the faster run of each is printed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _graph() -> Path:
    from curation.config import CurateConfig
    from curation.models import ModelStore

    cfg = CurateConfig()
    return ModelStore.from_settings(cfg.models.store).fetch(cfg.models.person.graph, "models.person.graph")


def _actor(graph: str, pin: bool, calls: int, start, out) -> None:
    import numpy as np

    from curation.models.runtimes import OpenVinoNetwork, openvino_config

    network = OpenVinoNetwork(Path(graph), 1, {**openvino_config(1), "ENABLE_CPU_PINNING": pin})
    x = np.zeros((1, 276, 368, 3), np.float32)
    network(x)  # plans and allocates outside the clock
    start.wait()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        network(x)
    out.put((time.perf_counter() - wall, time.process_time() - cpu))


def run(graph: Path, pin: bool, processes: int, calls: int) -> dict:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_actor, args=(str(graph), pin, calls, start, out)) for _ in range(processes)]
    for p in procs:
        p.start()
    time.sleep(3.0)  # every process compiled its network and waits at the start line
    t0 = time.perf_counter()
    start.set()
    results = [out.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    return {
        "wall_s": wall,
        "ms_per_image": 1000 * wall / (processes * calls),
        "cpu_per_wall": statistics.mean(c / w for w, c in results),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args(argv)
    graph = _graph()
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for order in ((True, False), (False, True)):
        for pin in order:
            runs[pin].append(run(graph, pin, args.processes, args.calls))
    best = {pin: min(r, key=lambda x: x["wall_s"]) for pin, r in runs.items()}
    from curation.models.runtimes import cpu_model

    print(
        f"{time.strftime('%Y-%m-%d')}, {cpu_model()}, {args.processes} processes x {args.calls} calls, one thread each"
    )
    for pin, r in best.items():
        print(
            f"pinning {'on ' if pin else 'off'}: {r['wall_s']:.2f} s, {r['ms_per_image']:.1f} ms per image on the node, "
            f"CPU/wall per process {r['cpu_per_wall']:.2f}"
        )
    print(f"off vs on: {best[True]['wall_s'] / best[False]['wall_s']:.2f}x images/s on the node")
    print(json.dumps({"on": runs[True], "off": runs[False]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
