"""FSDP2's settings on CPU with gloo: reshard-after-forward and prefetch (``training.sharding.configure_fsdp``) reach
every unit along its own chain, change on a model already sharded, and leave what a step computes as it is; an HSDP
mesh (``fsdp.replicate`` x ``fsdp.shard``) trains what the flat one does, and loads its checkpoints."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from common.config import ConfigError, load_config
from finetune.config import FinetuneConfig
from finetune.data import LabelInfo
from finetune.train import build_model as build_finetune_model
from finetune.train import fsdp_chains as finetune_chains
from finetune.train import make_task
from pretrain.config import PretrainConfig
from pretrain.train import Trainer, build_model, fingerprint, fsdp_chains
from training import checkpoint
from training.config import FsdpSettings
from training.runner import check_run, claim_run
from training.sharding import configure_fsdp, device_mesh

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/pretrain/tiny.yaml"
CPU = torch.device("cpu")
SMALL = ["ray.workers=1", "data.batch_size=2", "optim.grad_accum=2", "objective.views.local_size=[32,32]"]
SETTINGS = list(itertools.product(["always", "default", "never"], [1, 2]))


@pytest.fixture
def world_of_one():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend (5x slower on 2 busy cores)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def sharded(units: list[nn.Module]) -> list[bool]:
    """Whether each unit holds its sharded parameters (DTensors) rather than gathered ones."""
    return [isinstance(next(u.parameters()), DTensor) for u in units]


def two_steps(
    reshard: str, prefetch: int, rank: int = 0, reduce_every: bool = True
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss terms of 2 pretraining steps of 2 micro-batches and the full parameters after them."""
    fsdp = [f"fsdp.reshard_after_forward={reshard}", f"fsdp.prefetch={prefetch}"]
    fsdp.append(f"fsdp.reduce_every_micro_batch={reduce_every}")
    cfg = load_config(PretrainConfig, TINY, [*SMALL, *fsdp])
    model = build_model(cfg, CPU)
    trainer = Trainer(model, cfg, CPU, rank=rank, world=dist.get_world_size())
    g = torch.Generator().manual_seed(rank)
    images = torch.randint(0, 256, (2, 2, 3, *cfg.image_size), dtype=torch.uint8, generator=g)
    terms = torch.stack([trainer.train_step(step, iter(images))[0] for step in range(2)])
    return terms, [p.detach().full_tensor() for p in model.parameters()]


def test_every_setting_trains_the_same_steps(world_of_one):
    reference_terms, reference_params = two_steps("always", 1)
    for reshard, prefetch in SETTINGS[1:]:
        terms, params = two_steps(reshard, prefetch)
        assert torch.equal(terms, reference_terms), (reshard, prefetch)
        assert all(torch.equal(a, b) for a, b in zip(params, reference_params, strict=True)), (reshard, prefetch)


# Two ranks: real all-gathers, so prefetch and resharding move data. Each rank runs every setting and saves what it
# got; the parent compares them across the settings and the ranks.
RANK = """
import sys, torch, torch.distributed as dist
from tests.training.test_sharding import SETTINGS, two_steps
store, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
results = {s: two_steps(*s, rank=rank) for s in SETTINGS}
results["held"] = two_steps("always", 1, rank=rank, reduce_every=False)
torch.save(results, out)
dist.barrier()  # neither rank tears its connections down while the other still uses them
dist.destroy_process_group()
"""


def test_every_setting_trains_the_same_steps_on_two_ranks(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "store"), str(r), str(out)], cwd=REPO, env=env)
        for r, out in enumerate(outs)
    ]
    try:
        assert [p.wait(timeout=120) for p in ranks] == [0, 0]
    finally:
        for p in ranks:
            p.kill()
    results = [torch.load(out) for out in outs]
    reference_terms, reference_params = results[0][SETTINGS[0]]
    for rank, setting in itertools.product(range(2), SETTINGS):
        terms, params = results[rank][setting]
        if rank == 0:  # each rank has its own images, so its own loss
            assert torch.equal(terms, reference_terms), setting
        assert all(torch.equal(a, b) for a, b in zip(params, reference_params, strict=True)), (rank, setting)
    # Gradients held unsharded until the last micro-batch: the same sums in another order
    for rank in range(2):
        terms, params = results[rank]["held"]
        assert torch.allclose(terms, results[rank][SETTINGS[0]][0], rtol=1e-5, atol=1e-6)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(params, reference_params, strict=True))


