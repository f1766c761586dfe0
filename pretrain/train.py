"""Pretraining on Ray Train (V2): the model and its optimiser, the per-worker loop and its metrics.

One code path for CPU (gloo) and GPU (nccl; Ray Train picks the backend from ``use_gpu``); the worker group,
sharding, schedules, checkpoints and metrics log are the shared training runtime's (``training/``):

- Model: ``JointObjective`` (student, MAE decoder, projection head, EMA teacher). Built on the meta device, sharded,
  then each rank materialises only its shards with the weights a plain build from the run's seed has (the teacher
  copied from the student's shards; ``build_model``). FSDP2: ``fully_shard`` on every transformer block (student,
  teacher, decoder) and on both projection heads, then on the root; ``fsdp`` sets the mesh (flat or HSDP), when
  they reshard and how far ahead they are gathered (``fsdp_chains``). On GPU with ``precision: bf16`` parameters are
  gathered and computed in bf16 and gradients reduced in fp32. The teacher's EMA update runs on the local shards.
- Optimiser: AdamW, decay and no-decay groups (1-D params, tokens: the objective's ``no_weight_decay``); linear
  warm-up to the peak ``optim.lr x global batch / 256`` (``training.schedules.peak_lr``) then cosine learning
  rate, cosine weight decay, both by optimiser step (so gradient accumulation does not stretch them); gradient
  clipping on the global norm. Under accumulation only the last micro-batch reduces.
- The step (``Trainer.train_step``, the one the benchmarks time too): per micro-batch the objective's forward and
  backward, then the schedules, clipping, the AdamW step and the teacher's EMA update (``optimizer_update``).
  Randomness of views and masks: a generator reseeded from (seed, step, micro-batch, rank) at each micro-batch, so
  a resumed run draws exactly what the uninterrupted run would have.
- Checkpoints (``training/worker.py``) every ``checkpoint.every`` steps, at the end, and when Ray Train reports
  an imminent preemption; a restarted worker group (or a rerun of the same command) resumes from the newest one
  that reads back. The data position is part of it.
- Metrics every ``log.every`` steps from rank 0: JSON lines under ``<run>/metrics/`` (every raw term; an attempt's
  first record also ``host_memory_peak_bytes``, the largest rank's peak RSS up to its first step) and a progress
  line (``console_line``: the loss the student can lower first), with the contrastive term's diagnostics; a
  collapse they show (``objective.collapse_state``) that lasts ``log.collapse_patience`` steps is logged once as a
  warning and a ``collapse`` record, and so is its end.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from common import storage
from pretrain import data, takedowns
from pretrain.backbone import Sapiens2Backbone, build, flops, step_part
from pretrain.config import PretrainConfig, PretrainOptim, PretrainProbe
from pretrain.masking import num_masked
from pretrain.objective import DIAGNOSTICS, TERMS, CollapseMonitor, JointObjective, collapse_state, decoder_macs
from training import checkpoint, failures
from training.runner import launch, run_uri_for
from training.schedules import lr_at, wd_at
from training.sharding import optimizer_step, shard, sum_over_shards
from training.worker import Worker, log_line

# TensorBoard / MLflow / W&B groups of the pretraining scalars beyond the shared ones (training.metrics_sinks.GROUPS)
SCALAR_GROUPS = {
    **dict.fromkeys(DIAGNOSTICS, "contrastive"),
    "samples_seen": "progress",
    "read_amplification": "perf",
    "taken_down_skipped": "progress",
}
# bf16 dense peak per GPU, for MFU when log.peak_tflops is not set (matched against the device name).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "B200": 2250.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}


# --- model and optimiser --------------------------------------------------------------------------------------------


def build_model(cfg: PretrainConfig, device: torch.device) -> JointObjective:
    """The objective with FSDP2 applied, holding the weights of a plain build seeded with ``cfg.seed``.

    Built on the meta device and sharded, then each rank materialises only its shards on ``device`` and writes their
    seeded values (``JointObjective.init_materialised``): host memory holds a rank's shards and one module's full
    weights at a time, not the whole fp32 objective with its teacher."""
    with torch.device("meta"):
        model = JointObjective(build(cfg.model.backbone(), "meta"), cfg.objective, total_steps=cfg.steps)
    if cfg.model.compile:
        for block in [*model.student.all_blocks, *_teacher(model).all_blocks]:
            block.compile()
    shard(model, fsdp_chains(model), device, cfg.precision, cfg.fsdp)
    model.to_empty(device=device)
    torch.manual_seed(cfg.seed)
    model.init_materialised()
    return model


def fsdp_chains(model: JointObjective) -> list[list[nn.Module]]:
    """The FSDP2 units in forward order (``training.sharding``): the student's blocks (for the global views, then
    again for the local ones), the MAE decoder's layers, the student's head, and the teacher's no-grad forward."""
    teacher = [*_teacher(model).all_blocks, model.teacher["head"]]
    return [model.student.all_blocks, list(model.decoder.blocks.layers), [model.head], teacher]


