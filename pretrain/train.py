"""Pretraining on Ray Train (V2): the per-worker loop, FSDP2 sharding, optimiser and schedules, metrics.

One code path for CPU (gloo) and GPU (nccl; Ray Train picks the backend from ``use_gpu``):

- Model: ``JointObjective`` (student, MAE decoder, projection head, EMA teacher). Built identically on every rank
  from the run's seed, then sharded with FSDP2: ``fully_shard`` on every transformer block (student, teacher,
  decoder) and on both projection heads, then on the root. On GPU with ``precision: bf16`` parameters are gathered
  and computed in bf16 and gradients reduced in fp32. The teacher's EMA update runs on the local shards.
- Optimiser: AdamW, decay and no-decay groups (1-D params, tokens: the objective's ``no_weight_decay``); linear
  warm-up to the peak ``optim.lr x global batch / 256`` (``peak_lr``) then cosine learning rate, cosine weight
  decay, both by optimiser step (so gradient accumulation does not stretch them); gradient clipping on the global
  norm. Under accumulation only the last micro-batch reduces.
- Randomness of views and masks: a generator reseeded from (seed, step, micro-batch, rank) at each micro-batch, so
  a resumed run draws exactly what the uninterrupted run would have.
- Checkpoints (``pretrain/checkpoint.py``) every ``checkpoint.every`` steps, at the end, and when Ray Train reports
  an imminent preemption; each is reported to Ray Train in place, and a restarted worker group (or a rerun of the
  same command) gets the latest back from ``ray.train.get_checkpoint()``. The data position is part of it.
- Metrics every ``log.every`` steps from rank 0: JSON lines under ``<run>/metrics/`` and a progress line, with the
  contrastive term's diagnostics; a collapse they show (``objective.collapse_state``) that lasts
  ``log.collapse_patience`` steps is logged once as a warning and a ``collapse`` record, and so is its end.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from common import storage
from common.config import ConfigError
from common.metrics_sinks import Sinks
from pretrain import checkpoint as ckpt
from pretrain import data
from pretrain.backbone import build, flops
from pretrain.config import OptimSettings, PretrainConfig, RaySettings
from pretrain.masking import num_masked
from pretrain.objective import DIAGNOSTICS, TERMS, CollapseMonitor, JointObjective, collapse_state

METRICS = "metrics"
RUN_FILE = "run.json"
# TensorBoard / MLflow / W&B groups of the pretraining scalars beyond the shared ones (common.metrics_sinks.GROUPS)
SCALAR_GROUPS = {**dict.fromkeys(DIAGNOSTICS, "contrastive"), "samples_seen": "progress"}
# bf16 dense peak per GPU, for MFU when log.peak_tflops is not set (matched against the device name).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "B200": 2250.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}


# --- schedules ----------------------------------------------------------------------------------------------------

LR_REFERENCE_BATCH = 256  # ``optim.lr`` is the learning rate of this many images per optimiser step


def peak_lr(o: OptimSettings, global_batch: int) -> float:
    """The linear scaling rule (MAE, Sapiens v1): ``o.lr x global_batch / 256``, ``global_batch`` being the images of
    one optimiser step over all workers (micro-batches included). ``o.min_lr`` is absolute, as in MAE's code."""
    return o.lr * global_batch / LR_REFERENCE_BATCH


