import collections
import dataclasses
import functools
import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint
from torch.utils.flop_counter import FlopCounterMode

from common.config import load_config
from finetune import tasks
from finetune.config import FinetuneConfig
from finetune.data import LabelInfo
from finetune.train import (
    build_model,
    build_optimizer,
    feature_stride,
    layer_id,
    make_task,
    output_size,
    set_schedule,
)
from pretrain import backbone
from pretrain.backbone import (
    CARD,
    CHECKPOINTING,
    LOCAL_DEPTH,
    SIZES,
    Attention,
    BackboneConfig,
    Sapiens2Backbone,
    apply_rope,
    build,
    count_params,
    flops,
    grid_coords,
    init_streamed,
    rope_tables,
)
from pretrain.export import BACKBONE_FILE, export_backbone, load_backbone
from training import checkpoint as ckpt

TINY = SIZES["tiny"]
FINETUNE_TINY = Path(__file__).resolve().parents[2] / "configs/finetune/tiny.yaml"


def _model(cfg: BackboneConfig, seed: int = 0) -> Sapiens2Backbone:
    torch.manual_seed(seed)
    model = Sapiens2Backbone(cfg).eval()
    with torch.no_grad():  # layer scales of 1.0 so that every block visibly shapes the output
        for blk in model.all_blocks:
            blk.ls1.fill_(1.0)
            if blk.ls2 is not None:
                blk.ls2.fill_(1.0)
    return model


def _outputs(out) -> torch.Tensor:
    return torch.cat([out.cls[:, None], out.registers, out.patches], dim=1)


