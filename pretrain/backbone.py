"""Sapiens2-style ViT backbone, all sizes, plus the hierarchical 4K variant, in one file.

Architecture (public model card and standalone backbone): 16x16 patch embedding; one [CLS] and
`num_registers` register tokens; pre-norm blocks with RMSNorm, QK-Norm, 2D axial RoPE on the patch tokens,
SwiGLU FFN (hidden = 4 x width, three width x hidden matrices), LayerScale on the attention branch only (as the
public Sapiens2 block; `ffn_layer_scale` adds DINOv2's second one on the FFN branch); grouped-query attention
(kv heads = heads / 2) only in the middle blocks [8, depth - 8); a final RMSNorm.

Activation checkpointing (`activation_checkpointing`, a training setting) trades compute for memory per block:
"off" keeps every activation for the backward pass, "full" keeps only the block's input and recomputes the rest,
"selective" keeps the outputs of every other matmul and of the attention kernel and recomputes the rest (norms,
SiLU, RoPE, elementwise ops; torchtitan's op-level selective checkpointing).

Stochastic depth (`drop_path`, a fine-tuning setting) drops each block's attention and FFN branches per sample in
training, at rates rising linearly over the blocks; eval mode and rate 0 leave the blocks as above.

Masked (MAE) training: `forward(images, keep)` runs the transformer on the visible patches only, each at its
true grid position, so dropped patches cannot influence any output.

4K variant (`window` set): `local_depth` extra blocks (`local_blocks`), in front of the `depth` global blocks of
the base size, attend inside non-overlapping window x window windows of the patch grid. Each window carries one
extra pooling token, initialised from the [CLS] token plus a learned offset, that attends over its window in those
blocks; after the local stage that token is the window's single token, so the grid shrinks by `window` per side
(4096x3072 -> 256x192 patches -> 64x48 tokens). The global blocks, exactly the base size's (GQA placement
included), then attend over [CLS, registers, window tokens] with RoPE at the reduced grid positions.
Under masking the window is the unit at the global level: windows without a visible patch never enter the
global stage, and masked patches inside a kept window are excluded from its attention as keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

Checkpointing = Literal["off", "full", "selective"]
CHECKPOINTING: tuple[Checkpointing, ...] = get_args(Checkpointing)


def checkpointing_mode(value: str | bool) -> Checkpointing:
    """The mode a setting names; a bool, as configs and exported backbones recorded it when the setting was a flag,
    maps True to "full" and False to "off"."""
    if isinstance(value, bool):
        return "full" if value else "off"
    for mode in CHECKPOINTING:
        if value == mode:
            return mode
    raise ValueError(f"activation_checkpointing must be one of {', '.join(CHECKPOINTING)}, got {value!r}")


@dataclass(frozen=True)
class BackboneConfig:
    width: int
    depth: int  # global-attention blocks (a 4K variant adds `local_depth` windowed blocks in front)
    heads: int
    kv_heads: int | None = None  # kv heads of the middle (GQA) blocks; None -> heads // 2
    mhsa_edge: int = 8  # this many blocks at each end keep full multi-head attention
    ffn_ratio: int = 4
    patch_size: int = 16
    in_chans: int = 3
    num_registers: int = 8
    layer_scale_init: float = 1e-4
    # Sapiens2 scales the attention branch only; True also scales the FFN branch, as DINOv2 / DINOv3 blocks do.
    ffn_layer_scale: bool = False
    rope_base: float = 100.0
    norm_eps: float = 1e-6
    qkv_bias: bool = True
    window: int | None = None  # 4K variant: window side in patches (4 -> 4x4 windows)
    local_depth: int = 0  # 4K variant: windowed blocks run before the `depth` global ones
    activation_checkpointing: Checkpointing = "off"  # training only (`Block.forward`)
    # Stochastic depth, a fine-tuning setting: the rate of the last block (`drop_path_rates`); training only.
    drop_path: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation_checkpointing", checkpointing_mode(self.activation_checkpointing))
        if self.width % self.heads or (self.width // self.heads) % 4:
            raise ValueError("head dim must be a multiple of 4 (2D RoPE rotates pairs on two axes)")
        if self.heads % self.gqa_kv_heads:
            raise ValueError("kv_heads must divide heads")
        if self.depth < 1:
            raise ValueError("depth (the global blocks) must be at least 1")
        if (self.window is None) != (self.local_depth == 0) or self.local_depth < 0:
            raise ValueError("the 4K variant needs both window and local_depth > 0; a base size neither")
        if not 0 <= self.drop_path < 1:
            raise ValueError("drop_path must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def hidden(self) -> int:
        return self.ffn_ratio * self.width

    @property
    def total_depth(self) -> int:
        """Every transformer block: the windowed ones, then the global ones."""
        return self.local_depth + self.depth

    @property
    def gqa_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads // 2

    def drop_path_rates(self) -> list[float]:
        """Each block's stochastic-depth rate in forward order (windowed, then global): linear from 0 at the first
        to `drop_path` at the last, as timm, MAE and DINOv2 space them (on the CPU: also under a meta device)."""
        return [x.item() for x in torch.linspace(0, self.drop_path, self.total_depth, device="cpu")]

    def block_kv_heads(self, index: int) -> int:
        """KV heads of global block `index` (the windowed blocks keep full multi-head attention)."""
        middle = self.mhsa_edge <= index < self.depth - self.mhsa_edge
        return self.gqa_kv_heads if middle else self.heads


_BASE = {
    "tiny": BackboneConfig(width=64, depth=4, heads=4),
    "tiny-gqa": BackboneConfig(width=32, depth=18, heads=4),  # GQA in blocks 8 and 9
    "0.1b": BackboneConfig(width=768, depth=12, heads=12),  # depth 12: no middle blocks, no GQA
    "0.4b": BackboneConfig(width=1024, depth=24, heads=16, kv_heads=8),
    "0.8b": BackboneConfig(width=1280, depth=32, heads=16, kv_heads=8),
    "1b": BackboneConfig(width=1536, depth=40, heads=24, kv_heads=12),
    "5b": BackboneConfig(width=2432, depth=56, heads=32, kv_heads=16),
}
# 4K variants: 4x4 windows; as many windowed blocks, in front of the base size's global blocks, as the public 4K
# backbones give their window stage.
LOCAL_DEPTH = {"tiny": 2, "0.1b": 2, "0.4b": 2, "0.8b": 3, "1b": 4, "5b": 6}
SIZES: dict[str, BackboneConfig] = {
    **_BASE,
    **{f"{k}-4k": dataclasses.replace(_BASE[k], window=4, local_depth=d) for k, d in LOCAL_DEPTH.items()},
}
# Public model card at 1024x768: (parameters, FLOPs).
CARD: dict[str, tuple[float, float]] = {
    "0.1b": (0.114e9, 0.342e12),
    "0.4b": (0.398e9, 1.260e12),
    "0.8b": (0.818e9, 2.592e12),
    "1b": (1.462e9, 4.715e12),
    "5b": (5.071e9, 15.722e12),
}


# Profiler ranges that name the parts of a training step; benchmarks/gpu/step_profile.py sums the step's time by
# them. Outside a profiler a range is one cheap op call; inside a compiled graph dynamo drops it (the compiled
# block is then one part).
STEP_PART = "step:"


def step_part(name: str) -> torch.profiler.record_function:
    return torch.profiler.record_function(STEP_PART + name)


# ---------------------------------------------------------------------------------------------------------------
# 2D RoPE. Coordinates are patch centres normalised to [-1, 1] per axis, so a window token (the centre of its
# patches) lands on the same coordinate in the reduced grid. Of each head's dims, one half rotates with the row
# and the other half with the column; CLS / register / pooling tokens (the prefix) get the identity rotation.
#
# At another resolution (a token grid the backbone was not trained on) the coordinates stay the image's, not the
# tokens' indices: a token gets the rotation of the place it covers, so the same image offset keeps the same
# relative angle and a finer grid samples the learned frequencies more densely (position interpolation). This is
# DINOv3's RoPE (normalize_coords="separate", base 100, no learned weights), which it and Sapiens2 rely on to
# fine-tune at higher resolution than they pretrain. What changes with the grid is the number of tokens per unit of
# image: a model pretrained on an 8x6 grid meets neighbours 2x closer on 16x12, which is why the value benchmark
# pretrains at the read-outs' resolution (benchmarks/pretrain_value.py).


def grid_coords(gh: int, gw: int, device: torch.device | str | None = None) -> Tensor:
    """[gh * gw, 2] (row, col) centre coordinates in [-1, 1], row-major."""
    rows = (torch.arange(gh, device=device, dtype=torch.float32) + 0.5) * (2.0 / gh) - 1.0
    cols = (torch.arange(gw, device=device, dtype=torch.float32) + 0.5) * (2.0 / gw) - 1.0
    return torch.stack(torch.meshgrid(rows, cols, indexing="ij"), dim=-1).reshape(-1, 2)


def rope_tables(coords: Tensor, head_dim: int, base: float, prefix: int) -> tuple[Tensor, Tensor]:
    """fp32 cos, sin of shape [..., 1, prefix + n, head_dim] for coords [..., n, 2] (the 1 broadcasts over heads)."""
    with step_part("rope"):
        quarter = head_dim // 4
        periods = base ** (torch.arange(quarter, device=coords.device, dtype=torch.float32) / quarter)
        angles = (2 * math.pi) * coords.float()[..., None] / periods  # [..., n, 2, quarter]
        angles = angles.flatten(-2)  # [..., n, head_dim / 2]: (row freqs, col freqs)
        angles = torch.cat([angles, angles], dim=-1)  # dim i and i + head_dim / 2 share an angle
        angles = F.pad(angles, (0, 0, prefix, 0))  # angle 0 = no rotation for the prefix tokens
        return angles.cos().unsqueeze(-3), angles.sin().unsqueeze(-3)


def apply_rope(x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
    """Rotate dim i with dim i + head_dim / 2 (x: [B, heads, L, head_dim]), in fp32 whatever ``x``'s dtype, as
    DINOv3 rotates in its tables' dtype, fp32 in its 7B recipe: bf16's 8-bit mantissa would round cos and sin, and the
    rotated q and k, before the attention logits."""
    cos, sin = rope
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, cfg: BackboneConfig, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.width, (cfg.heads + 2 * kv_heads) * cfg.head_dim, bias=cfg.qkv_bias)
        # QK-Norm bounds the logits, which keeps bf16 attention over thousands of tokens stable.
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor | None = None) -> Tensor:
        with step_part("attention"):
            B, L, _ = x.shape
            q, k, v = self.qkv(x).split([self.heads * self.head_dim, *[self.kv_heads * self.head_dim] * 2], dim=-1)
            q = q.view(B, L, self.heads, self.head_dim).transpose(1, 2)
            k = k.view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
            with step_part("norm"):
                q, k = self.q_norm(q), self.k_norm(k)
            with step_part("rope"):
                q, k = apply_rope(q, rope), apply_rope(k, rope)
            v = v.view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
            return self.proj(out.transpose(1, 2).reshape(B, L, -1))


class SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w12 = nn.Linear(width, 2 * hidden)  # gate and value in one matmul
        self.w3 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        with step_part("mlp"):
            gate, value = self.w12(x).chunk(2, dim=-1)
            return self.w3(F.silu(gate) * value)


# ---------------------------------------------------------------------------------------------------------------
# Selective activation checkpointing, torchtitan's policy (torchtitan/distributed/activation_checkpoint.py,
# SelectiveAC): save the outputs of the ops that are expensive to recompute, recompute the rest, and recompute every
# second matmul too, which halves the memory the matmuls' outputs take for one matmul in two run again.
_aten = torch.ops.aten
# aten.linear reaches the policy only on backends that keep it whole; CPU and CUDA decompose it into (add)mm.
# addmm counts as a matmul here, not only as a saved op as in torchtitan: our linear layers have biases, so their
# matmuls arrive as addmm, and saving every one of them would skip the alternation altogether.
SAC_MATMULS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.linear.default})
SAC_SAVED = SAC_MATMULS | {
    _aten.bmm.default,
    # every scaled-dot-product-attention kernel (the math one decomposes before a policy sees it on CPU and CUDA,
    # and its bmm are saved as above)
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_attention_math.default,
    _aten._scaled_dot_product_fused_attention_overrideable.default,
    _aten._flash_attention_forward.default,
    _aten._efficient_attention_forward.default,
    # not in torchtitan's list: the CPU kernel, so that CPU runs (and tests) follow the GPU's policy
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


class SelectivePolicy:
    """One checkpointed call's policy: the forward and the recomputation count their matmuls apart, so both make
    the same choices."""

    def __init__(self) -> None:
        self.matmuls = {False: 0, True: 0}  # by ctx.is_recompute

    def __call__(self, ctx: SelectiveCheckpointContext, func, *args, **kwargs) -> CheckpointPolicy:
        if func in SAC_MATMULS:
            self.matmuls[ctx.is_recompute] += 1
            if self.matmuls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in SAC_SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """``checkpoint``'s ``context_fn`` in selective mode: one module-level function, so a compiled block traces it
    once (dynamo takes a plain function as it is); only the matmul count is new at each call."""
    return create_selective_checkpoint_contexts(SelectivePolicy())


class Block(nn.Module):
    def __init__(self, cfg: BackboneConfig, kv_heads: int, drop_path: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.width, eps=cfg.norm_eps)
        self.attn = Attention(cfg, kv_heads)
        self.ls1 = nn.Parameter(torch.full((cfg.width,), cfg.layer_scale_init))
        self.norm2 = nn.RMSNorm(cfg.width, eps=cfg.norm_eps)
        self.ffn = SwiGLU(cfg.width, cfg.hidden)
        self.ls2 = nn.Parameter(torch.full((cfg.width,), cfg.layer_scale_init)) if cfg.ffn_layer_scale else None
        self.activation_checkpointing = cfg.activation_checkpointing  # a mode, read at each forward
        # Stochastic depth: in training, each residual branch is dropped for a random `drop_path` of the samples
        # (the windowed blocks batch windows, so there a window is a sample) and kept ones scaled by 1 / (1 - rate).
        self.drop_path_rate = drop_path
        self.drop_path = _drop_path(drop_path)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor | None = None) -> Tensor:
        # The recomputation (full or selective) lives inside the block, so a compiled block (``block.compile()``)
        # traces it as part of its graph, as torchtitan orders them (checkpoint wrapper, then compile, then FSDP). A
        # checkpoint around a compiled block instead recomputes a graph whose saved tensors differ from the first
        # forward's (``CheckpointError: Recomputed values ... different metadata`` on an H200 under FSDP2 bf16).
        if self.training and torch.is_grad_enabled():
            if self.activation_checkpointing == "full":
                return checkpoint(self._forward, x, rope, mask, use_reentrant=False)
            if self.activation_checkpointing == "selective":
                return checkpoint(self._forward, x, rope, mask, use_reentrant=False, context_fn=selective_contexts)
        return self._forward(x, rope, mask)

    @property
    def activation_checkpointing(self) -> Checkpointing:
        return self._checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, mode: Checkpointing | bool) -> None:
        self._checkpointing = checkpointing_mode(mode)  # a bool too: True is "full", False "off"

    def _forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor | None = None) -> Tensor:
        with step_part("norm"):
            h = self.norm1(x)
        x = x + self.drop_path(self.ls1 * self.attn(h, rope, mask))
        with step_part("norm"):
            h = self.norm2(x)
        ffn = self.ffn(h)
        return x + self.drop_path(ffn if self.ls2 is None else self.ls2 * ffn)


def _drop_path(rate: float) -> nn.Module:
    """timm's per-sample DropPath (the identity in eval mode), or the identity at rate 0. timm is imported here, only
    for a model that drops paths, because importing it costs about a second."""
    if rate == 0:
        return nn.Identity()
    from timm.layers import DropPath

    return DropPath(rate)


@dataclass
class BackboneOutput:
    cls: Tensor  # [B, D]
    registers: Tensor  # [B, R, D]
    patches: Tensor  # [B, n_tokens, D]: the kept tokens (in `keep` order) or the whole token grid
    grid: tuple[int, int]  # token grid (the patch grid, or the reduced grid of the 4K variant)
    keep: Tensor | None  # token-grid indices of `patches`, or None when all tokens are present

    def featmap(self) -> Tensor:
        """[B, D, gh, gw]; only for unmasked outputs."""
        if self.keep is not None:
            raise ValueError("a masked output has no dense feature map")
        return self.patches.transpose(1, 2).unflatten(2, self.grid)


class Sapiens2Backbone(nn.Module):
    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.width
        self.patch_embed = nn.Conv2d(cfg.in_chans, D, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D))
        self.registers = nn.Parameter(torch.zeros(1, cfg.num_registers, D))
        # 4K: each window's pooling token is the [CLS] token plus this learned offset (zero at init).
        self.window_query = nn.Parameter(torch.zeros(1, 1, D)) if cfg.window else None
        rates = cfg.drop_path_rates()
        self.local_blocks = nn.ModuleList(Block(cfg, cfg.heads, rates[i]) for i in range(cfg.local_depth))
        self.blocks = nn.ModuleList(
            Block(cfg, cfg.block_kv_heads(i), rates[cfg.local_depth + i]) for i in range(cfg.depth)
        )
        self.norm = nn.RMSNorm(D, eps=cfg.norm_eps)
        self.init_weights()

    @property
    def activation_checkpointing(self) -> Checkpointing | None:
        """What the blocks recompute in the backward pass (each reads its mode at each forward); None if they
        differ. Setting it sets every block's (a bool too: True is "full", False "off")."""
        modes = {blk.activation_checkpointing for blk in self.all_blocks}
        return modes.pop() if len(modes) == 1 else None

    @activation_checkpointing.setter
    def activation_checkpointing(self, mode: Checkpointing | bool) -> None:
        for blk in self.all_blocks:
            blk.activation_checkpointing = mode

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter; call after materialising a model built on the meta device."""
        for m in self.modules():
            self._init_module(m)
        self._init_tokens()

    def _init_module(self, m: nn.Module) -> None:
        """The parameters ``m`` holds itself (not its children's): every module's in ``init_weights``'s order."""
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.RMSNorm):
            m.reset_parameters()
        elif isinstance(m, Block):
            m.ls1.fill_(self.cfg.layer_scale_init)
            if m.ls2 is not None:
                m.ls2.fill_(self.cfg.layer_scale_init)

    def _init_tokens(self) -> None:
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        nn.init.trunc_normal_(self.registers, std=0.02)
        if self.window_query is not None:
            nn.init.zeros_(self.window_query)

    @property
    def all_blocks(self) -> list[Block]:
        """Windowed then global blocks, in forward order: the units to shard or compile."""
        return [*self.local_blocks, *self.blocks]

    def no_weight_decay(self) -> set[str]:
        """Names of norms, biases, layer scales and the learned tokens."""
        tokens = {"cls_token", "registers", "window_query"}
        return {n for n, p in self.named_parameters() if p.ndim <= 1 or n in tokens}

    def patch_grid(self, h: int, w: int) -> tuple[int, int]:
        """Patch grid of an h x w image; `keep` indexes it row-major."""
        p, win = self.cfg.patch_size, self.cfg.window or 1
        if h % (p * win) or w % (p * win):
            raise ValueError(f"image {h}x{w} is not a multiple of {p * win} px")
        return h // p, w // p

    def token_grid(self, h: int, w: int) -> tuple[int, int]:
        """Grid of the tokens the global blocks see (the patch grid shrunk by the window in the 4K variant)."""
        gh, gw = self.patch_grid(h, w)
        win = self.cfg.window or 1
        return gh // win, gw // win

    def forward(self, images: Tensor, keep: Tensor | None = None) -> BackboneOutput:
        B, _, H, W = images.shape
        grid = self.patch_grid(H, W)
        # the parameters' dtype: bf16 under FSDP2's mixed precision, which casts floating inputs of the root module
        # only, and the images are normalised inside it
        x = self.patch_embed(images.to(self.patch_embed.weight.dtype)).flatten(2).transpose(1, 2)  # [B, gh*gw, D]
        coords = grid_coords(*grid, device=x.device)
        if self.cfg.window:
            x, keep, grid = self._local_stage(x, coords, grid, keep)
            coords = grid_coords(*grid, device=x.device)
        elif keep is not None:
            x = x.gather(1, keep[..., None].expand(-1, -1, x.shape[-1]))
        prefix = 1 + self.cfg.num_registers
        coords = coords if keep is None else coords[keep]
        rope = rope_tables(coords, self.cfg.head_dim, self.cfg.rope_base, prefix)
        x = torch.cat([self.cls_token.expand(B, -1, -1), self.registers.expand(B, -1, -1), x], dim=1)
        for blk in self.blocks:
            x = blk(x, rope)
        with step_part("norm"):
            x = self.norm(x)
        return BackboneOutput(cls=x[:, 0], registers=x[:, 1:prefix], patches=x[:, prefix:], grid=grid, keep=keep)

    def _local_stage(
        self, x: Tensor, coords: Tensor, grid: tuple[int, int], keep: Tensor | None
    ) -> tuple[Tensor, Tensor | None, tuple[int, int]]:
        """Windowed blocks + per-window pooling: [B, gh*gw, D] -> [B, n_windows, D] (kept windows only)."""
        B, N, D = x.shape
        win, (gh, gw) = self.cfg.window, grid
        assert win is not None and self.window_query is not None  # only the 4K variant has a local stage
        th, tw = gh // win, gw // win
        # Patch index of every window slot, windows and slots both row-major: [th * tw, win * win].
        slots = torch.arange(N, device=x.device).view(th, win, tw, win).transpose(1, 2).reshape(th * tw, win * win)
        mask = None
        if keep is None:
            windows = slots.expand(B, -1, -1)
        else:
            # Windows without a visible patch are dropped before (equivalently: after) the local stage, since
            # windows never see each other there; they therefore never reach the global stage.
            visible = torch.zeros(B, N, dtype=torch.bool, device=x.device).scatter_(1, keep, True)[:, slots]
            kept_windows = visible.any(-1)  # [B, th * tw]
            n = kept_windows.sum(1)
            if (n != n[0]).any():
                raise ValueError(f"every image needs the same number of visible windows, got {n.tolist()}")
            keep = kept_windows.nonzero()[:, 1].view(B, -1)  # sorted window indices on the reduced grid
            windows = slots[keep]  # [B, n, win * win]
            visible = visible.gather(1, keep[..., None].expand(-1, -1, win * win))
            # Masked patches of a kept window are not keys; the pooling token is always one, so no row is empty.
            mask = F.pad(visible.flatten(0, 1), (1, 0), value=True)[:, None, None, :]
        tokens = x.gather(1, windows.flatten(1)[..., None].expand(-1, -1, D)).view(-1, win * win, D)
        query = (self.cls_token + self.window_query).expand(tokens.shape[0], -1, -1)
        seq = torch.cat([query, tokens], dim=1)
        rope = rope_tables(coords[windows].flatten(0, 1), self.cfg.head_dim, self.cfg.rope_base, 1)
        for blk in self.local_blocks:
            seq = blk(seq, rope, mask)
        return seq[:, 0].view(B, -1, D), keep, (th, tw)