def lr_at(step: int, o: OptimSettings, total: int, global_batch: int) -> float:
    """Linear warm-up to ``peak_lr`` over ``warmup_steps``, then cosine to ``min_lr`` at ``total`` (optimiser
    steps)."""
    peak = peak_lr(o, global_batch)
    if step < o.warmup_steps:
        return peak * (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    return o.min_lr + (peak - o.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def wd_at(step: int, o: OptimSettings, total: int) -> float:
    """Cosine from ``weight_decay`` at step 0 to ``weight_decay_end`` at ``total``."""
    progress = min(1.0, step / max(1, total))
    return o.weight_decay_end + (o.weight_decay - o.weight_decay_end) * 0.5 * (1 + math.cos(math.pi * progress))


# --- model and optimiser --------------------------------------------------------------------------------------------


def build_model(cfg: PretrainConfig, device: torch.device) -> JointObjective:
    """The objective with FSDP2 applied; every rank builds the same initial weights from ``cfg.seed``."""
    torch.manual_seed(cfg.seed)
    model = JointObjective(build(cfg.model.backbone()), cfg.objective, total_steps=cfg.steps)
    blocks = [*model.student.all_blocks, *model.teacher["backbone"].all_blocks]
    if cfg.model.compile:
        for block in blocks:
            block.compile()
    units = [*blocks, *model.decoder.blocks.layers, model.head, model.teacher["head"]]
    return shard(model, units, device, cfg.precision)


def shard(model: nn.Module, units: list[nn.Module], device: torch.device, precision: str) -> nn.Module:
    """FSDP2 over the process group: one ``fully_shard`` per unit, then the root (the parameters left over, and the
    move to ``device``); bf16 parameters and compute with fp32 gradient reduction on GPUs when asked."""
    mp = MixedPrecisionPolicy()
    if device.type == "cuda" and precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = dist.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def build_optimizer(model: JointObjective, o: OptimSettings) -> torch.optim.AdamW:
    exempt = model.no_weight_decay()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name in exempt else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": o.weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    # fused: one kernel over all (sharded) parameters; the per-tensor default loop is 10x slower on DTensors
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=True)


def optimizer_step(optimizer: torch.optim.Optimizer, params: list[Tensor], grad_clip: float | None) -> Tensor:
    """Clip the gradients to ``grad_clip`` (global norm over every shard), step, clear; returns the norm before
    clipping as a plain tensor."""
    grads = [p.grad for p in params if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if grad_clip is not None:
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, grad_norm, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return (grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm).detach()


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def fingerprint(model: JointObjective, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Global sums of squares of the student side, the teacher and the Adam moments (checks a restore)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = {
        "params": trainable,
        "teacher": list(model.teacher.parameters()),
        "exp_avg": [optimizer.state[p]["exp_avg"] for p in trainable if p in optimizer.state],
        "exp_avg_sq": [optimizer.state[p]["exp_avg_sq"] for p in trainable if p in optimizer.state],
    }
    device = trainable[0].device
    sums = torch.stack(
        [sum(((_local(t).double() ** 2).sum() for t in ts), torch.zeros((), dtype=torch.float64, device=device))
         for ts in groups.values()]
    )
    dist.all_reduce(sums)  # every tensor here is a sharded DTensor: local sums add up to the global one
    return dict(zip(groups, sums.tolist()))


def train_flops_per_image(cfg: PretrainConfig) -> tuple[float, int]:
    """(training FLOPs of the backbone passes per image, student patch tokens per image).

    Student: the masked global views and the local views, forward + backward (3x the forward); teacher: the
    whole global views, forward only. A multiply-add is 2 FLOPs. The MAE decoder and the projection heads are
    not counted, so MFU is a lower bound.
    """
    bb, v = cfg.model.backbone(), cfg.objective.views
    (H, W), (h, w) = v.global_size, v.local_size
    win, p = bb.window or 1, bb.patch_size
    n_tokens = (H // (p * win)) * (W // (p * win))
    n_keep = n_tokens - num_masked(n_tokens, cfg.objective.masking.ratio)
    student = v.n_global * flops(bb, H, W, visible=n_keep / n_tokens, attention=True)
    student += v.n_local * flops(bb, h, w, attention=True)
    teacher = v.n_global * flops(bb, H, W, attention=True)
    tokens = v.n_global * n_keep * win * win + v.n_local * (h // p) * (w // p)
    return 2.0 * (3.0 * student + teacher), tokens


def peak_flops(cfg: PretrainConfig, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    if cfg.log.peak_tflops:
        return cfg.log.peak_tflops * 1e12
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_TFLOPS.items() if key in name), None)


def progress(line: str) -> None:
    """One line to the job log (Ray Train's patched ``print`` would log it twice from a worker)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _seed(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & (2**63 - 1)


# --- metrics --------------------------------------------------------------------------------------------------------


class MetricsLog:
    """JSON lines under ``<run>/metrics/``: one part file per attempt and checkpoint interval; the ``train`` and
    ``eval`` records also go to the run's ``log.backends`` (``common.metrics_sinks``: TensorBoard by default).

    A part is ``part-<attempt start ns>-<first step>.jsonl``; names sort chronologically. Lines are flushed as
    written (visible at once on a local disk); ``roll`` closes the part at a checkpoint, which is when an object
    store makes it visible. After a resume, steps past the restored checkpoint appear again in the new attempt's
    parts: ``read_metrics`` keeps every line, ``latest_per_step`` the newest (TensorBoard readers drop the old ones).
    """

    def __init__(self, run_uri: str, first_step: int, sinks: Sinks | None = None) -> None:
        self.fs, root = storage.resolve(run_uri)
        self.dir = storage.join(root, METRICS)
        self.fs.create_dir(self.dir, recursive=True)
        self.attempt = time.time_ns()
        self.sinks = sinks
        self._open(first_step)

    @classmethod
    def for_run(cls, run_uri: str, first_step: int, cfg, groups: dict[str, str] | None = None) -> MetricsLog:
        """The log of a run whose config has a ``log`` section (pretraining, fine-tuning)."""
        params = cfg.model_dump(mode="json")
        return cls(run_uri, first_step, Sinks(cfg.log.backends, run_uri, first_step, params, groups or {}))

    def _open(self, step: int) -> None:
        self.out = self.fs.open_output_stream(storage.join(self.dir, f"part-{self.attempt}-{step:09d}.jsonl"))

    def write(self, record: dict) -> None:
        self.out.write((json.dumps({**record, "attempt": self.attempt}) + "\n").encode())
        self.out.flush()
        if self.sinks:
            self.sinks.log(record)

    def roll(self, next_step: int) -> None:
        self.out.close()
        self._open(next_step)
        if self.sinks:
            self.sinks.checkpoint()

    def close(self) -> None:
        self.out.close()
        if self.sinks:
            self.sinks.close()


def read_metrics(run_uri: str, kind: str | None = "train") -> list[dict]:
    """Every metrics line of the run in the order written (all attempts), optionally of one ``kind``."""
    fs, root = storage.resolve(run_uri)
    records = []
    for path in storage.list_files(fs, storage.join(root, METRICS), ".jsonl"):
        with fs.open_input_stream(path) as f:
            records += [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]
    return [r for r in records if kind is None or r.get("kind") == kind]


def latest_per_step(records: list[dict]) -> dict[int, dict]:
    """step -> the record of the newest attempt that reached it."""
    return {r["step"]: r for r in records}


@dataclass
class Window:
    """Sums over the steps since the last metrics line."""

    steps: int = 0
    terms: Tensor | None = None  # objective.TERMS summed over steps (mean over micro-batches)
    grad_norm: Tensor | None = None
    data_wait: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def add(self, terms: Tensor, grad_norm: Tensor, data_wait: float) -> None:
        self.steps += 1
        self.terms = terms if self.terms is None else self.terms + terms
        self.grad_norm = grad_norm if self.grad_norm is None else self.grad_norm + grad_norm
        self.data_wait += data_wait


# --- the worker loop ------------------------------------------------------------------------------------------------


def train_loop(loop_config: dict) -> None:
    """``TorchTrainer``'s ``train_loop_per_worker``: ``loop_config`` holds the config (as JSON data), the run URI and
    the data folder's URI as given."""
    cfg = PretrainConfig.model_validate(loop_config["config"])
    Worker(cfg, loop_config["run_uri"], loop_config.get("data_uri")).run()


class Worker:
    def __init__(self, cfg: PretrainConfig, run_uri: str, data_uri: str | None = None) -> None:
        import ray.train
        import ray.train.torch

        self.cfg, self.run_uri = cfg, run_uri
        if cfg.ray.torch_threads:
            torch.set_num_threads(cfg.ray.torch_threads)
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.storage = ctx.get_storage()
        self.device = ray.train.torch.get_device()
        self.model = build_model(cfg, self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.generator = torch.Generator(device=self.device)
        self.index = data.load_index(run_uri, data_uri)
        self.step, self.position, self.samples_seen = 0, data.DataPosition(), 0
        self.flops_per_image, self.tokens_per_image = train_flops_per_image(cfg)
        self.peak = peak_flops(cfg, self.device)
        self.restored: dict | None = None
        self._restore(ray.train.get_checkpoint())
        self.log = MetricsLog.for_run(run_uri, self.step, cfg, SCALAR_GROUPS) if self.rank == 0 else None
        if self.log and self.restored:
            self.log.write({"kind": "resume", "step": self.step, "world_size": self.world, **self.restored})

    def _restore(self, checkpoint) -> None:
        """Resume from the newest committed checkpoint: Ray Train's latest, or a newer one Ray never registered.

        Ray registers a checkpoint once it has collected every rank's report; a worker killed right after
        reporting can take its report with it. Such a checkpoint is complete (it has its commit record), so it is
        used and reported again ("adopted"), which puts it under Ray's retention like the others.
        """
        from_ray = None
        if checkpoint is not None:
            from_ray = storage.join(self.run_uri, ckpt.CHECKPOINTS, os.path.basename(checkpoint.path.rstrip("/")))
        choice = [None]
        if self.rank == 0:
            newest = ckpt.latest_committed(self.run_uri)
            if newest and (from_ray is None or ckpt.step_of(newest) > ckpt.step_of(from_ray)):
                choice[0] = newest
            else:
                choice[0] = from_ray
            ckpt.remove_stale(self.run_uri, ckpt.step_of(choice[0]) if choice[0] else None)
        dist.broadcast_object_list(choice, src=0)  # one decision, taken after the clean-up
        uri = choice[0]
        if uri is None:
            return
        commit = ckpt.load(uri, self.model, self.optimizer)
        if commit["model_hash"] != self.cfg.model_hash():
            raise ckpt.CheckpointError(
                f"{uri} holds a different model (size / decoder / head settings); use a new run name"
            )
        self.step = commit["step"]
        self.position = data.DataPosition(**commit["data_position"])
        self.samples_seen = commit["samples_seen"]
        self.restored = {
            "checkpoint": uri,
            "adopted": uri != from_ray,
            "saved_world_size": commit["world_size"],
            "saved_fingerprint": commit["fingerprint"],
            "fingerprint": fingerprint(self.model, self.optimizer),
            "data_position": self.position.to_dict(),
        }
        if uri != from_ray:
            self._report(os.path.basename(uri), {"step": self.step})

    def run(self) -> None:
        import ray.train

        c = self.cfg
        accum, per_step = c.optim.grad_accum, c.samples_per_step(self.world)
        batches = data.stream(
            self.index, c, position=self.position, steps=c.steps - self.step, world=self.world, rank=self.rank
        )
        window = Window()
        self.collapse = CollapseMonitor(c.log.collapse_patience)
        last_metrics: dict = {}
        preemption_saved = False
        while self.step < c.steps:
            step, data_wait, terms, keys = self.step, 0.0, [], []
            for micro in range(accum):
                t = time.perf_counter()
                batch = next(batches)
                data_wait += time.perf_counter() - t
                images = batch.images.to(self.device, non_blocking=True)
                self.model.set_requires_gradient_sync(micro == accum - 1)
                self.generator.manual_seed(_seed(c.seed, step, micro, self.rank))
                out = self.model(images, step, self.generator)
                (out["loss"] / accum).backward()
                terms.append(torch.stack([out[k].detach().float() for k in TERMS]))  # read at log time only
                keys += batch.keys
            lr, wd = lr_at(step, c.optim, c.steps, per_step), wd_at(step, c.optim, c.steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
                group["weight_decay"] = wd if group["name"] == "decay" else 0.0
            grad_norm = optimizer_step(self.optimizer, self.params, c.optim.grad_clip)
            momentum = self.model.update_teacher(step)
            self.step += 1
            self.position = data.advance(self.position, per_step, self.index.num_samples)
            self.samples_seen += per_step
            window.add(torch.stack(terms).mean(0), grad_norm, data_wait)
            self._fault_drill()
            if c.log.record_keys:
                self._record_keys(keys)
            if self.step % c.log.every == 0 or self.step == c.steps:
                last_metrics = self._log_window(window, lr=lr, wd=wd, momentum=momentum)
                window = Window()
            if self.step % c.checkpoint.every == 0 or self.step == c.steps:
                self._save(last_metrics)
            elif c.checkpoint.on_preemption and self.step % c.checkpoint.preemption_check_every == 0:
                notice = ray.train.get_preemption_info()  # a barrier: every rank asks at the same steps
                if notice is not None and not preemption_saved:
                    self._save(last_metrics, reason="preemption")  # then train on until the node goes
                    preemption_saved = True
        if self.log:
            self.log.close()

    # --- pieces of a step ---

    def _record_keys(self, keys: list[str]) -> None:
        gathered: list[list[str]] = [[] for _ in range(self.world)]
        dist.all_gather_object(gathered, keys)
        if self.log:
            self.log.write({"kind": "samples", "step": self.step, "epoch": self.position.epoch, "keys": gathered})

    def _log_window(self, window: Window, **schedule: float) -> dict:
        c = self.cfg
        # Reduced on the training device (NCCL reduces only GPU tensors): means of the loss terms, diagnostics and
        # grad norm, mean and max of the data wait per step over ranks. Every rank gets the same means, so every
        # rank's collapse monitor agrees (rank 0 writes).
        stats = torch.cat([window.terms, window.grad_norm.view(1)]).float() / (window.steps * self.world)
        wait = torch.full((2,), window.data_wait / window.steps, device=self.device)
        dist.all_reduce(stats)
        dist.all_reduce(wait[0:1])
        dist.all_reduce(wait[1:2], op=dist.ReduceOp.MAX)
        stats, wait = stats.tolist(), wait.tolist()
        step_s = (time.perf_counter() - window.started) / window.steps
        images_per_s = c.samples_per_step(self.world) / step_s
        wait_mean, wait_max = wait[0] / self.world, wait[1]
        terms = dict(zip(TERMS, stats))
        record = {
            "kind": "train",
            "step": self.step,
            "epoch": self.position.epoch,
            "samples_seen": self.samples_seen,
            **terms,
            "grad_norm": stats[len(TERMS)],
            "collapse": collapse_state(terms, c.objective.cl.prototypes),  # this window's
            **schedule,
            "images_per_s": images_per_s,
            "tokens_per_s": images_per_s * self.tokens_per_image,
            "step_s": step_s,
            "data_wait_s": wait_mean,
            "data_wait_max_s": wait_max,
            "compute_s": step_s - wait_mean,
            "data_wait_frac": wait_mean / step_s,
        }
        if self.peak:
            record["mfu"] = images_per_s * self.flops_per_image / (self.world * self.peak)
        change = self.collapse.update(record["collapse"], self.step - window.steps, self.step)
        if self.log:
            self.log.write(record)
            mfu = f" mfu {record['mfu']:.1%}" if "mfu" in record else ""
            ln_k = math.log(c.objective.cl.prototypes)
            alarm = f" COLLAPSE: {self.collapse.reported}" if self.collapse.reported else ""
            progress(
                f"[pretrain] step {self.step}/{c.steps} ep {record['epoch']} loss {record['loss']:.4f} "
                f"(mae {record['mae']:.4f} cl {record['cl']:.4f}) lr {record['lr']:.2e} "
                f"gnorm {record['grad_norm']:.3f} "
                f"| Ht {record['teacher_entropy']:.3f} Hs {record['student_entropy']:.3f} lnK {ln_k:.3f} "
                f"cls_std/rms {record['cls_std'] / max(record['cls_rms'], 1e-12):.1e} "
                f"protos {record['proto_used']:.1f} m {record['momentum']:.5f}{alarm} "
                f"| {images_per_s:.1f} img/s {record['tokens_per_s']:.0f} tok/s | step {step_s:.3f}s "
                f"= data {wait_mean:.3f}s + compute {record['compute_s']:.3f}s{mfu}"
            )
            if change:
                self._log_collapse(*change)
        return {k: v for k, v in record.items() if isinstance(v, (int, float))}

    def _log_collapse(self, state: str | None, since: int) -> None:
        """A collapse (or its end) that has lasted ``log.collapse_patience`` steps: a warning and a record."""
        ended = state is None
        self.log.write({"kind": "collapse", "step": self.step, "state": state, "since": since, "ended": ended})
        if ended:
            progress(f"[pretrain] collapse ended: healthy since step {since}")
        else:
            progress(
                f"[pretrain] WARNING: self-distillation collapse ({state}) since step {since}: the contrastive "
                "term teaches nothing while it lasts (see README, Pretraining)"
            )

    def _save(self, metrics: dict, reason: str = "interval") -> None:
        name = os.path.basename(ckpt.step_uri(self.run_uri, self.step))
        uri = storage.join(self.run_uri, ckpt.CHECKPOINTS, name)
        state = {
            "step": self.step,
            "data_position": self.position.to_dict(),
            "samples_seen": self.samples_seen,
            "model_hash": self.cfg.model_hash(),
            "config": self.cfg.model_dump(mode="json"),
            "fingerprint": fingerprint(self.model, self.optimizer),
            "reason": reason,
        }
        ckpt.save(uri, self.model, self.optimizer, state)
        if self.log:
            self.log.write({"kind": "checkpoint", "step": self.step, "uri": uri, "reason": reason})
            self.log.roll(self.step + 1)
        self._report(name, {**metrics, "step": self.step})

    def _report(self, name: str, metrics: dict) -> None:
        """Hand a committed checkpoint to Ray Train in place: registered without a copy, evicted past ``keep``."""
        import ray.train
        from ray.train import Checkpoint
        from ray.train.v2.api.report_config import CheckpointUploadMode

        path = storage.join(self.storage.experiment_fs_path, ckpt.CHECKPOINTS, name)
        ray.train.report(
            metrics,
            checkpoint=Checkpoint(path=path, filesystem=self.storage.storage_filesystem),
            checkpoint_dir_name=name,
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
        )

    def _fault_drill(self) -> None:
        f = self.cfg.fault
        if f.kill_at_step != self.step or f.kill_rank != self.rank:
            return
        fs, root = storage.resolve(self.run_uri)
        marker = storage.join(root, f"_fault-drill-step-{self.step}")
        if storage.exists(fs, marker):
            return
        storage.write_bytes_atomic(fs, marker, b"")
        progress(f"[pretrain] fault drill: killing rank {self.rank} (pid {os.getpid()}) at step {self.step}")
        os.kill(os.getpid(), signal.SIGKILL)


# --- the driver side --------------------------------------------------------------------------------------------------


def run_uri_for(storage_path: str, name: str) -> str:
    """Where Ray Train puts the run: ``<storage>/<name>`` (local paths made absolute, as Ray does)."""
    if "://" in storage_path:
        return storage.join(storage_path, name)
    return os.path.join(os.path.abspath(os.path.expanduser(storage_path)), name)


def fit(cfg: PretrainConfig, storage_path: str, name: str, data_uri: str | None = None):
    """Run (or resume) the training run ``name`` under ``storage_path`` on the connected Ray cluster; ``data_uri``
    opens the data (default: the folder name the run's index recorded, enough unless its URI carries a query)."""
    config = {"config": cfg.model_dump(mode="json"), "run_uri": run_uri_for(storage_path, name), "data_uri": data_uri}
    return launch(train_loop, config, cfg.ray, storage_path, name, keep=cfg.checkpoint.keep)


def claim_run(run_uri: str, identity: dict, info: dict | None = None) -> bool:
    """Record what the run trains in ``<run>/run.json``; a rerun under the same name must give the same ``identity``
    (``info`` is recorded, not compared). Returns True when resuming."""
    fs, run = storage.resolve(run_uri)
    path = storage.join(run, RUN_FILE)
    if not storage.exists(fs, path):
        storage.write_json_atomic(fs, path, {**identity, **(info or {}), "created": time.time()})
        return False
    earlier = storage.read_json(fs, path)
    for key, value in identity.items():
        if earlier.get(key) != value:
            raise ConfigError(
                f"run {run_uri} was started with {key}={earlier.get(key)!r}, this command gives {value!r}; "
                "use a new --name for a different run"
            )
    return True


def launch(loop, loop_config: dict, settings: RaySettings, storage_path: str, name: str, keep: int | None = None):
    """``loop(loop_config)`` on a Ray Train worker group sized by ``settings``; Ray Train's run (its checkpoint
    registry, restarts after failures) lives in ``<storage_path>/<name>``. Shared by pretraining and fine-tuning."""
    import ray.train
    from ray.train.torch import TorchTrainer

    resources = {"CPU": settings.cpus_per_worker} | ({"GPU": 1} if settings.use_gpu else {})
    trainer = TorchTrainer(
        loop,
        train_loop_config=loop_config,
        scaling_config=ray.train.ScalingConfig(
            num_workers=settings.workers, use_gpu=settings.use_gpu, resources_per_worker=resources
        ),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=storage_path if "://" in storage_path else os.path.abspath(os.path.expanduser(storage_path)),
            failure_config=ray.train.FailureConfig(max_failures=settings.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=keep),
            # Ray Train's own INFO lines (every rank's whole report at each checkpoint, worker-group start-up) stay
            # in its log files; the console gets rank 0's progress lines and Ray Train's warnings and errors
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
    )
    return trainer.fit()
