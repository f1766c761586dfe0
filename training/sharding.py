"""FSDP2 over the worker group, and the optimiser step on its sharded parameters.

On GPU with ``precision: bf16`` parameters are gathered and computed in bf16 and gradients reduced in fp32; on CPU
(gloo) everything stays fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

M = TypeVar("M", bound=nn.Module)


def mixed_precision(device: torch.device, precision: str) -> MixedPrecisionPolicy:
    """bf16 parameters and compute, fp32 gradient reduction, on GPUs when asked; fp32 otherwise."""
    if device.type == "cuda" and precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard(model: M, units: list[nn.Module], device: torch.device, precision: str) -> M:
    """FSDP2 over the process group: one ``fully_shard`` per unit, then the root (the parameters left over, and the
    move to ``device``); bf16 parameters and compute with fp32 gradient reduction on GPUs when asked."""
    mp = mixed_precision(device, precision)
    mesh = dist.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def optimizer_step(optimizer: torch.optim.Optimizer, params: Sequence[Tensor], grad_clip: float | None) -> Tensor:
    """Clip the gradients to ``grad_clip`` (global norm over every shard), step, clear; returns the norm before
    clipping as a plain tensor."""
    grads = [p.grad for p in params if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if grad_clip is not None:
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, grad_norm, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return (grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm).detach()