def _perturb_outside(images: torch.Tensor, keep: torch.Tensor, patch: int) -> torch.Tensor:
    """Replace every patch not listed in keep with fresh noise."""
    B, _, H, W = images.shape
    gw = W // patch
    kept = torch.zeros(B, (H // patch) * gw, dtype=torch.bool).scatter_(1, keep, True)
    kept = kept.view(B, 1, H // patch, 1, gw, 1).expand(-1, 3, -1, patch, -1, patch).reshape(B, 3, H, W)
    return torch.where(kept, images, torch.randn_like(images) * 5)


@pytest.mark.parametrize("name", ["tiny", "tiny-4k", "tiny-gqa"])
def test_the_streamed_init_draws_the_seeded_build_one_module_at_a_time(name):
    cfg = dataclasses.replace(SIZES[name], ffn_layer_scale=True)  # every kind of parameter
    torch.manual_seed(3)
    want, after = build(cfg).state_dict(), torch.rand(4)
    torch.manual_seed(3)
    got: dict[str, torch.Tensor] = {}
    init_streamed(cfg, lambda name, full: got.setdefault(name, full.clone()))
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    assert torch.equal(torch.rand(4), after)  # the generator left where the plain build leaves it


@pytest.mark.parametrize("name", sorted(SIZES))
def test_every_size_shapes_on_meta(name):
    cfg = SIZES[name]
    model = build(cfg, "meta")
    H, W = (4096, 3072) if cfg.window else (1024, 768)
    out = model(torch.empty(2, 3, H, W, device="meta"))
    assert model.patch_grid(H, W) == (H // 16, W // 16)
    assert out.grid == model.token_grid(H, W) == (64, 48)  # 4K: 256x192 patches pooled to 64x48 tokens
    assert out.cls.shape == (2, cfg.width)
    assert out.registers.shape == (2, 8, cfg.width)
    assert out.patches.shape == (2, 64 * 48, cfg.width)
    assert out.keep is None and out.featmap().shape == (2, cfg.width, 64, 48)
    if not cfg.window:  # the masked path: only the visible quarter of the patches
        keep = torch.empty(2, 768, dtype=torch.long, device="meta")
        assert model(torch.empty(2, 3, H, W, device="meta"), keep).patches.shape == (2, 768, cfg.width)


@pytest.mark.parametrize("name", sorted(CARD))
def test_parameter_counts_match_the_card(name):
    n = count_params(name)
    assert abs(n / CARD[name][0] - 1) < 0.01, (name, n)
    # the 4K variant adds its windowed blocks (full multi-head attention) and the pooling offset
    cfg = SIZES[f"{name}-4k"]
    mhsa_block = sum(p.numel() for p in build(dataclasses.replace(cfg, depth=1, window=None, local_depth=0),
                                              "meta").blocks.parameters())  # fmt: skip
    assert count_params(cfg) == n + cfg.local_depth * mhsa_block + cfg.width


@pytest.mark.parametrize("name", sorted(k.removesuffix("-4k") for k in SIZES if k.endswith("-4k")))
def test_4k_adds_windowed_blocks_in_front_of_the_base_depth(name):
    base, cfg = SIZES[name], SIZES[f"{name}-4k"]
    model = build(cfg, "meta")
    assert len(model.blocks) == cfg.depth == base.depth  # every global block of the base size
    assert len(model.local_blocks) == cfg.local_depth == LOCAL_DEPTH[name] > 0
    assert cfg.total_depth == base.depth + LOCAL_DEPTH[name] and len(model.all_blocks) == cfg.total_depth
    assert model.all_blocks[0] is model.local_blocks[0] and model.all_blocks[-1] is model.blocks[-1]
    assert count_params(cfg) > count_params(base)
    # the global blocks are the base's, weight for weight: a base checkpoint fills them
    base_shapes = {k: v.shape for k, v in build(base, "meta").state_dict().items()}
    shapes = {k: v.shape for k, v in model.state_dict().items() if not k.startswith(("local_blocks.", "window_"))}
    assert shapes == base_shapes


def test_flops_match_the_card_for_5b_and_stay_close_for_the_rest():
    assert abs(flops("5b") / CARD["5b"][1] - 1) < 0.03
    for name, (_, card) in CARD.items():
        assert abs(flops(name) / card - 1) < 0.06, name
    assert flops("5b", attention=True) > 1.15 * flops("5b")


@pytest.mark.parametrize(
    "name,H,W,visible", [("tiny-gqa", 1024, 768, 1.0), ("tiny-4k", 512, 384, 1.0), ("0.4b", 1024, 768, 0.25)]
)
def test_flops_equal_torch_flop_counter(name, H, W, visible):
    """The analytic count equals torch's own counter (2 FLOPs per multiply-add, attention included), on the meta
    device, where attention runs as plain matmuls that the counter sees."""
    model = build(name, "meta")
    gh, gw = model.token_grid(H, W)
    keep = torch.arange(round(visible * gh * gw), device="meta")[None] if visible < 1 else None
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, 3, H, W, device="meta"), keep)
    assert counter.get_total_flops() == 2 * flops(name, H, W, visible=visible, attention=True)


def test_gqa_exactly_in_the_middle_blocks():
    for name in ["tiny-gqa", "0.4b", "5b", "0.4b-4k", "5b-4k"]:
        cfg = SIZES[name]
        model = build(cfg, "meta")
        # from the weights themselves: qkv has (heads + 2 * kv_heads) * head_dim rows
        kv = [(blk.attn.qkv.out_features // cfg.head_dim - cfg.heads) // 2 for blk in model.blocks]
        expected = [cfg.heads // 2 if 8 <= i < cfg.depth - 8 else cfg.heads for i in range(cfg.depth)]
        assert kv == expected, name  # [8, depth - 8) of the global blocks, as the base size
        assert all(blk.attn.kv_heads == cfg.heads for blk in model.local_blocks), name
    assert all(blk.attn.kv_heads == 12 for blk in build("0.1b", "meta").blocks)  # depth 12: none


def test_rope_rotates_patches_only_and_by_axis():
    coords = grid_coords(4, 6)
    cos, sin = rope_tables(coords, head_dim=16, base=100.0, prefix=9)
    assert cos.shape == sin.shape == (1, 9 + 24, 16)
    assert torch.equal(cos[:, :9], torch.ones(1, 9, 16)) and torch.equal(sin[:, :9], torch.zeros(1, 9, 16))
    patch_sin = sin[0, 9:].view(4, 6, 16)
    row_dims = [0, 1, 2, 3, 8, 9, 10, 11]  # half the dims (paired i, i + 8) follow the row, half the column
    col_dims = [4, 5, 6, 7, 12, 13, 14, 15]
    assert torch.allclose(patch_sin[:, :1, row_dims], patch_sin[:, :, row_dims])  # constant along a row
    assert torch.allclose(patch_sin[:1, :, col_dims], patch_sin[:, :, col_dims])  # constant along a column
    assert not torch.allclose(patch_sin[:1, :, row_dims], patch_sin[:, :, row_dims])
    assert not torch.allclose(patch_sin[:, :1, col_dims], patch_sin[:, :, col_dims])


def test_rope_makes_attention_depend_on_relative_position_only():
    cfg = SIZES["tiny-gqa"]
    torch.manual_seed(0)
    attn = Attention(cfg, kv_heads=2)
    x = torch.randn(2, 10, cfg.width)
    coords = grid_coords(16, 16)
    pos = torch.randint(0, 12, (10, 2))  # (row, col) of 10 tokens on a 16x16 grid

    def run(p: torch.Tensor) -> torch.Tensor:
        rope = rope_tables(coords[p[:, 0] * 16 + p[:, 1]], cfg.head_dim, cfg.rope_base, 0)
        return attn(x, rope)

    base = run(pos)
    assert torch.allclose(run(pos + torch.tensor([3, 2])), base, atol=1e-5)  # shift all together: same
    moved_row, moved_col = pos.clone(), pos.clone()
    moved_row[0, 0] += 3
    moved_col[0, 1] += 3
    assert not torch.allclose(run(moved_row), base, atol=1e-3)  # one token moves along a column
    assert not torch.allclose(run(moved_col), base, atol=1e-3)  # one token moves along a row


def test_rope_at_another_grid_rotates_by_image_position_not_token_index():
    """The documented choice for a new resolution: coordinates are the image's (DINOv3's normalised RoPE), so a
    token of a 2x finer grid gets the rotation of the place it covers. The 8x6 grid's tokens sit at the centres of
    the 16x12 grid's 2x2 blocks, and two tokens at one image offset get one relative rotation on either grid."""
    coarse, fine = grid_coords(8, 6), grid_coords(16, 12)
    blocks = fine.view(8, 2, 6, 2, 2).mean(dim=(1, 3)).reshape(-1, 2)
    assert torch.allclose(blocks, coarse, atol=1e-6)
    assert fine.min() > -1 and fine.max() < 1 and coarse.min() > -1 and coarse.max() < 1  # both span the image
    # the image offset from the top-left token to the one half the image right and down: (4, 3) coarse, (8, 6) fine
    cos_c, sin_c = rope_tables(coarse, 16, 100.0, 0)
    cos_f, sin_f = rope_tables(fine, 16, 100.0, 0)

    def angle(cos: torch.Tensor, sin: torch.Tensor, i: int, j: int) -> torch.Tensor:
        return torch.atan2(sin[0, j], cos[0, j]) - torch.atan2(sin[0, i], cos[0, i])

    a = angle(cos_c, sin_c, 0, 4 * 6 + 3)
    b = angle(cos_f, sin_f, 0, 8 * 12 + 6)
    # the fine grid's first token sits a quarter coarse cell up-left of the coarse one's; the offset is the same
    assert torch.allclose(torch.remainder(a, 2 * math.pi), torch.remainder(b, 2 * math.pi), atol=1e-4)
    # indices instead of image positions (what the choice avoids) would give the fine offset twice the angle
    assert not torch.allclose(torch.remainder(2 * a, 2 * math.pi), torch.remainder(b, 2 * math.pi), atol=1e-2)


def test_encoder_sees_only_the_kept_patches():
    model = _model(TINY)
    torch.manual_seed(1)
    images = torch.randn(2, 3, 96, 64)  # 6x4 grid
    keep = torch.stack([torch.randperm(24)[:6] for _ in range(2)])
    with torch.no_grad():
        out = model(images, keep)
        other = model(_perturb_outside(images, keep, 16), keep)
        full, all_kept = model(images), model(images, torch.arange(24).expand(2, -1))
        changed_kept = images.clone()
        r, c = divmod(int(keep[0, 0]), 4)
        changed_kept[0, :, r * 16 : (r + 1) * 16, c * 16 : (c + 1) * 16] += 1.0
        changed = model(changed_kept, keep)
    assert out.patches.shape == (2, 6, TINY.width) and torch.equal(out.keep, keep) and out.grid == (6, 4)
    with pytest.raises(ValueError, match="no dense feature map"):
        out.featmap()
    assert torch.allclose(_outputs(out), _outputs(other), atol=1e-5)
    assert not torch.allclose(out.cls, full.cls, atol=1e-3)
    assert torch.allclose(_outputs(full), _outputs(all_kept), atol=1e-5)
    assert not torch.allclose(changed.cls[0], out.cls[0], atol=1e-4)  # a kept patch does matter
    # each kept token is processed at its own grid position, whatever the order of keep
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    with torch.no_grad():
        permuted = model(images, keep[:, perm])
    assert torch.allclose(permuted.patches, out.patches[:, perm], atol=1e-5)
    assert torch.allclose(permuted.cls, out.cls, atol=1e-5)


def test_4k_one_window_over_the_whole_grid_equals_a_global_stage():
    """Window = whole grid, no registers: the pooled window token is the [CLS] token of a plain global model whose
    blocks are the windowed ones (the 4K model's one global block is made the identity)."""
    local = BackboneConfig(width=64, depth=1, heads=4, num_registers=0, window=4, local_depth=2, ffn_layer_scale=True)
    plain = dataclasses.replace(local, depth=2, window=None, local_depth=0)
    model4k, model = _model(local), _model(plain, seed=1)
    with torch.no_grad():
        model4k.blocks[0].ls1.zero_()
        model4k.blocks[0].ls2.zero_()
    state = model4k.state_dict()
    model.load_state_dict(
        {k.replace("local_blocks.", "blocks."): v for k, v in state.items() if not k.startswith(("window_", "blocks."))}
    )
    images = torch.randn(2, 3, 64, 64)  # 4x4 patches = one 4x4 window
    with torch.no_grad():
        out4k, out = model4k(images), model(images)
    assert out4k.grid == (1, 1) and out4k.patches.shape == (2, 1, 64)
    assert torch.allclose(out4k.patches[:, 0], out.cls, atol=1e-5)


def test_4k_dropped_windows_and_masked_patches_do_not_reach_the_output():
    cfg = SIZES["tiny-4k"]  # 4x4 windows
    model = _model(cfg)
    torch.manual_seed(2)
    images = torch.randn(2, 3, 128, 128)  # 8x8 patches = 2x2 windows
    # image 0: window 0 whole + one patch of window 3; image 1: windows 1 and 2 partly
    keep = torch.tensor(
        [
            [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 63],
            [4, 5, 12, 13, 32, 33, 40, 41, 48, 49, 56, 57, 6, 7, 14, 15],
        ]
    )
    with torch.no_grad():
        out = model(images, keep)
        other = model(_perturb_outside(images, keep, 16), keep)
        full = model(images)
    assert out.grid == (2, 2) and out.keep.tolist() == [[0, 3], [1, 2]]
    assert out.patches.shape == (2, 2, cfg.width)
    assert torch.allclose(_outputs(out), _outputs(other), atol=1e-5)
    changed = images.clone()
    changed[0, :, 112:, 112:] += 1.0  # patch 63, the one visible patch of window 3
    with torch.no_grad():
        assert not torch.allclose(model(changed, keep).patches[0, 1], out.patches[0, 1], atol=1e-4)
    assert not torch.allclose(out.cls, full.cls, atol=1e-3)  # full has all four windows
    uneven = torch.tensor([[0, 1], [0, 63]])  # one window vs two
    with pytest.raises(ValueError, match="same number of visible windows"):
        model(images, uneven)


def test_bf16_forward_at_1024x768_stays_finite_and_close_to_fp32():
    model = _model(TINY)
    images = torch.randn(1, 3, 1024, 768)
    with torch.no_grad():
        ref = model(images).patches
        out = model.to(torch.bfloat16)(images.to(torch.bfloat16)).patches
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (out.float() - ref).norm() / ref.norm() < 0.05


def test_no_weight_decay_names():
    model = _model(SIZES["tiny-4k"])
    names = model.no_weight_decay()
    assert {"cls_token", "registers", "window_query", "norm.weight", "patch_embed.bias"} <= names
    for blocks in ("local_blocks", "blocks"):
        assert {f"{blocks}.0.{n}" for n in ("ls1", "attn.q_norm.weight", "attn.qkv.bias")} <= names
    assert not any(n.endswith(".weight") and n.split(".")[-2] in ("qkv", "proj", "w12", "w3") for n in names)
    assert "patch_embed.weight" not in names


def test_layer_scale_on_the_attention_branch_only_as_sapiens2_and_on_both_as_dinov2(tmp_path):
    """Sapiens2's block (its TransformerEncoderLayer2): x + ls1 * attn(norm1(x)), then + ffn(norm2(x)) unscaled;
    ``ffn_layer_scale`` adds DINOv2's second LayerScale on the FFN branch."""
    from pretrain.backbone import Block, grid_coords, rope_tables

    x = torch.randn(2, 1 + 8 + 12, 64)
    rope = rope_tables(grid_coords(3, 4), TINY.head_dim, TINY.rope_base, 1 + 8)
    for both in (False, True):
        torch.manual_seed(0)
        blk = Block(dataclasses.replace(TINY, ffn_layer_scale=both, layer_scale_init=0.3), TINY.heads)
        assert (blk.ls2 is not None) == both
        assert {n.split(".")[0] for n, _ in blk.named_parameters()} == {"norm1", "attn", "ls1", "norm2", "ffn"} | (
            {"ls2"} if both else set()
        )
        with torch.no_grad():
            h = x + 0.3 * blk.attn(blk.norm1(x), rope)
            expected = h + (0.3 if both else 1.0) * blk.ffn(blk.norm2(h))
            assert torch.allclose(blk(x, rope), expected, atol=1e-6)
    # an exported backbone from before the setting (ls2 tensors, no flag in its metadata) still loads as it was
    from safetensors.torch import save_file

    older = _model(dataclasses.replace(TINY, ffn_layer_scale=True))
    fields = {k: v for k, v in dataclasses.asdict(older.cfg).items() if k != "ffn_layer_scale"}
    save_file(older.state_dict(), str(tmp_path / "old.safetensors"), metadata={"backbone_config": json.dumps(fields)})
    loaded = load_backbone(str(tmp_path / "old.safetensors"))
    assert loaded.cfg.ffn_layer_scale and torch.equal(loaded.blocks[0].ls2, older.blocks[0].ls2)


def test_meta_build_materialises_with_init_weights():
    model = build(TINY, "meta")
    model.to_empty(device="cpu")
    model.init_weights()
    out = model(torch.randn(1, 3, 64, 64))
    assert torch.isfinite(out.cls).all()
    assert torch.equal(model.blocks[0].ls1, torch.full((64,), TINY.layer_scale_init))


def _loss_and_grads(model: Sapiens2Backbone, images: torch.Tensor, keep: torch.Tensor | None = None):
    loss = model(images, keep).patches.square().mean()
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("size", ["tiny", "tiny-4k"])  # 4K: the windowed blocks' attention takes a mask
def test_activation_checkpointing_modes_give_the_same_loss_and_gradients(size):
    images, keep = torch.randn(2, 3, 64, 64), torch.tensor([[0, 5, 9, 15], [1, 2, 3, 4]])
    results = {}
    for mode in CHECKPOINTING:
        model = _model(SIZES[size]).train()
        model.activation_checkpointing = mode  # reaches every block: each checkpoints itself
        assert [blk.activation_checkpointing for blk in model.all_blocks] == [mode] * len(model.all_blocks)
        calls: list[int] = []
        model.blocks[0].attn.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        results[mode] = _loss_and_grads(model, images, keep)
        assert len(calls) == (1 if mode == "off" else 2)  # the forward, and when checkpointing its recomputation
    for mode in ("full", "selective"):
        assert torch.allclose(results[mode][0], results["off"][0], rtol=1e-6), mode
        assert torch.allclose(results[mode][1], results["off"][1], atol=1e-6), mode


def test_a_bool_sets_the_mode_it_stood_for():
    model = _model(TINY)
    for flag, mode in ((True, "full"), (False, "off")):
        model.activation_checkpointing = flag
        assert model.activation_checkpointing == mode
        assert {blk.activation_checkpointing for blk in model.all_blocks} == {mode}
    assert dataclasses.replace(TINY, activation_checkpointing=True).activation_checkpointing == "full"
    model.blocks[0].activation_checkpointing = "selective"
    assert model.activation_checkpointing is None  # the blocks differ
    with pytest.raises(ValueError, match="one of off, full, selective"):
        model.activation_checkpointing = "some"


def _saved_bytes(model: Sapiens2Backbone, images: torch.Tensor) -> int:
    """Bytes of the distinct storages, other than the parameters', that one forward holds for the backward pass."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            held[storage.data_ptr()] = storage.nbytes()
        return t  # kept until the backward pass, so no address is reused while the forward runs

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(images)
    return sum(held.values())


@pytest.mark.skipif(
    "respect_saved_tensors_hooks" not in inspect.signature(checkpoint).parameters,
    reason="this torch cannot route what selective checkpointing saves through saved_tensors_hooks",
)
def test_selective_checkpointing_holds_less_than_none_and_more_than_full(monkeypatch):
    # What selective checkpointing saves is held outside the autograd graph; this routes it through the hooks.
    monkeypatch.setattr(backbone, "checkpoint", functools.partial(checkpoint, respect_saved_tensors_hooks=True))
    images = torch.randn(2, 3, 64, 64)
    held = {}
    for mode in CHECKPOINTING:
        model = _model(TINY).train()
        model.activation_checkpointing = mode
        held[mode] = _saved_bytes(model, images)
    assert held["full"] < held["selective"] < held["off"], held


class _Recording(backbone.SelectivePolicy):
    decisions: list[tuple[bool, str, CheckpointPolicy]] = []

    def __call__(self, ctx, func, *args, **kwargs):
        decision = super().__call__(ctx, func, *args, **kwargs)
        self.decisions.append((ctx.is_recompute, func.__name__.split(".")[0], decision))
        return decision


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ran: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ran[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def test_selective_checkpointing_saves_every_other_matmul_and_attention_and_recomputes_the_norms(monkeypatch):
    monkeypatch.setattr(backbone, "SelectivePolicy", _Recording)
    monkeypatch.setattr(_Recording, "decisions", [])
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    images, blocks = torch.randn(2, 3, 64, 64), TINY.depth
    backward = {}
    for mode in CHECKPOINTING:
        model = _model(TINY).train()
        model.activation_checkpointing = mode
        loss = model(images).patches.square().mean()
        with _Ops() as ops:  # what the backward pass runs: gradients, and what checkpointing recomputes
            loss.backward()
        backward[mode] = ops.ran
    forward = [(op, d) for again, op, d in _Recording.decisions if not again]
    # per block: qkv and the FFN's gate-and-value matmul saved, the projections after them recomputed (addmm: biases)
    assert [d for op, d in forward if op == "addmm"] == [save, recompute] * 2 * blocks
    assert {d for op, d in forward if op.startswith("_scaled_dot_product")} == {save}
    assert {d for op, d in forward if op in ("rsqrt", "mean", "pow", "silu", "neg", "cat", "mul")} == {recompute}
    # RMSNorm decomposes into pow, mean, add, rsqrt, mul; 4 norms a block (before attention and FFN, on q and k)
    assert backward["off"]["rsqrt"] == 0 and backward["full"]["rsqrt"] == backward["selective"]["rsqrt"] == 4 * blocks
    attention = "_scaled_dot_product_flash_attention_for_cpu"
    assert backward["full"][attention] == blocks and backward["selective"][attention] == backward["off"][attention] == 0
    # a saved matmul is not run again; the output projection is (the FFN's last matmul is needed by no gradient)
    assert backward["full"]["addmm"] == 3 * blocks and backward["selective"]["addmm"] == blocks


def test_drop_path_rates_rise_linearly_over_the_blocks_in_forward_order():
    assert TINY.drop_path_rates() == [0.0] * 4 and [b.drop_path_rate for b in build(TINY, "meta").all_blocks] == [0] * 4
    cfg = dataclasses.replace(SIZES["tiny-4k"], drop_path=0.5)  # 2 windowed blocks, then 4 global ones
    model = build(cfg, "meta")
    expected = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    assert cfg.drop_path_rates() == pytest.approx(expected)
    assert [blk.drop_path_rate for blk in model.all_blocks] == pytest.approx(expected)
    assert [blk.drop_path.drop_prob for blk in model.blocks] == pytest.approx(expected[2:])  # timm's DropPath
    with pytest.raises(ValueError, match="drop_path"):
        dataclasses.replace(TINY, drop_path=1.0)


def test_drop_path_drops_whole_samples_in_training_and_nothing_in_eval():
    cfg = dataclasses.replace(TINY, drop_path=0.5)
    model, plain = _model(cfg), _model(TINY)
    assert model.state_dict().keys() == plain.state_dict().keys()  # drop path holds no weights
    plain.load_state_dict(model.state_dict())
    images = torch.randn(4, 3, 64, 64)
    # per sample: a branch is all dropped or all kept, and a kept one scaled by 1 / (1 - rate)
    branch = model.blocks[-1].drop_path.train()(torch.ones(64, 5, 3))
    assert set(branch.amax((1, 2)).tolist()) == set(branch.amin((1, 2)).tolist()) == {0.0, 2.0}
    torch.manual_seed(0)
    model.train()
    first, second = _outputs(model(images)), _outputs(model(images))
    assert torch.isfinite(first).all() and torch.isfinite(second).all()
    assert not torch.equal(first, second)
    model.eval()
    with torch.no_grad():
        kept = _outputs(model(images))
        assert torch.equal(kept, _outputs(model(images)))
        assert torch.equal(kept, _outputs(plain(images)))


def test_drop_path_draws_the_same_masks_when_activation_checkpointing_recomputes():
    cfg = dataclasses.replace(TINY, drop_path=0.5)
    images = torch.randn(4, 3, 64, 64)
    grads = []
    for mode in CHECKPOINTING:
        model = _model(cfg).train()
        model.activation_checkpointing = mode
        torch.manual_seed(1)  # the same masks in every run; checkpointing replays the RNG for its recomputation
        model(images).patches.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and torch.allclose(grads[0], grads[2], atol=1e-6)


def test_tiny_model_learns_a_toy_regression():
    """[CLS] regresses the mean colour of the image from half its patches (it must attend to them)."""
    torch.manual_seed(0)
    model = Sapiens2Backbone(TINY).train()
    head = torch.nn.Linear(TINY.width, 3)
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=3e-3)
    losses = []
    for _ in range(30):
        images = torch.randn(8, 3, 32, 48) * 0.5 + torch.randn(8, 3, 1, 1)  # 2x3 patches
        keep = torch.rand(8, 6).argsort(1)[:, :3]
        loss = torch.nn.functional.mse_loss(head(model(images, keep).cls), images.mean((2, 3)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.4 * sum(losses[:5]) / 5


# --- the 4K variant in fine-tuning and export -----------------------------------------------------------------------


def _labels_of(h: int, w: int) -> LabelInfo:
    return LabelInfo(parts=("background", "skin", "clothes"), keypoint_names=("a", "b", "c"),
                     keypoint_sigmas=(0.05, 0.05, 0.05), image_size=(h, w))  # fmt: skip


def _finetune_config(*overrides: str) -> FinetuneConfig:
    return load_config(FinetuneConfig, FINETUNE_TINY, ["head.class_weights=null", "optim.warmup_steps=0", *overrides])


def test_output_size_is_half_the_input_for_4k_backbones_only():
    assert output_size(SIZES["5b-4k"], 4096, 3072) == (2048, 1536)
    assert output_size(SIZES["5b"], 1024, 768) == (1024, 768)
    assert feature_stride(SIZES["5b-4k"]) == 32 and feature_stride(SIZES["5b"]) == 16  # output pixels per token


@pytest.mark.parametrize("task_name", ["pose", "seg", "pointmap", "normal", "albedo"])
def test_a_tiny_4k_finetuning_model_outputs_half_size_and_trains_on_resized_labels(task_name):
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (2, 3, 128, 96), dtype=torch.uint8, generator=g)
    mask = torch.rand(2, 128, 96, generator=g) > 0.3
    # one batch carries every task's labels; dense targets positive (a depth, an albedo)
    batch = {"image": images, "keypoints": torch.rand(2, 3, 2, generator=g) * torch.tensor([95.0, 127.0]),
             "visibility": torch.full((2, 3), 2, dtype=torch.uint8), "area": torch.full((2,), 5000.0),
             "parts": torch.randint(0, 3, (2, 128, 96), generator=g), "mask": mask,
             "target": torch.rand(2, 128, 96, 3, generator=g) + 0.1}  # fmt: skip
    for size, out_hw in (("tiny-4k", (64, 48)), ("tiny", (128, 96))):  # 8-px patches; 4x4 windows in tiny-4k
        cfg = _finetune_config(f"model.size={size}")
        task = make_task(task_name, cfg, _labels_of(128, 96), cfg.model.backbone())
        assert task.image_hw == out_hw
        model = build_model(cfg, task, None)
        out = model(images)
        channels_first = {"pose": (2, 3, out_hw[0] // 4, out_hw[1] // 4), "seg": (2, 3, *out_hw)}
        assert out.shape == channels_first.get(task_name, (2, *out_hw, 3)), size
        labels = batch if out_hw == (128, 96) else tasks.resize_targets(batch, task_name, out_hw)
        loss, _ = task.loss(model.head, out, labels)
        loss.backward()
        assert torch.isfinite(loss)


def test_resize_targets_is_exact_on_hand_made_labels():
    image = torch.zeros(1, 3, 4, 4, dtype=torch.uint8)
    # seg: each output pixel takes the input pixel under its centre, the lower right of its 2x2 block
    parts = torch.arange(16).view(1, 4, 4)
    seg = tasks.resize_targets({"image": image, "parts": parts}, "seg", (2, 2))
    assert seg["image"] is image and seg["parts"].tolist() == [[[5, 7], [13, 15]]]
    # pose: pixel centres map onto pixel centres; the area scales with both ratios
    keypoints = torch.tensor([[[0.0, 0.0], [3.0, 3.0], [1.5, 0.5]]])
    visibility = torch.tensor([[2, 1, 0]], dtype=torch.uint8)
    pose = {"image": torch.zeros(1, 3, 4, 8, dtype=torch.uint8), "keypoints": keypoints, "visibility": visibility,
            "area": torch.tensor([64.0])}  # fmt: skip
    out = tasks.resize_targets(pose, "pose", (2, 2))  # x by 1/4, y by 1/2
    torch.testing.assert_close(out["keypoints"], torch.tensor([[[-0.375, -0.25], [0.375, 1.25], [0.0, 0.0]]]))
    torch.testing.assert_close(out["area"], torch.tensor([8.0]))
    assert out["visibility"] is visibility
    # dense: the mean over each block's labelled pixels (background holds no label), the mask by the centre rule
    mask = torch.tensor([[[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]], dtype=torch.bool)
    z = torch.tensor([[[1.0, 2.0, 9.0, 7.0], [3.0, 4.0, 7.0, 7.0], [7.0, 7.0, 2.0, 7.0], [7.0, 7.0, 7.0, 6.0]]])
    points = torch.stack([torch.zeros_like(z), torch.zeros_like(z), z], dim=-1)
    dense = tasks.resize_targets({"image": image, "mask": mask, "target": points}, "pointmap", (2, 2))
    torch.testing.assert_close(dense["target"][..., 2], torch.tensor([[[2.5, 9.0], [0.0, 4.0]]]))
    assert dense["mask"].tolist() == [[[True, False], [False, True]]]
    albedo = tasks.resize_targets({"image": image, "mask": mask, "target": points / 10}, "albedo", (2, 2))
    torch.testing.assert_close(albedo["target"][..., 2], torch.tensor([[[0.25, 0.9], [0.0, 0.4]]]))
    # normals: the mean direction, back to unit length
    normals = torch.zeros(1, 4, 4, 3)
    normals[0, :2, :2] = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
    normals[0, 2:, 2:] = torch.tensor([0.0, 0.0, 1.0])
    out = tasks.resize_targets({"image": image, "mask": normals.abs().sum(-1) > 0, "target": normals}, "normal", (2, 2))
    half = 2**-0.5
    expected = torch.tensor([[[[half, half, 0.0], [0.0, 0.0, 0.0]], [[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]]])
    torch.testing.assert_close(out["target"], expected)


def test_4k_layer_decay_puts_windowed_blocks_below_the_global_ones():
    cfg = _finetune_config("model.size=tiny-4k", "optim.layer_decay=0.5")
    model = build_model(cfg, make_task("seg", cfg, _labels_of(128, 96), cfg.model.backbone()), None)
    opt = build_optimizer(model, cfg)
    set_schedule(opt, cfg, 0, 1)
    rate = {id(p): group["lr"] for group in opt.param_groups for p in group["params"]}
    named = dict(model.named_parameters())
    lr = cfg.optim.lr * cfg.data.batch_size / 256  # the peak at one worker
    n = SIZES["tiny-4k"].total_depth  # 2 windowed + 4 global blocks
    expected = {"head.out.weight": lr, "backbone.norm.weight": lr, "backbone.blocks.3.ffn.w3.weight": lr * 0.5,
                "backbone.blocks.0.attn.qkv.weight": lr * 0.5**4, "backbone.local_blocks.1.ffn.w12.weight": lr * 0.5**5,
                "backbone.local_blocks.0.norm1.weight": lr * 0.5**n, "backbone.window_query": lr * 0.5 ** (n + 1),
                "backbone.patch_embed.weight": lr * 0.5 ** (n + 1)}  # fmt: skip
    assert {k: rate[id(named[k])] for k in expected} == pytest.approx(expected)
    assert [layer_id(f"backbone.local_blocks.{i}.ls1", 4, 2) for i in range(2)] == [1, 2]
    assert [layer_id(f"backbone.blocks.{i}.ls1", 4, 2) for i in range(4)] == [3, 4, 5, 6]
    assert layer_id("backbone.norm.weight", 4, 2) == layer_id("head.out.bias", 4, 2) == 7


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a single-process checkpoint, as meant
def test_a_4k_backbone_round_trips_through_export_and_is_checked_against_the_size(tmp_path):
    from pretrain.config import PretrainConfig
    from pretrain.objective import JointObjective
    from pretrain.train import build_optimizer as pretrain_optimizer

    overrides = ["model.size=tiny-4k", "objective.views.global_size=[64,64]", "objective.views.local_size=[32,32]"]
    cfg = load_config(PretrainConfig, FINETUNE_TINY.parents[1] / "pretrain/tiny.yaml", overrides)
    torch.manual_seed(0)
    model = JointObjective(build(cfg.model.backbone()), cfg.objective, total_steps=4)
    uri = ckpt.step_uri(str(tmp_path / "run"), 1)
    ckpt.save(uri, model, pretrain_optimizer(model, cfg.optim), {"step": 1, "config": cfg.model_dump(mode="json")})
    out = str(tmp_path / BACKBONE_FILE)
    meta = export_backbone(uri, out)
    assert json.loads(meta["backbone_config"])["local_depth"] == 2
    backbone = load_backbone(out)  # strict: windowed and global blocks both
    assert backbone.cfg == cfg.model.backbone() and len(backbone.local_blocks) == 2 and len(backbone.blocks) == 4
    student = model.student.state_dict()
    assert all(torch.equal(v, student[k]) for k, v in backbone.state_dict().items())
    # fine-tuning takes it for model.size=tiny-4k and refuses it for the base size, naming the windowed stage
    ft = _finetune_config("model.size=tiny-4k")
    loaded = build_model(ft, make_task("seg", ft, _labels_of(128, 96), ft.model.backbone()), out)
    assert torch.equal(loaded.backbone.local_blocks[1].ffn.w3.weight, student["local_blocks.1.ffn.w3.weight"])
    base = _finetune_config()
    with pytest.raises(ValueError, match=r"depth 4 \+ 2 windowed blocks \(4x4 windows\)"):
        build_model(base, make_task("seg", base, _labels_of(128, 96), base.model.backbone()), out)
    plain = tmp_path / "plain.safetensors"
    state = {k: v.contiguous() for k, v in build(base.model.backbone()).state_dict().items()}
    save_file(state, str(plain), metadata={"backbone_config": json.dumps(dataclasses.asdict(base.model.backbone()))})
    with pytest.raises(ValueError, match=r"model.size"):
        build_model(ft, make_task("seg", ft, _labels_of(128, 96), ft.model.backbone()), str(plain))


@pytest.mark.slow  # about a minute of inductor compiling on 2 CPUs
def test_a_compiled_block_checkpoints_selectively_as_eager_does():
    cfg = dataclasses.replace(TINY, depth=1)
    images = torch.randn(2, 3, 64, 64)
    eager, compiled = _model(cfg).train(), _model(cfg).train()
    for model in (eager, compiled):
        model.activation_checkpointing = "selective"
    torch._dynamo.reset()
    counters.clear()
    for blk in compiled.all_blocks:
        blk.compile()  # after the mode is set, as training compiles them: the checkpoint is traced inside the block
    expected = _loss_and_grads(eager, images)
    got = _loss_and_grads(compiled, images)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1  # the checkpoint is in the graph
    assert torch.allclose(got[0], expected[0], rtol=1e-5)
    assert torch.allclose(got[1], expected[1], atol=1e-5)
    compiled.zero_grad()
    with torch._dynamo.config.patch(error_on_recompile=True):  # the policy is one function: no new guard fails
        again = _loss_and_grads(compiled, images)
    assert torch.allclose(again[1], got[1])


@pytest.mark.parametrize("size", ["tiny", "tiny-4k"])
def test_the_pretraining_step_gives_attention_a_mask_only_in_windowed_blocks(size):
    """The MAE encoder attends over its kept tokens alone, the teacher and the decoder over whole sequences: no mask,
    so on a GPU the flash kernel can serve every call (the GPU check's probe holds a step to it). Only a 4K student's
    windowed blocks exclude the masked patches of a kept window by a mask."""
    from pretrain.config import PretrainConfig
    from pretrain.objective import JointObjective

    cfg = load_config(
        PretrainConfig,
        Path(__file__).resolve().parents[2] / "configs/pretrain/tiny.yaml",
        [f"model.size={size}", "objective.views.global_size=[64,64]", "objective.views.local_size=[32,32]"],
    )
    model = JointObjective(build(cfg.model.backbone()), cfg.objective, total_steps=10)
    calls: list[tuple[Attention, bool]] = []
    for module in model.modules():
        if isinstance(module, Attention):
            module.register_forward_pre_hook(lambda m, args: calls.append((m, len(args) > 2 and args[2] is not None)))
    model(torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8), step=0)["loss"].backward()
    windowed = {blk.attn for blk in model.student.local_blocks}  # the teacher's windows are whole: no mask
    attentions = {m for m in model.modules() if isinstance(m, Attention)}
    assert {m for m, _ in calls} == attentions  # student, teacher and decoder: each attention ran
    assert {m for m, masked in calls if masked} == (windowed if size.endswith("-4k") else set())


def test_the_rope_rotation_runs_in_fp32_for_bf16_queries():
    """bf16 q and k are rotated in fp32 and rounded once: the result is the fp32 rotation of the same values, cast."""
    coords = grid_coords(16, 12)
    rope = rope_tables(coords, head_dim=32, base=100.0, prefix=1)
    assert rope[0].dtype == rope[1].dtype == torch.float32
    x = torch.randn(2, 4, 1 + 16 * 12, 32).bfloat16()
    out = apply_rope(x, rope)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, apply_rope(x.float(), rope).bfloat16())
