"""Full profile OpenCLIP image embedding, computed once per image and shared by its scorers:

- ``embedding``: the L2-normalised image embedding (``models.embedding.dim`` values; dedup and sampling read it);
- ``aesthetic``: LAION's aesthetic predictor, a small head on the normalised embedding (about 1..10; rejects below
  ``filters.min_aesthetic`` with ``low_aesthetic``);
- ``clip_nsfw_score``: LAION's CLIP-based NSFW detector, a small head on the same normalised embedding (P(NSFW);
  rejects above ``filters.clip_nsfw_max_score`` with ``nsfw``, before the other filters: safety is the reason
  recorded);
- ``realism``: zero-shot probability that the image is a photograph: a softmax (with the model's logit scale) over
  the prompts of ``models.clip.realism.photo`` and ``.not_photo`` (paintings, cartoons, 3D renders, screenshots...),
  summed over the photo prompts (rejects below ``filters.min_realism`` with ``low_realism``);
- prompt filters (``filters.prompt_filters``): the same softmax over a keep set and a reject set; an image whose
  reject probability exceeds the filter's ``max_reject`` is rejected with ``prompt_<name>``.

The thresholds are decided on the stored values (``decide``): the probabilities and closest prompts of realism and of
each prompt filter are columns (``realism_prompt``, ``prompt_scores``), so a threshold changes without the model; a
change of a filter's prompt sets needs the model again.

Prompt texts are embedded once at setup. Images are decoded at the size the model needs (JPEG draft mode, then
open_clip's own resize rule: bicubic to the model's size on the shortest side and a centre crop, by default), one
batch per call, normalised on the device; fp16 on a GPU (``models.clip.precision``), fp32 on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from PIL import Image

from common.imageio import open_reduced
from curation.score.stage import Row, Stage, Update
from curation.settings import Filters
from curation.stages.nsfw import nsfw_detail

PROMPT_SCORES_TYPE = pa.list_(
    pa.struct([("name", pa.string()), ("p_reject", pa.float32()), ("closest_prompt", pa.string())])
)
NSFW_MODEL_NAME = "laion_clip_nsfw"  # in rejection details: whose scale the score is on

_INTERPOLATION = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}


def clip_input(
    data: bytes, width: int, height: int, size: tuple[int, int], resize_mode: str, interpolation: str
) -> np.ndarray:
    """One image as open_clip's eval transform would give it, before normalisation: (size_h, size_w, 3) uint8."""
    th, tw = size
    short, long = min(width, height), max(width, height)
    # Draft-decode no smaller than the resize target, so the bicubic resize below does the real reduction.
    need = max(th, tw) * (long / short if resize_mode == "shortest" else 1.0)
    img = open_reduced(data, max_side=math.ceil(need), mode="RGB")
    w, h = img.size
    resample = _INTERPOLATION.get(interpolation, Image.Resampling.BICUBIC)
    if resize_mode == "squash":
        return np.asarray(img.resize((tw, th), resample))
    if resize_mode == "longest":
        s = min(tw / w, th / h)
        img = img.resize((max(1, round(w * s)), max(1, round(h * s))), resample)
        out = np.zeros((th, tw, 3), np.uint8)  # open_clip pads with 0
        y0, x0 = (th - img.height) // 2, (tw - img.width) // 2
        out[y0 : y0 + img.height, x0 : x0 + img.width] = np.asarray(img)
        return out
    s = max(tw / w, th / h)  # shortest side to size, then centre crop
    img = img.resize((max(tw, round(w * s)), max(th, round(h * s))), resample)
    x0, y0 = (img.width - tw) // 2, (img.height - th) // 2
    return np.asarray(img.crop((x0, y0, x0 + tw, y0 + th)))