# ---------------------------------------------------------------------------------------------------------------


def build(cfg: BackboneConfig | str, device: torch.device | str | None = None) -> Sapiens2Backbone:
    cfg = SIZES[cfg] if isinstance(cfg, str) else cfg
    with torch.device(device or "cpu"):
        return Sapiens2Backbone(cfg)


@torch.no_grad()
def init_streamed(cfg: BackboneConfig, write: Callable[[str, Tensor], None]) -> None:
    """The weights ``build(cfg)`` draws from the default generator's current state, one module's at a time: each
    parameter's full tensor goes to ``write(name, tensor)`` and is dropped, so the host holds one module's weights,
    never the backbone's (a meta-device build then keeps only its shards). The generator ends where ``build``
    leaves it.

    The values are the constructors' and ``init_weights``' own draws, in their order, on full tensors: a rank's
    shard is then exactly the seeded plain build's, at any world size. Drawing per shard instead would give other
    values for every world size."""
    shadow = build(cfg, "meta")  # the backbone's modules and names; tensors materialised one module at a time
    # The constructors draw every Linear and Conv2d weight (reset_parameters, in construction order, which is the
    # modules' order) before init_weights redraws them: those draws only move the generator, so they run on
    # throwaway tensors.
    for m in shadow.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            with _materialised(m):
                m.reset_parameters()
    for prefix, m in [*list(shadow.named_modules())[1:], ("", shadow)]:  # the root's tokens last, as init_weights
        with _materialised(m):
            if m is shadow:
                shadow._init_tokens()
            else:
                shadow._init_module(m)
            for name, p in m.named_parameters(recurse=False):
                write(f"{prefix}.{name}" if prefix else name, p)


