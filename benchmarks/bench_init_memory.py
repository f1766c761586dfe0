"""Host memory per rank while the pretraining model is built, the plain way and on the meta device, side by side.

    python benchmarks/bench_init_memory.py [--config configs/pretrain/sapiens2_0.4b.yaml] [--workers 2]

Each way runs in fresh processes, one per rank, over gloo on the CPU (a process's peak resident memory only grows):

- plain: the build before meta-device construction: the whole fp32 ``JointObjective`` from the seed on every rank's
  CPU, its teacher a deep copy, then ``training.sharding.shard``;
- meta: ``pretrain.train.build_model``: built on the meta device, sharded, each rank writing only its shards of the
  same seeded weights.

Prints, per way, each rank's peak RSS after dist init (torch and gloo alone), its peak after the build (what the
run's ``host_memory_peak_bytes`` adds the first step to) and its RSS after the build, and the build's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WAYS = ("plain", "meta")
SIZES = ("peak_before", "peak_after", "rss_after", "local_params")  # a rank's figures in bytes, as the table shows them
GIB = 2**30


def rss_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from common.config import load_config
    from pretrain.backbone import build
    from pretrain.config import PretrainConfig
    from pretrain.objective import JointObjective
    from pretrain.train import build_model, fsdp_chains
    from training.metrics import host_memory_peak_bytes
    from training.sharding import shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(args.store, args.world), rank=args.rank, world_size=args.world)
    cfg = load_config(PretrainConfig, args.config, ["model.compile=false"])
    device = torch.device("cpu")
    before = host_memory_peak_bytes()
    start = time.perf_counter()
    if args.way == "plain":
        torch.manual_seed(cfg.seed)
        model = JointObjective(build(cfg.model.backbone()), cfg.objective, total_steps=cfg.steps)
        shard(model, fsdp_chains(model), device, cfg.precision, cfg.fsdp)
    else:
        model = build_model(cfg, device)
    dist.barrier()
    seconds = time.perf_counter() - start
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"rank": args.rank, "peak_before": before, "peak_after": host_memory_peak_bytes(),
                      "rss_after": rss_bytes(), "local_params": local, "seconds": seconds}))  # fmt: skip
    dist.destroy_process_group()


def run_way(way: str, config: str, world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        cmd = [sys.executable, __file__, "--config", config, "--workers", str(world), "--way", way, "--store", store]
        procs = [subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, text=True) for r in range(world)]
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"{way}: a rank failed ({[p.returncode for p in procs]})")
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs/pretrain/sapiens2_0.4b.yaml"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # a rank's process
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        args.world = args.workers
        rank_main(args)
        return
    print(f"# {Path(args.config).name} on {args.workers} gloo ranks, {platform.machine()} {os.cpu_count()} cores")
    print("| way | rank | peak RSS after dist init | peak RSS after the build | RSS after it | local shards | build |")
    print("|---|---|---|---|---|---|---|")
    for way in args.ways.split(","):
        for r in run_way(way, args.config, args.workers):
            sizes = " | ".join(f"{r[k] / GIB:.2f} GiB" for k in SIZES)
            print(f"| {way} | {r['rank']} | {sizes} | {r['seconds']:.0f} s |")


if __name__ == "__main__":
    main()
