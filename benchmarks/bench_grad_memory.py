"""Gradient memory per rank with gradient accumulation, ``fsdp.reduce_every_micro_batch`` on and off, side by side.

Two gloo ranks on the CPU train the first micro-batch of a step (of 2) of the given size at small views (the
gradient's size does not depend on the image) and count the gradient bytes each rank then holds: the sharded
gradients plus what FSDP2 keeps unsharded until the step's last micro-batch.

    python benchmarks/bench_grad_memory.py [--size 0.4b]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RANK = """
import sys, torch, torch.distributed as dist
from benchmarks.bench_grad_memory import held_after_first_micro_batch
store, rank, size, reduce_every = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
held = held_after_first_micro_batch(size, reduce_every)
if rank == 0:
    print(held)
dist.barrier()
dist.destroy_process_group()
"""


def held_after_first_micro_batch(size: str, reduce_every: bool) -> int:
    """Gradient bytes this rank holds after the first of 2 micro-batches."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from common.config import load_config
    from pretrain.config import PretrainConfig
    from pretrain.train import build_model

    overrides = [
        f"model.size={size}", "model.compile=false", "data.batch_size=1", "optim.grad_accum=2",
        "objective.views.global_size=[64,48]", "objective.views.local_size=[32,32]", "objective.views.n_local=0",
        f"fsdp.reduce_every_micro_batch={reduce_every}", "ray.workers=2",
    ]  # fmt: skip
    cfg = load_config(PretrainConfig, REPO / "configs/pretrain/tiny.yaml", overrides)
    model = build_model(cfg, torch.device("cpu"))
    model.set_requires_gradient_sync(reduce_every)  # the first micro-batch of 2, as Trainer.train_step sets it
    images = torch.randint(0, 256, (1, 3, *cfg.image_size), dtype=torch.uint8)
    (model(images, 0)["loss"] / 2).backward()
    held = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group  # FSDP2 exposes no gradient accounting
        for p in group.fsdp_params if group else ():
            unsharded = getattr(p, "_unsharded_param", None)
            grads = [
                p.sharded_param.grad,
                p.unsharded_accumulated_grad,
                unsharded.grad if unsharded is not None else None,
            ]
            held += sum(g.to_local().nbytes if hasattr(g, "to_local") else g.nbytes for g in grads if g is not None)
    return held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.4b")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for reduce_every in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-c", RANK, str(Path(tmp) / "store")]
            ranks = [
                subprocess.Popen(
                    [*cmd, str(r), args.size, str(int(reduce_every))],
                    cwd=REPO,
                    env=env,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for r in range(2)
            ]
            outs = [p.communicate(timeout=1800)[0] for p in ranks]
        held = int(outs[0].strip().splitlines()[-1])
        shown = f"{held / 2**30:.3f} GiB ({held} bytes)"
        print(f"{args.size} reduce_every_micro_batch={reduce_every}: {shown} of gradients per rank")


if __name__ == "__main__":
    main()
