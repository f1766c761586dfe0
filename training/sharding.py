"""FSDP2 over the worker group, and the optimiser step on its sharded parameters.

On GPU with ``precision: bf16`` parameters are gathered and computed in bf16 and gradients reduced in fp32; on CPU
(gloo) everything stays fp32. The units are given as chains: lists of modules in forward order, each unit feeding
the next (one stack of blocks), the chains in the order their first unit runs. Prefetch follows each chain and
stops at its end: what runs after a chain's last unit is another chain (another stack, a head, the teacher's own
no-grad forward), not the next unit of a flat list. ``reshard_after_forward: default`` keeps the last unit with
trainable parameters in that order gathered, the one whose backward runs first.

The mesh (``device_mesh``) is flat or HSDP (``fsdp.replicate`` x ``fsdp.shard``); nothing else depends on its shape.
Every rank is a data-parallel rank either way: it reads its own images, and the objective's batch statistics reduce
over the whole world. The EMA update and AdamW run on the local shards; the gradient norm is a DTensor reduction
(over the shard dimension only: the replicas hold the same shards); DCP checkpoints hold global tensors, so one
written on one mesh loads onto another. Sums of local shards go through ``sum_over_shards``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from training.config import FsdpSettings

M = TypeVar("M", bound=nn.Module)
Chains = Sequence[Sequence[nn.Module]]
REPLICATE, SHARD = "dp_replicate", "dp_shard"  # the mesh's dimensions (torchtitan's names)


def mixed_precision(device: torch.device, precision: str) -> MixedPrecisionPolicy:
    """bf16 parameters and compute, fp32 gradient reduction, on GPUs when asked; fp32 otherwise."""
    if device.type == "cuda" and precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard(model: M, chains: Chains, device: torch.device, precision: str, settings: FsdpSettings | None = None) -> M:
    """FSDP2 over the process group on ``device_mesh`` (flat, or HSDP by ``fsdp.replicate`` x ``fsdp.shard``): one
    ``fully_shard`` per unit of ``chains``, then the root (the parameters left over, and the move to ``device``);
    bf16 parameters and compute with fp32 gradient reduction on GPUs when asked; then ``configure_fsdp`` with
    ``settings`` (default: FSDP2's own behaviour)."""
    settings = settings or FsdpSettings()
    mp = mixed_precision(device, precision)
    mesh = device_mesh(device, settings)
    for chain in chains:
        for unit in chain:
            fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    configure_fsdp(chains, settings)
    return model


def device_mesh(device: torch.device, settings: FsdpSettings) -> DeviceMesh:
    """The data-parallel mesh of the process group: 1-D (``SHARD``) when flat, else ``REPLICATE`` x ``SHARD`` (HSDP:
    ``fully_shard`` shards over the last dimension and replicates over the first); a ``ValueError`` when the degrees
    do not fit the world size."""
    shape = settings.mesh_shape(dist.get_world_size())
    if shape[0] == 1:
        return init_device_mesh(device.type, shape[1:], mesh_dim_names=(SHARD,))
    return init_device_mesh(device.type, shape, mesh_dim_names=(REPLICATE, SHARD))


def sum_over_shards(local: Tensor, like: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Sum ``local``, computed from this rank's shards of parameters sharded as ``like``, over the ranks holding the
    other shards, each shard counted once (HSDP's replica groups hold the same shards); in place, returned.
    ``group``: a group of every rank to reduce over instead (a background save's own), the replicas then divided
    out."""
    mesh = like.device_mesh if isinstance(like, DTensor) else None
    if group is not None:
        dist.all_reduce(local, group=group)
        local /= mesh.size(0) if mesh is not None and mesh.ndim == 2 else 1
    elif mesh is not None:
        dist.all_reduce(local, group=mesh.get_group(SHARD))
    return local


def configure_fsdp(chains: Chains, settings: FsdpSettings) -> None:
    """Apply ``settings`` to the units of ``chains`` (already sharded; any earlier settings are replaced).

    The root keeps FSDP2's choice (gathered from forward to backward: its backward is the first to run). Units
    without trainable parameters always reshard after forward: nothing gathers them for a backward, and kept
    gathered they would stay so until the end of the backward (FSDP2 reshards them only in its final callback).
    Prefetch above 1 sets explicit lists along each chain; 1 clears them. Where a list is empty (prefetch 1; a chain's
    last unit in forward, its first in backward) FSDP2 keeps its implicit order: nothing ahead in forward, in
    backward the unit whose forward ended just before."""
    units = [_fsdp_unit(unit) for chain in chains for unit in chain]
    trained = [u for u in units if any(p.requires_grad for p in cast(nn.Module, u).parameters())]
    policy = settings.reshard_after_forward
    kept = trained if policy == "never" else trained[-1:] if policy == "default" else []
    for unit in units:
        unit.set_reshard_after_forward(unit not in kept, recurse=False)
    ahead = settings.prefetch if settings.prefetch > 1 else 0
    for chain in chains:
        fsdp_chain = [_fsdp_unit(unit) for unit in chain]
        for i, unit in enumerate(fsdp_chain):
            unit.set_modules_to_forward_prefetch(fsdp_chain[i + 1 : i + 1 + ahead])
            unit.set_modules_to_backward_prefetch(fsdp_chain[max(i - ahead, 0) : i][::-1])


def _fsdp_unit(module: nn.Module) -> FSDPModule:
    if not isinstance(module, FSDPModule):
        raise TypeError(f"{type(module).__name__} is not sharded: configure_fsdp takes the units shard has sharded")
    return module


def local_region(param: Tensor) -> tuple[slice, ...]:
    """The part of ``param``'s full tensor this rank holds: its shard of a DTensor (DCP's own arithmetic, so any
    placement), all of a plain tensor."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def write_local(param: Tensor, part: Tensor) -> None:
    """Copy ``part`` (this rank's ``local_region`` of the full tensor, on any device) into ``param``'s local data."""
    (param.to_local() if isinstance(param, DTensor) else param).copy_(part)


@torch.no_grad()
def write_full(param: Tensor, full: Tensor) -> None:
    """Copy this rank's part of ``full`` (the whole tensor) into ``param``."""
    write_local(param, full[local_region(param)])


@torch.no_grad()
def copy_module(dst: nn.Module, src: nn.Module) -> None:
    """Every parameter (this rank's part of it) and buffer of ``src``, a plain module, into ``dst``'s of the same
    name (``dst`` sharded or not)."""
    for name, p in src.named_parameters():
        write_full(dst.get_parameter(name), p)
    for name, b in src.named_buffers():
        dst.get_buffer(name).copy_(b)


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