def mesh_steps(rank: int, fsdp: list[str], uri: str) -> tuple[dict, nn.Module, torch.optim.Optimizer]:
    """3 pretraining steps of 2 micro-batches on 4 ranks with the mesh ``fsdp`` sets. The flat mesh saves a
    checkpoint to ``uri`` before step 2; any other loads it there (its own state after the same 2 steps, within
    float tolerance), so step 2 starts from the same bits on both. Returns each step's loss terms and gradient norm,
    the fingerprint at step 2, the mesh, the full parameters at the end; and the model and its optimiser."""
    cfg = load_config(PretrainConfig, TINY, [*SMALL, "ray.workers=4", *fsdp])
    model = build_model(cfg, CPU)
    trainer = Trainer(model, cfg, CPU, rank=rank, world=dist.get_world_size())
    g = torch.Generator().manual_seed(rank)
    images = torch.randint(0, 256, (3, 2, 2, 3, *cfg.image_size), dtype=torch.uint8, generator=g)  # step, micro
    steps = []
    for step in range(3):
        if step == 2:
            if fsdp:
                checkpoint.load(uri, model, trainer.optimizer)
            else:
                checkpoint.save(uri, model, trainer.optimizer, {"step": step})
            at_two = fingerprint(checkpoint.checkpointed(model, trainer.optimizer))
        terms, update = trainer.train_step(step, iter(images[step]))
        steps.append(torch.cat([terms, update["grad_norm"].view(1)]))
    mesh = next(model.parameters()).device_mesh
    found = {
        "steps": torch.stack(steps),
        "fingerprint": at_two,
        "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)),
        "params": [p.detach().full_tensor() for p in model.parameters()],
    }
    return found, model, trainer.optimizer


def flat_and_hsdp(rank: int, folder: str) -> dict:
    """Flat over 4, then 2 x 2 resuming the flat checkpoint (``mesh_steps``); then the 2 x 2 checkpoint of the end
    read back by the flat model, with the fingerprints of both."""
    flat, flat_model, flat_optimizer = mesh_steps(rank, [], f"{folder}/flat")
    hsdp, model, optimizer = mesh_steps(rank, ["fsdp.replicate=2", "fsdp.shard=2"], f"{folder}/flat")
    uri = f"{folder}/hsdp"
    checkpoint.save(uri, model, optimizer, {"step": 3})  # each replicated shard written by one rank (DCP's dedup)
    problems = checkpoint.verify(uri, checkpoint.read_commit(uri))
    checkpoint.load(uri, flat_model, flat_optimizer)
    back = [fingerprint(checkpoint.checkpointed(m, o)) for m, o in ((model, optimizer), (flat_model, flat_optimizer))]
    return {"flat": flat, "hsdp": hsdp, "problems": problems, "back": back}