def _teacher(model: JointObjective) -> Sapiens2Backbone:
    return cast(Sapiens2Backbone, model.teacher["backbone"])  # a ModuleDict item: the student's deep copy


PROTOTYPES = "head.prototypes.parametrizations.weight.original1"  # the prototype directions (weight-normalised)


def build_optimizer(model: JointObjective, o: PretrainOptim) -> torch.optim.AdamW:
    """AdamW over three groups: weight-decayed, exempt (1-D params, tokens: the objective's ``no_weight_decay``) and
    the prototype layer (decayed; its learning rate held at 0 while ``cl.freeze_prototypes_steps`` last)."""
    exempt = model.no_weight_decay()
    groups: dict[str, list[Tensor]] = {"decay": [], "no_decay": [], "prototypes": []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            groups["prototypes" if name == PROTOTYPES else "no_decay" if name in exempt else "decay"].append(p)
    param_groups = [
        {"params": ps, "weight_decay": 0.0 if name == "no_decay" else o.weight_decay, "name": name}
        for name, ps in groups.items()
    ]
    # fused: one kernel over all (sharded) parameters; the per-tensor default loop is 10x slower on DTensors
    return torch.optim.AdamW(param_groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=True)


def optimizer_update(
    model: JointObjective, optimizer: torch.optim.Optimizer, params: Sequence[Tensor], step: int, cfg: PretrainConfig,
    global_batch: int,
) -> dict[str, float | Tensor]:  # fmt: skip
    """The end of every pretraining step, after the backward passes: this step's learning rate and weight decay on
    each group (the prototypes' rate 0 while frozen, as DINOv2's last-layer schedule), clipping, the AdamW step,
    the teacher's EMA update. Returns lr, wd, momentum and the gradient norm before clipping (a tensor)."""
    lr, wd = lr_at(step, cfg.optim, cfg.steps, global_batch), wd_at(step, cfg.optim, cfg.steps)
    frozen = step < cfg.objective.cl.freeze_prototypes_steps
    for group in optimizer.param_groups:
        group["lr"] = 0.0 if frozen and group["name"] == "prototypes" else lr
        group["weight_decay"] = 0.0 if group["name"] == "no_decay" else wd
    with step_part("optimizer"):
        grad_norm = optimizer_step(optimizer, params, cfg.optim.grad_clip)
    momentum = model.update_teacher(step)
    return {"lr": lr, "wd": wd, "momentum": momentum, "grad_norm": grad_norm}


class Trainer:
    """The pretraining step: what the worker trains with and the benchmarks time.

    Per micro-batch the objective's forward, its views and masks drawn from a generator reseeded from (seed, step,
    micro-batch, rank), and the backward of its share of the loss (on a sharded model only the last micro-batch
    reduces); then ``optimizer_update``: this step's learning rate and weight decay, clipping, the AdamW step, the
    teacher's EMA update. On a GPU with ``precision: bf16`` a sharded model (``build_model``) computes in bf16 by
    FSDP2's policy, a plain one under autocast. ``world`` sets the global batch the learning rate scales with
    (default the config's workers); ``seed`` the view and mask draws (default the config's).
    """

    def __init__(
        self, model: JointObjective, cfg: PretrainConfig, device: torch.device, *, rank: int = 0,
        world: int | None = None, seed: int | None = None,
    ) -> None:  # fmt: skip
        self.model, self.cfg, self.rank = model, cfg, rank
        self.seed = cfg.seed if seed is None else seed
        self.global_batch = cfg.samples_per_step(world)
        self.optimizer = build_optimizer(model, cfg.optim)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.generator = torch.Generator(device=device)
        self.autocast = not isinstance(model, FSDPModule) and device.type == "cuda" and cfg.precision == "bf16"
        self.device_type = device.type

    def train_step(self, step: int, micro_batches: Iterable[Tensor]) -> tuple[Tensor, dict[str, float | Tensor]]:
        """Optimiser step ``step`` over ``optim.grad_accum`` micro-batches of uint8 images [B, 3, H, W], each taken
        from ``micro_batches`` when its turn comes. Returns the objective's ``TERMS`` (means over the micro-batches,
        still on the device: read them when logging) and ``optimizer_update``'s lr, wd, momentum and gradient norm."""
        accum, terms = self.cfg.optim.grad_accum, []
        for micro, images in enumerate(micro_batches):
            if isinstance(self.model, FSDPModule):
                self.model.set_requires_gradient_sync(self.cfg.fsdp.reduce_every_micro_batch or micro == accum - 1)
            self.generator.manual_seed(_seed(self.seed, step, micro, self.rank))
            with torch.autocast(self.device_type, torch.bfloat16) if self.autocast else contextlib.nullcontext():
                out = self.model(images, step, self.generator)
            (out["loss"] / accum).backward()
            terms.append(torch.stack([out[k].detach().float() for k in TERMS]))
        if len(terms) != accum:
            raise ValueError(f"step {step} got {len(terms)} micro-batches; optim.grad_accum is {accum}")
        update = optimizer_update(self.model, self.optimizer, self.params, step, self.cfg, self.global_batch)
        return torch.stack(terms).mean(0), update


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def fingerprint(state: dict, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Global sums of squares of the trained parameters (those the optimiser holds), the teacher and the Adam moments
    of a checkpointed state dict (``checkpoint.checkpointed``: the live tensors or a staged copy), reduced over
    ``group``: checks a restore."""
    params, moments = state["model"], state["optim"]["state"]
    groups = {
        "params": [t for name, t in params.items() if name in moments],
        "teacher": [t for name, t in params.items() if name.startswith("teacher.")],
        "exp_avg": [m["exp_avg"] for m in moments.values()],
        "exp_avg_sq": [m["exp_avg_sq"] for m in moments.values()],
    }
    device = _local(groups["teacher"][0]).device
    sums = torch.stack(
        [
            sum(((_local(t).double() ** 2).sum() for t in ts), torch.zeros((), dtype=torch.float64, device=device))
            for ts in groups.values()
        ]
    )
    # every tensor here is sharded like the first: its shards' local sums add up to the global one
    return dict(zip(groups, sum_over_shards(sums, groups["teacher"][0], group).tolist()))


def train_flops_per_image(cfg: PretrainConfig) -> tuple[float, int]:
    """(training FLOPs of the backbone passes per image, student patch tokens per image).

    Student: the masked global views and the local views, and the MAE decoder on each global view, forward +
    backward (3x the forward); teacher: the whole global views, forward only. A multiply-add is 2 FLOPs. The
    projection heads (a few MLP layers on one token per view, <0.1% at 0.4B) are not counted.
    """
    bb, v = cfg.model.backbone(), cfg.objective.views
    (H, W), (h, w) = v.global_size, v.local_size
    win, p = bb.window or 1, bb.patch_size
    n_tokens = (H // (p * win)) * (W // (p * win))
    n_keep = n_tokens - num_masked(n_tokens, cfg.objective.masking.ratio)
    student = v.n_global * flops(bb, H, W, visible=n_keep / n_tokens, attention=True)
    student += v.n_local * flops(bb, h, w, attention=True)
    prefix, pixels = 1 + bb.num_registers, bb.in_chans * (p * win) ** 2
    student += v.n_global * decoder_macs(cfg.objective.mae, bb.width, n_keep, n_tokens, prefix, pixels)
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


def _seed(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & (2**63 - 1)


# --- metrics --------------------------------------------------------------------------------------------------------


@dataclass
class Window:
    """Sums over the steps since the last metrics line."""

    steps: int = 0
    terms: Tensor | None = None  # objective.TERMS summed over steps (mean over micro-batches)
    grad_norm: Tensor | None = None
    data_wait: float = 0.0
    read_bytes: int = 0  # this rank's bytes read for its batches and their images' bytes (data.Batch)
    image_bytes: int = 0
    taken_down_skipped: int = 0  # images a takedown removed whose places this rank's batches took
    started: float = field(default_factory=time.perf_counter)

    def add(self, terms: Tensor, grad_norm: Tensor, data_wait: float, reads: list[tuple[int, int, int]]) -> None:
        self.steps += 1
        self.terms = terms if self.terms is None else self.terms + terms
        self.grad_norm = grad_norm if self.grad_norm is None else self.grad_norm + grad_norm
        self.data_wait += data_wait
        self.read_bytes += sum(r[0] for r in reads)
        self.image_bytes += sum(r[1] for r in reads)
        self.taken_down_skipped += sum(r[2] for r in reads)


# --- the worker loop ------------------------------------------------------------------------------------------------


def console_line(c: PretrainConfig, step: int, r: dict) -> str:
    """One line per metrics window (docs/pretraining.md, "Reading a pretraining run"). First the loss the student can lower,
    ``mae + lambda_cl x kl + koleo x koleo`` with kl = cl - H, the contrastive term's KL(teacher || student): the
    cross-entropy ``cl`` also holds H, the teacher targets' mean entropy, which has no gradient and moves with the
    teacher, so the record's ``loss`` (this figure + lambda_cl x H; jsonl and TensorBoard keep every raw term) can
    rise while the student's terms fall. Then ``cl`` as it is, H against ln K and the targets' information (the
    collapse rules' inputs, with the collapse named), the schedules and the speed."""
    cl = c.objective.cl
    h = r["teacher_entropy"]
    info = r["batch_entropy"] - h
    state = f" [{r['collapse']}]" if r["collapse"] else ""
    mfu = f" mfu {r['mfu']:.1%}" if "mfu" in r else ""
    return (
        f"[pretrain] step {step}/{c.steps} ep {r['epoch']} student loss {r['loss'] - c.objective.lambda_cl * h:.4f}"
        f" = mae {r['mae']:.4f} + {c.objective.lambda_cl:g} x kl {r['cl'] - h:.4f} + {cl.koleo:g} x koleo"
        f" {r['koleo']:.3f} | cl {r['cl']:.4f} = kl + targets H {h:.2f} of ln K {math.log(cl.prototypes):.3f},"
        f" info {info:.2f} of ln B {math.log(max(min(c.data.batch_size, cl.prototypes), 1)):.2f},"
        f" {r['proto_used']:.1f} protos, cls std/rms {r['cls_std'] / max(r['cls_rms'], 1e-12):.2f}{state}"
        f" | lr {r['lr']:.2e} gnorm {r['grad_norm']:.3f} m {r['momentum']:.4f}"
        f" | {r['images_per_s']:.1f} img/s {r['tokens_per_s']:.0f} tok/s, step {r['step_s']:.3f}s"
        f" = data {r['data_wait_s']:.3f}s + compute {r['compute_s']:.3f}s{mfu}"
    )


# An evaluation during the run (``probe``): called on every rank with the EMA teacher's backbone and the device;
# the rank told to score (rank 0) returns the figures, the others None. Built on each rank from the probe settings
# and the run's seed by the factory the job passes to ``fit`` (the frozen probe lives in ``finetune``, above us).
Evaluator = Callable[[Sapiens2Backbone, torch.device, bool], dict[str, float] | None]
EvaluatorFactory = Callable[[PretrainProbe, int], Evaluator]


def train_loop(loop_config: dict) -> None:
    """``TorchTrainer``'s ``train_loop_per_worker``: ``loop_config`` holds the config (as JSON data), the run URI,
    the data folder's URI as given and the evaluator factory, if any."""
    import ray.train

    cfg = PretrainConfig.model_validate(loop_config["config"])
    with failures.classified(loop_config["run_uri"], ray.train.get_context().get_world_rank()):
        worker = PretrainWorker(cfg, loop_config["run_uri"], loop_config.get("data_uri"), loop_config.get("evaluator"))
        worker.run()


class PretrainWorker(Worker[PretrainConfig]):
    job = "pretrain"
    scalar_groups = SCALAR_GROUPS
    hash_covers = "model (size, MAE decoder or projection head settings)"
    model: JointObjective

    def __init__(
        self, cfg: PretrainConfig, run_uri: str, data_uri: str | None = None, evaluator: EvaluatorFactory | None = None
    ) -> None:
        super().__init__(cfg, run_uri)
        self.model = build_model(cfg, self.device)
        self.trainer = Trainer(self.model, cfg, self.device, rank=self.rank, world=self.world)
        self.optimizer = self.trainer.optimizer
        self.index = data.load_index(run_uri, data_uri)
        misaligned = data.read_alignment(self.index, cfg.data.batch_size * cfg.optim.grad_accum)
        if misaligned and self.rank == 0:
            log_line(f"[pretrain] note: {misaligned}")
        self.position, self.samples_seen = data.DataPosition(), 0
        # the takedowns honoured (pretrain.takedowns), checked every data.takedown_check_minutes at metrics steps
        self.takedowns, self.removals = takedowns.Takedowns(), takedowns.Removals(self.index, None)
        self.takedowns_checked = -math.inf
        self.flops_per_image, self.tokens_per_image = train_flops_per_image(cfg)
        self.peak = peak_flops(cfg, self.device)
        self.evaluator = self._evaluator(evaluator)
        self.resume()

    # --- checkpoints ---

    def model_hash(self) -> str:
        return self.cfg.model_hash()

    def train_state(self) -> dict:
        return {
            "data_position": self.position.to_dict(),
            "samples_seen": self.samples_seen,
            "takedowns": self.takedowns.to_dict(),  # the position counts in the order without their rows
        }

    def summary(self, state: dict, group: dist.ProcessGroup | None) -> dict:
        return {"fingerprint": fingerprint(state, group)}

    def restore_state(self, commit: dict) -> dict:
        self.position = data.DataPosition(**commit["data_position"])
        self.samples_seen = commit["samples_seen"]
        self.takedowns = takedowns.Takedowns.from_dict(commit.get("takedowns"))
        self.removals = takedowns.Removals(self.index, self.takedowns)
        return {
            "saved_fingerprint": commit["fingerprint"],
            "fingerprint": fingerprint(checkpoint.checkpointed(self.model, self.optimizer)),
            "data_position": self.position.to_dict(),
        }

    # --- the loop ---

    def run(self) -> None:
        import ray.train

        c = self.cfg
        per_step = c.samples_per_step(self.world)
        self.check_takedowns(force=True)  # a resume too: the lists recorded since its checkpoint
        self.batches = self._stream()
        window = Window()
        self.collapse = CollapseMonitor(c.log.collapse_patience)
        preemption_saved = False
        while self.step < c.steps:
            waits: list[float] = []
            keys: list[str] = []
            reads: list[tuple[int, int, int]] = []
            terms, update = self.trainer.train_step(self.step, self._micro_batches(waits, keys, reads))
            self.take_host_peak()
            self.step += 1
            self.position = data.advance(self.position, per_step, data.kept_samples(self.index, self.removals))
            self.samples_seen += per_step
            window.add(terms, cast(Tensor, update["grad_norm"]), sum(waits, 0.0), reads)
            self._fault_drill()
            if c.log.record_keys:
                self._record_keys(keys)
            if self.step % c.log.every == 0 or self.step == c.steps:
                schedule = {k: float(update[k]) for k in ("lr", "wd", "momentum")}
                self._log_window(window, **schedule)
                window = Window()
                if self.step < c.steps:
                    self.check_takedowns()
            self.poll_save()  # after the step's metrics: a commit rolls the metrics log to the next step
            if self.evaluator and (self.step % c.probe.every == 0 or self.step == c.steps):
                self._evaluate()
            if self.step % c.checkpoint.every == 0 or self.step == c.steps:
                self.save()
            elif c.checkpoint.on_preemption and self.step % c.checkpoint.preemption_check_every == 0:
                notice = ray.train.get_preemption_info()  # a barrier: every rank asks at the same steps
                if notice is not None and not preemption_saved:
                    self.save(reason="preemption")  # then train on until the node goes
                    preemption_saved = True
        self.finish_save()
        if self.log:
            self.log.close()

    # --- evaluations during the run ---

    def _evaluator(self, factory: EvaluatorFactory | None) -> Evaluator | None:
        """The run's evaluator, or None when ``probe.every`` is 0, no factory was given, or a rank could not build
        it (its probe data unreadable): all ranks agree, since each evaluation is a collective of them all."""
        if not (self.cfg.probe.every and factory):
            return None
        built: Evaluator | None = None
        try:
            built = factory(self.cfg.probe, self.cfg.seed)
        except Exception as exc:  # noqa: BLE001 - an evaluation never stops the run
            log_line(f"[pretrain] probe off: rank {self.rank} could not read probe.data: {exc}")
        ready = torch.tensor([float(built is not None)], device=self.device)
        dist.all_reduce(ready, op=dist.ReduceOp.MIN)
        return built if ready.item() else None

    def _evaluate(self) -> None:
        """The evaluator on the EMA teacher; its figures to the metrics log (rank 0). The root's own parameters
        (patch embedding, tokens, norms) are gathered around it: the teacher's backbone runs outside the root's
        forward, whose hooks would otherwise gather them. A failure is logged and training goes on."""
        assert self.evaluator is not None
        model = cast(FSDPModule, self.model)
        teacher = _teacher(self.model)
        scores: dict[str, float] | None = None
        try:
            model.unshard()
            scores = self.evaluator(teacher, self.device, self.rank == 0)
        except Exception as exc:  # noqa: BLE001 - an evaluation never stops the run
            log_line(f"[pretrain] probe at step {self.step} failed on rank {self.rank}, training goes on: {exc!r}")
        finally:
            model.reshard()
        if self.log and scores is not None:
            self.log.write({"kind": "eval", "step": self.step, "epoch": self.position.epoch, **scores})
            shown = ", ".join(f"{k} {v:.4f}" for k, v in scores.items() if k.endswith(("miou", "acc")))
            log_line(f"[pretrain] step {self.step} probe (EMA teacher): {shown}")

    # --- takedowns ---

    def _stream(self) -> Iterator[data.Batch]:
        c = self.cfg
        return data.stream(
            self.index, c, position=self.position, steps=c.steps - self.step, world=self.world, rank=self.rank,
            removals=self.removals,
        )  # fmt: skip

    def check_takedowns(self, force: bool = False) -> None:
        """Every rank at the same step: rank 0 reads the data's takedown records when due, and every rank takes its
        takedowns and position (a rank that met a deleted shard took the records on its own, maybe at another step),
        so all leave out the same rows."""
        due = time.monotonic() - self.takedowns_checked >= self.cfg.data.takedown_check_minutes * 60
        if self.rank == 0 and (force or due):
            self.takedowns_checked = time.monotonic()
            try:
                new = takedowns.update(self.takedowns, self.index)
            except Exception as exc:  # noqa: BLE001 - an unreadable record waits for the next check, training goes on
                log_line(f"[pretrain] takedown records unreadable, checked again later: {exc}")
                new = self.takedowns
            if new != self.takedowns:
                self._apply(new)
        # the small summary each time; the takedowns themselves only where a rank's differ
        device = self.device if self.device.type == "cuda" else None
        mine = (self.takedowns.seen, self.takedowns.removed, self.position)
        summary = [mine]
        dist.broadcast_object_list(summary, src=0, device=device)
        differs = torch.tensor([float(summary[0] != mine)], device=self.device)
        dist.all_reduce(differs, op=dist.ReduceOp.MAX)
        if not differs.item():
            return
        state = [self.takedowns]
        dist.broadcast_object_list(state, src=0, device=device)
        if self.rank != 0 and (state[0], summary[0][2]) != (self.takedowns, self.position):
            self.takedowns, self.removals = state[0], takedowns.Removals(self.index, state[0])
            self.position = summary[0][2]
            self.batches = self._stream()

    def _apply(self, new: takedowns.Takedowns) -> None:
        """Leave out the rows ``new`` removes from the step being taken on: the position moves past none of the
        others, and the stream starts again from it."""
        removals = takedowns.Removals(self.index, new)
        c = self.cfg
        self.position = data.rebase(self.position, self.index, c.seed, c.data.shuffle, self.removals, removals)
        if self.rank == 0:
            log_line(
                f"[pretrain] takedowns: {new.removed - self.takedowns.removed} more images of the data removed, "
                f"skipped from step {self.step + 1} on ({new.removed} in all)"
            )
        self.takedowns, self.removals = new, removals
        self.batches = self._stream()

    # --- pieces of a step ---

    def _micro_batches(
        self, waits: list[float], keys: list[str], reads: list[tuple[int, int, int]]
    ) -> Iterator[Tensor]:
        """A step's micro-batches on the device, each read from the stream when the step takes it; the wait for
        each goes to ``waits``, its sample keys to ``keys``, its bytes read, images' bytes and the images taken down
        in their places to ``reads``. A shard a takedown replaced and deleted (``--grace-minutes 0``) before the
        next check: this rank reads the records now and reads the step's other micro-batches from the new shards."""
        micro = 0
        while micro < self.cfg.optim.grad_accum:
            t = time.perf_counter()
            try:
                batch = next(self.batches)
            except Exception as exc:
                if not data.shard_gone(exc):
                    raise
                new = takedowns.update(self.takedowns, self.index)
                if new == self.takedowns:
                    raise  # gone, and no takedown says why: open_shard's message
                self._apply(new)
                for _ in range(micro):  # this step's micro-batches already trained on
                    next(self.batches)
                continue
            waits.append(time.perf_counter() - t)
            keys += batch.keys
            reads.append((batch.read_bytes, batch.image_bytes, batch.taken_down_skipped))
            micro += 1
            yield data.to_device(batch.images, self.device)

    def _record_keys(self, keys: list[str]) -> None:
        gathered: list[list[str]] = [[] for _ in range(self.world)]
        dist.all_gather_object(gathered, keys)
        if self.log:
            self.log.write({"kind": "samples", "step": self.step, "epoch": self.position.epoch, "keys": gathered})

    def _log_window(self, window: Window, **schedule: float) -> None:
        c = self.cfg
        # Reduced on the training device (NCCL reduces only GPU tensors): means of the loss terms, diagnostics and
        # grad norm, mean and max of the data wait per step over ranks. Every rank gets the same means, so every
        # rank's collapse monitor agrees (rank 0 writes).
        assert window.terms is not None and window.grad_norm is not None  # logged after at least one step
        stats = torch.cat([window.terms, window.grad_norm.view(1)]).float() / (window.steps * self.world)
        wait = torch.full((2,), window.data_wait / window.steps, device=self.device)
        dist.all_reduce(stats)
        dist.all_reduce(wait[0:1])
        dist.all_reduce(wait[1:2], op=dist.ReduceOp.MAX)
        # float64 counts: exact up to 2^53 bytes per window
        read = torch.tensor(
            [window.read_bytes, window.image_bytes, window.taken_down_skipped], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(read)
        means, waits, reads = stats.tolist(), wait.tolist(), [int(b) for b in read.tolist()]
        step_s = (time.perf_counter() - window.started) / window.steps
        images_per_s = c.samples_per_step(self.world) / step_s
        wait_mean, wait_max = waits[0] / self.world, waits[1]
        terms = dict(zip(TERMS, means))
        record = {
            "kind": "train",
            "step": self.step,
            "epoch": self.position.epoch,
            "samples_seen": self.samples_seen,
            **terms,
            "grad_norm": means[len(TERMS)],
            "collapse": collapse_state(terms, c.objective.cl.prototypes, c.data.batch_size),  # this window's
            **schedule,
            "images_per_s": images_per_s,
            "tokens_per_s": images_per_s * self.tokens_per_image,
            "step_s": step_s,
            "data_wait_s": wait_mean,
            "data_wait_max_s": wait_max,
            "compute_s": step_s - wait_mean,
            "data_wait_frac": wait_mean / step_s,
            "read_amplification": data.read_amplification(reads[0], reads[1]),
            "taken_down_skipped": reads[2],
        }
        if self.peak:
            record["mfu"] = images_per_s * self.flops_per_image / (self.world * self.peak)
        record.update(self.host_peak_field())
        change = self.collapse.update(record["collapse"], self.step - window.steps, self.step)
        if self.log:
            self.log.write(record)
            log_line(console_line(c, self.step, record))
            if change:
                self._log_collapse(*change)

    def _log_collapse(self, state: str | None, since: int) -> None:
        """A collapse (or its end) that has lasted ``log.collapse_patience`` steps: a warning and a record."""
        assert self.log is not None  # called by rank 0 only, which holds the log
        ended = state is None
        self.log.write({"kind": "collapse", "step": self.step, "state": state, "since": since, "ended": ended})
        if ended:
            log_line(f"[pretrain] collapse ended: healthy since step {since}")
        else:
            log_line(
                f"[pretrain] WARNING: self-distillation collapse ({state}) since step {since}: the contrastive "
                "term teaches nothing while it lasts (see README, Pretraining)"
            )

    def save(self, reason: str = "interval") -> None:
        if self.cfg.fault.disk_full_at_step == self.step:  # the drill: this rank's shard file is /dev/full
            _, path = storage.resolve(checkpoint.step_uri(self.run_uri, self.step))
            os.makedirs(path, exist_ok=True)
            os.symlink("/dev/full", os.path.join(path, f"__{self.rank}_0.distcp"))
        super().save(reason)

    def _fault_drill(self) -> None:
        f = self.cfg.fault
        if f.kill_at_step != self.step or f.kill_rank != self.rank:
            return
        fs, root = storage.resolve(self.run_uri)
        marker = storage.join(root, f"_fault-drill-step-{self.step}")
        if storage.exists(fs, marker):
            return
        storage.write_bytes_atomic(fs, marker, b"")
        log_line(f"[pretrain] fault drill: killing rank {self.rank} (pid {os.getpid()}) at step {self.step}")
        os.kill(os.getpid(), signal.SIGKILL)


# --- the driver side --------------------------------------------------------------------------------------------------


def fit(
    cfg: PretrainConfig,
    storage_path: str,
    name: str,
    data_uri: str | None = None,
    evaluator: EvaluatorFactory | None = None,
):
    """Run (or resume) the training run ``name`` under ``storage_path`` on the connected Ray cluster; ``data_uri``
    opens the data (default: the folder name the run's index recorded, enough unless its URI carries a query);
    ``evaluator`` builds the evaluation that ``probe.every`` runs (a module-level callable: Ray sends it by name)."""
    config = {
        "config": cfg.model_dump(mode="json"),
        "run_uri": run_uri_for(storage_path, name),
        "data_uri": data_uri,
        "evaluator": evaluator,
    }
    reader = {"the data reader (data.read_cpus)": {"CPU": cfg.data.read_cpus}}  # each worker's Ray Data tasks
    return launch(train_loop, config, cfg.ray, storage_path, name, requests=reader)