@contextlib.contextmanager
def _materialised(module: nn.Module) -> Iterator[None]:
    """``module``'s own parameters as (uninitialised) CPU tensors while the block runs, back on meta after it."""
    module.to_empty(device="cpu", recurse=False)
    try:
        yield
    finally:
        module.to_empty(device="meta", recurse=False)


def count_params(cfg: BackboneConfig | str) -> int:
    """Parameter count, from a model built on the meta device (no weights are allocated)."""
    return sum(p.numel() for p in build(cfg, "meta").parameters())


def flops(
    cfg: BackboneConfig | str,
    height: int = 1024,
    width: int = 768,
    *,
    visible: float = 1.0,
    attention: bool = False,
) -> float:
    """Forward multiply-adds (MACs) of one image.

    The public card's figures are multiply-adds of the weight matrices, about params x tokens (5B at 1024x768:
    15.60 T here vs 15.722 T on the card, -0.8%; 0.1B +2.6%, 0.4B -3.4%, 0.8B -3.3%, 1B -5.0%), and leave out the
    attention score and value products, so that is the default. `attention=True` adds them (2 * L^2 * width per
    block, +16.6% for 5B at 1024x768), which is what a utilisation (MFU) figure needs; training FLOPs are then
    about 2 x 3 x this (a MAC is two FLOPs; the backward pass costs twice the forward). `visible` is the fraction
    of patches (4K: of windows) the encoder keeps.
    """
    cfg = SIZES[cfg] if isinstance(cfg, str) else cfg
    D, p = cfg.width, cfg.patch_size
    gh, gw = height // p, width // p
    prefix = 1 + cfg.num_registers

    def block_macs(kv_heads: int, seqs: float, length: float) -> float:
        kv = kv_heads * cfg.head_dim
        linear = D * (D + 2 * kv) + D * D + 3 * D * cfg.hidden  # qkv, proj, SwiGLU
        return seqs * (length * linear + (2 * length * length * D if attention else 0.0))

    total: float = gh * gw * cfg.in_chans * p * p * D  # patch embedding runs on the whole image
    if cfg.window:
        win2 = cfg.window**2
        n_windows = round(visible * gh * gw / win2)
        total += cfg.local_depth * block_macs(cfg.heads, n_windows, 1 + win2)
        n_tokens = n_windows
    else:
        n_tokens = round(visible * gh * gw)
    total += sum(block_macs(cfg.block_kv_heads(i), 1, prefix + n_tokens) for i in range(cfg.depth))
    return float(total)