# Four ranks, flat then 2 x 2 in the same process group.
MESH_RANK = """
import sys, torch, torch.distributed as dist
from tests.training.test_sharding import flat_and_hsdp
store, rank, folder, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group("gloo", store=dist.FileStore(store, 4), rank=rank, world_size=4)
torch.save(flat_and_hsdp(rank, folder), out)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow  # 4 processes on 2 cores
def test_hsdp_trains_what_flat_fsdp_trains_and_their_checkpoints_load_across(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    outs = [tmp_path / f"rank{r}.pt" for r in range(4)]
    args = [sys.executable, "-c", MESH_RANK, str(tmp_path / "store")]
    ranks = [
        subprocess.Popen([*args, str(r), str(tmp_path), str(out)], cwd=REPO, env=env) for r, out in enumerate(outs)
    ]
    try:
        assert [p.wait(timeout=300) for p in ranks] == [0] * 4
    finally:
        for p in ranks:
            p.kill()
    for out in outs:
        found = torch.load(out)
        flat, hsdp = found["flat"], found["hsdp"]
        assert flat["mesh"] == {"dp_shard": 4} and hsdp["mesh"] == {"dp_replicate": 2, "dp_shard": 2}
        # the same losses and gradient norms on every rank: steps 0 and 1 from the same seed, step 2 from the
        # flat mesh's checkpoint; sums and reductions in another order differ by float rounding only
        torch.testing.assert_close(hsdp["steps"], flat["steps"])
        assert hsdp["fingerprint"] == pytest.approx(flat["fingerprint"], rel=1e-12)
        for a, b in zip(hsdp["params"], flat["params"], strict=True):
            torch.testing.assert_close(a, b)
        assert found["problems"] == []
        saved, loaded = found["back"]
        assert loaded == pytest.approx(saved, rel=1e-12)


def test_the_mesh_must_fit_the_world(world_of_one):
    with pytest.raises(ValueError, match=r"^fsdp.replicate=2 x fsdp.shard=-1 does not fit 1 worker\(s\)"):
        device_mesh(CPU, FsdpSettings(replicate=2))


def test_the_settings_reach_each_unit_and_change_on_a_sharded_model(world_of_one):
    cfg = load_config(PretrainConfig, TINY, SMALL)
    model = build_model(cfg, CPU)
    student, decoder, head, teacher = chains = fsdp_chains(model)
    assert head == [model.head] and teacher[-1] is model.teacher["head"]
    images = torch.randint(0, 256, (2, 3, *cfg.image_size), dtype=torch.uint8)
    gathered_after_forward = {
        # the no-grad teacher always reshards: nothing would gather it again, it would only be held to the backward
        "always": ([True] * len(student), [True] * len(decoder), [True], [True] * len(teacher)),
        "default": ([True] * len(student), [True] * len(decoder), [False], [True] * len(teacher)),
        "never": ([False] * len(student), [False] * len(decoder), [False], [True] * len(teacher)),
    }
    for reshard in ["never", "default", "always"]:  # the model built with "always", then changed
        configure_fsdp(chains, FsdpSettings(reshard_after_forward=reshard))
        out = model(images, 0)
        assert tuple(sharded(c) for c in chains) == gathered_after_forward[reshard], reshard
        out["loss"].backward()
        assert all(all(sharded(c)) for c in chains), reshard  # every unit sharded again for the optimiser and EMA

    def prefetch_lists(unit: nn.Module) -> tuple[list, list]:
        state = unit._get_fsdp_state()
        return state._states_to_forward_prefetch, state._states_to_backward_prefetch

    def states(units: list[nn.Module]) -> list:
        return [u._get_fsdp_state() for u in units]

    configure_fsdp(chains, FsdpSettings(prefetch=3))
    for chain in chains:
        for i, unit in enumerate(chain):
            forward, backward = prefetch_lists(unit)
            assert forward == states(chain[i + 1 : i + 4])  # the next 3 of its own chain, none past its end
            assert backward == states(chain[max(i - 3, 0) : i][::-1])  # the 3 before it, nearest first
    assert prefetch_lists(student[-1]) == ([], states(student[-2::-1])) and prefetch_lists(head[0]) == ([], [])
    configure_fsdp(chains, FsdpSettings(prefetch=1))  # back to FSDP2's implicit order
    assert all(prefetch_lists(u) == ([], []) for chain in chains for u in chain)


@pytest.mark.parametrize("frozen", [False, True])
def test_finetuning_shards_blocks_then_head_as_one_chain(world_of_one, frozen):
    cfg = load_config(FinetuneConfig, REPO / "configs/finetune/tiny.yaml",
                      ["head.class_weights=null", f"optim.freeze_backbone={str(frozen).lower()}",
                       "fsdp.reshard_after_forward=never", "fsdp.prefetch=2"])  # fmt: skip
    labels = LabelInfo(parts=("background", "skin", "clothes"), keypoint_names=("a", "b", "c"),
                       keypoint_sigmas=(0.05, 0.05, 0.05), image_size=(128, 96))  # fmt: skip
    model = build_finetune_model(cfg, make_task("seg", cfg, labels, cfg.model.backbone()), None, CPU)
    [chain] = finetune_chains(model)
    assert chain == [*model.backbone.all_blocks, model.head]
    model(torch.randint(0, 256, (1, 3, 128, 96), dtype=torch.uint8))
    # a frozen backbone has no backward to keep its blocks gathered for
    assert sharded(chain) == [frozen] * len(model.backbone.all_blocks) + [False]
    assert chain[-2]._get_fsdp_state()._states_to_forward_prefetch == [chain[-1]._get_fsdp_state()]


def test_the_settings_are_checked_with_a_clear_message():
    cfg = load_config(PretrainConfig, TINY, ["fsdp.reshard_after_forward=default", "fsdp.prefetch=4"])
    assert cfg.fsdp == FsdpSettings(reshard_after_forward="default", prefetch=4)
    assert load_config(PretrainConfig, TINY).fsdp == FsdpSettings(reshard_after_forward="always", prefetch=1)
    with pytest.raises(ConfigError, match=r"reshard_after_forward: Input should be 'always', 'default' or 'never'"):
        load_config(PretrainConfig, TINY, ["fsdp.reshard_after_forward=sometimes"])
    with pytest.raises(ConfigError, match=r"fsdp.prefetch: Input should be greater than or equal to 1 \(got 0\)"):
        load_config(PretrainConfig, TINY, ["fsdp.prefetch=0"])
    with pytest.raises(ConfigError, match=r"fsdp.gather: unknown key"):
        load_config(FinetuneConfig, REPO / "configs/finetune/tiny.yaml", ["fsdp.gather=2"])


def test_the_mesh_degrees_are_checked_against_the_workers():
    def mesh(*overrides: str) -> tuple[int, int]:
        return load_config(PretrainConfig, TINY, ["ray.workers=8", *overrides]).fsdp.mesh_shape(8)

    assert mesh() == (1, 8)  # flat, as before there were degrees
    assert mesh("fsdp.replicate=2") == mesh("fsdp.replicate=-1", "fsdp.shard=4") == (2, 4)
    assert mesh("fsdp.replicate=2", "fsdp.shard=4") == (2, 4) and mesh("fsdp.replicate=8") == (8, 1)
    for bad in (["fsdp.replicate=3"], ["fsdp.replicate=2", "fsdp.shard=2"], ["fsdp.replicate=-1", "fsdp.shard=16"]):
        with pytest.raises(ConfigError, match=r"<root>: fsdp.replicate=\S+ x fsdp.shard=\S+ does not fit 8 worker"):
            mesh(*bad)
    with pytest.raises(ConfigError, match=r"fsdp: fsdp.replicate and fsdp.shard are both -1"):
        mesh("fsdp.replicate=-1")
    with pytest.raises(ConfigError, match=r"fsdp.shard: Value error, a degree is -1 .* \(got 0\)"):
        mesh("fsdp.shard=0")


@pytest.mark.parametrize("config", [PretrainConfig, FinetuneConfig])
def test_a_resume_may_change_the_fsdp_settings(tmp_path, config):
    path = TINY if config is PretrainConfig else REPO / "configs/finetune/tiny.yaml"
    before = load_config(config, path)
    identity = {"data": "/d"}
    assert claim_run(str(tmp_path), identity, before.result_settings()) is None
    after = load_config(config, path, ["fsdp.reshard_after_forward=never", "fsdp.prefetch=3",
                                     "fsdp.replicate=-1", "fsdp.shard=1"])  # fmt: skip
    assert not any(k.startswith("fsdp") for k in after.result_settings())
    assert check_run(str(tmp_path), identity, after.result_settings()) == {}