class ClipStage(Stage):
    name = "clip"
    reads = ("image", "width", "height")
    columns = (
        pa.field("aesthetic", pa.float32()),  # learned aesthetic predictor
        pa.field("realism", pa.float32()),  # zero-shot photo-vs-rendering score
        pa.field("clip_nsfw_score", pa.float32()),  # LAION's CLIP NSFW head
        pa.field("realism_prompt", pa.string()),  # the most probable prompt of the realism softmax
        # per prompt filter, in the config's order: P(reject set) and the most probable prompt of its softmax
        pa.field("prompt_scores", PROMPT_SCORES_TYPE),
    )
    column_order = 35  # after the lite profile's quality columns
    writes = ("embedding", "aesthetic", "realism", "clip_nsfw_score", "realism_prompt", "prompt_scores")
    model_section = "clip"
    thresholds = decided = ("min_aesthetic", "min_realism", "prompt_filters", "clip_nsfw_max_score")
    decision_codes = ("nsfw", "low_aesthetic", "low_realism", "prompt_*")
    uses_actors = True

    def setup(self) -> None:
        import torch

        from curation import models

        c, f = self.cfg.models.clip, self.cfg.filters
        store = models.ModelStore.from_settings(self.cfg.models.store)
        torch.set_num_threads(self.threads)
        self.device, self.dtype = models.device_and_dtype(c.precision)
        if f.min_aesthetic is not None and c.aesthetic_head is None:
            raise ValueError("filters.min_aesthetic is set but models.clip.aesthetic_head is null")
        if f.clip_nsfw_max_score is not None and c.nsfw_head is None:
            raise ValueError("filters.clip_nsfw_max_score is set but models.clip.nsfw_head is null")
        # Both heads are fetched before the CLIP model loads: a missing file fails the actor fast.
        head_path = store.fetch(c.aesthetic_head, "models.clip.aesthetic_head") if c.aesthetic_head else None
        nsfw_path = store.fetch(c.nsfw_head, "models.clip.nsfw_head") if c.nsfw_head else None
        self.clip = models.load_clip(store, c, self.device, self.dtype)
        model = self.clip.model
        pre = self.clip.preprocess
        size = pre["size"]
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.resize_mode, self.interpolation = pre.get("resize_mode", "shortest"), pre.get("interpolation", "bicubic")
        self.mean = torch.tensor(pre["mean"], device=self.device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(pre["std"], device=self.device).view(1, 3, 1, 1) * 255
        with torch.inference_mode():
            dim = int(self._encode(torch.zeros((1, *self.size, 3), dtype=torch.uint8)).shape[1])
        want = self.cfg.models.embedding.dim
        if dim != want:
            raise ValueError(
                f"models.embedding.dim is {want} but the CLIP model {self.clip.source} gives {dim}-dimensional "
                f"embeddings; set models.embedding.dim: {dim} (dedup and sampling size their arrays by it)"
            )
        self.head = self._head(head_path, models.aesthetic_head_from_state_dict, "aesthetic_head", dim)
        self.nsfw_head = self._head(nsfw_path, models.nsfw_head_from_state_dict, "nsfw_head", dim)
        # Every prompt set in use, embedded once in one batch.
        used = [c.realism.photo, c.realism.not_photo] + [
            s for pf in f.prompt_filters.values() for s in (pf.keep, pf.reject)
        ]
        self.set_rows: dict[str, slice] = {}
        prompts: list[str] = []
        for name in dict.fromkeys(used):
            self.set_rows[name] = slice(len(prompts), len(prompts) + len(c.prompt_sets[name]))
            prompts += c.prompt_sets[name]
        self.prompts = prompts
        with torch.inference_mode():
            text = model.encode_text(self.clip.tokenizer(prompts).to(self.device)).float()
            self.text = torch.nn.functional.normalize(text, dim=-1)
            self.logit_scale = float(model.logit_scale.exp().clamp(max=100))
        self._decoder = ThreadPoolExecutor(self.threads)  # PIL releases the GIL while decoding and resizing

    def _head(self, path: Path | None, build: Callable[[dict], Any], key: str, dim: int) -> Any:
        """A head on the embedding from its state dict (loaded safely), on the device; None without a file."""
        from curation import models

        if path is None:
            return None
        ref = getattr(self.cfg.models.clip, key)
        try:
            head = build(models.load_state_dict(path)).to(self.device)
        except ValueError as exc:
            raise ValueError(f"models.clip.{key} {ref!r}: {exc}") from None
        if models.head_input_dim(head) != dim:
            raise ValueError(
                f"models.clip.{key} {ref!r} takes {models.head_input_dim(head)}-dimensional embeddings but the CLIP "
                f"model gives {dim}; pair the head with its CLIP model"
            )
        return head

    def _encode(self, batch: Any) -> Any:
        """(B, H, W, 3) uint8 tensor -> L2-normalised float32 embeddings (B, dim), one forward pass."""
        import torch

        x = batch.to(self.device).permute(0, 3, 1, 2).float()
        x = ((x - self.mean) / self.std).to(self.dtype)
        return torch.nn.functional.normalize(self.clip.model.encode_image(x).float(), dim=-1)

    def _set_probability(self, emb: Any, first: str, second: str) -> tuple[np.ndarray, np.ndarray]:
        """P(first set) under a softmax over both sets' prompts, and the most probable prompt's index, per image."""
        import torch

        rows = list(range(len(self.prompts)))
        idx = rows[self.set_rows[first]] + rows[self.set_rows[second]]
        prob = torch.softmax(self.logit_scale * emb @ self.text[idx].T, dim=-1)
        n_first = len(rows[self.set_rows[first]])
        top = torch.as_tensor(idx, device=prob.device)[prob.argmax(-1)]
        return prob[:, :n_first].sum(-1).cpu().numpy(), top.cpu().numpy()

    def process_batch(self, rows: list[Row]) -> list[Update]:
        import torch

        arrays = list(
            self._decoder.map(
                lambda r: clip_input(
                    r["image"]["bytes"],
                    int(r["width"]),
                    int(r["height"]),
                    self.size,
                    self.resize_mode,
                    self.interpolation,
                ),
                rows,
            )
        )
        c, f = self.cfg.models.clip, self.cfg.filters
        with torch.inference_mode():
            emb = self._encode(torch.from_numpy(np.stack(arrays)))
            aesthetic = self.head(emb).float().squeeze(-1).cpu().numpy() if self.head is not None else None
            nsfw = self.nsfw_head(emb).float().squeeze(-1).cpu().numpy() if self.nsfw_head is not None else None
            realism, realism_top = self._set_probability(emb, c.realism.photo, c.realism.not_photo)
            filters = {name: self._set_probability(emb, pf.reject, pf.keep) for name, pf in f.prompt_filters.items()}
        emb_np = emb.cpu().numpy()
        return [
            {
                "embedding": emb_np[i].tolist(),
                "aesthetic": float(aesthetic[i]) if aesthetic is not None else None,
                "realism": float(realism[i]),
                "clip_nsfw_score": float(nsfw[i]) if nsfw is not None else None,
                "realism_prompt": self.prompts[realism_top[i]],
                "prompt_scores": [
                    {"name": name, "p_reject": float(p_reject[i]), "closest_prompt": self.prompts[top[i]]}
                    for name, (p_reject, top) in filters.items()
                ],
            }
            for i in range(len(rows))
        ]

    @classmethod
    def decide(cls, row: Row, filters: Filters) -> str | None:
        f, nsfw, aesthetic, realism = filters, row["clip_nsfw_score"], row["aesthetic"], row["realism"]
        if nsfw is not None and f.clip_nsfw_max_score is not None and nsfw > f.clip_nsfw_max_score:
            return f"nsfw: {nsfw_detail(nsfw, f.clip_nsfw_max_score, NSFW_MODEL_NAME)}"  # safety is the reason kept
        if aesthetic is not None and f.min_aesthetic is not None and aesthetic < f.min_aesthetic:
            return f"low_aesthetic: aesthetic {aesthetic:.2f} < {f.min_aesthetic}"
        if f.min_realism is not None and realism < f.min_realism:
            return f"low_realism: realism {realism:.2f} < {f.min_realism} (closest prompt {row['realism_prompt']!r})"
        scores = {s["name"]: s for s in row["prompt_scores"] or ()}
        for name, pf in f.prompt_filters.items():
            p_reject, top = scores[name]["p_reject"], scores[name]["closest_prompt"]
            if p_reject > pf.max_reject:
                return f"prompt_{name}: p({pf.reject}) {p_reject:.2f} > {pf.max_reject} against {pf.keep} (closest prompt {top!r})"
        return None

    @classmethod
    def computed_settings(cls, filters: Filters) -> dict[str, Any]:
        """Which prompt sets each filter compares: a filter added, or another set, needs the model."""
        return {"prompt_filters": {name: [pf.keep, pf.reject] for name, pf in filters.prompt_filters.items()}}
