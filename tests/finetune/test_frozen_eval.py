"""Frozen-feature evaluation (finetune/frozen_eval.py, jobs/probe.py) on generated renders: each read-out finds a
label in features that hold it, finds nothing in features that do not, and the job runs end to end on the random
init fine-tuning starts from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from common.config import load_config
from finetune.augment import mirror_order
from finetune.config import FinetuneConfig
from finetune.frozen_eval import (
    FINAL,
    FrozenEval,
    ProbeSettings,
    Split,
    Tokens,
    backbone_features,
    evaluate_tokens,
    knn_transfer,
    left_right_probe,
    miou,
    pixel_miou,
    read_split,
    seg_probe,
    sides,
    to_grayscale,
    token_fractions,
)
from finetune.labels import PARTS
from finetune.train import build_model, make_task
from jobs import make_synthetic, probe

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/finetune/tiny.yaml"
C = len(PARTS)
GRID = (16, 12)  # 8-pixel tokens on 128x96 renders
FAST = ProbeSettings(iters=30, weight_decays=(1e-3, 1e-1))


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the fits are small: more threads only contend with whatever else runs
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def renders(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("labelled")
    argv = ["--out", str(out), "--n", "24", "--val", "16", "--test", "8", "--keypoints", "17", "--seed", "1"]
    assert make_synthetic.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def splits(renders) -> tuple[Split, Split]:
    return read_split(str(renders / "train"))[0], read_split(str(renders / "val"))[0]


def fake_tokens(split: Split, features, seed: int) -> Tokens:
    """Tokens of ``split`` whose features are ``features(fractions, seed)`` [N, gh, gw, D]."""
    fractions = token_fractions(split.parts, GRID, C)
    return Tokens({"fake": features(fractions, seed)}, fractions, split.parts)


def noise(shape, scale: float, seed: int) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def labels_plus_noise(fractions: torch.Tensor, seed: int) -> torch.Tensor:
    return 3 * F.one_hot(fractions.argmax(-1), C).float() + noise(fractions.shape, 0.3, seed)


def pure_noise(fractions: torch.Tensor, seed: int) -> torch.Tensor:
    return noise((*fractions.shape[:3], 32), 1.0, seed)


def background_only(tokens: Tokens) -> tuple[float, float]:
    """(pixel, token) mIoU of predicting background everywhere: what a probe that learnt nothing scores."""
    pixel = torch.zeros(*tokens.fractions.shape[:3], C)
    pixel[..., 0] = 1
    keep = tokens.fractions.sum(-1) > 0
    return pixel_miou(pixel, tokens.parts, C), miou(
        torch.zeros(int(keep.sum()), dtype=torch.long), tokens.majority[keep], C
    )


# --- labels of tokens ---------------------------------------------------------------------------------------------


def test_token_fractions_are_each_tokens_share_of_its_labelled_pixels():
    parts = torch.zeros(1, 4, 4, dtype=torch.long)
    parts[0, :2, :2] = torch.tensor([[3, 3], [3, 5]])  # token (0, 0): 3 of class 3, 1 of class 5
    parts[0, :2, 2:] = torch.tensor([[255, 255], [255, 7]])  # token (0, 1): the ignore index does not count
    fr = token_fractions(parts, (2, 2), 8)
    assert fr.shape == (1, 2, 2, 8)
    assert fr[0, 0, 0, 3] == 0.75 and fr[0, 0, 0, 5] == 0.25
    assert fr[0, 0, 1, 7] == 1.0 and fr[0, 0, 1].sum() == 1.0
    assert fr[0, 1, 0, 0] == 1.0 and fr[0, 1, 1, 0] == 1.0
    assert token_fractions(torch.full((1, 2, 2), 255), (1, 1), 8).sum() == 0  # no labelled pixel: all zeros


def test_sides_pair_every_left_part_with_its_right_one():
    side = sides(PARTS)
    order = mirror_order(PARTS)
    assert order is not None
    sided = [i for i in range(C) if side[i] >= 0]
    assert {PARTS[i] for i in sided} >= {"left_hand", "right_hand", "left_foot", "right_lower_leg", "left_shoe"}
    assert all(side[i] == 0 and side[order[i]] == 1 for i in sided if PARTS[i].startswith("left"))
    assert side[PART_INDEX["torso"]] == -1 and side[PART_INDEX["background"]] == -1


PART_INDEX = {name: i for i, name in enumerate(PARTS)}


# --- the read-outs on features that do or do not hold the label -----------------------------------------------------


def test_linear_probe_and_knn_find_the_part_in_features_that_hold_it_and_nothing_in_noise(splits):
    train, val = splits
    informative = fake_tokens(train, labels_plus_noise, 0), fake_tokens(val, labels_plus_noise, 1)
    blind = fake_tokens(train, pure_noise, 2), fake_tokens(val, pure_noise, 3)
    # the best any token-level read-out can do at pixels: the true majority labels, upsampled
    ceiling = pixel_miou(F.one_hot(informative[1].majority, C).float(), val.parts, C)
    chance_pixel, chance_token = background_only(informative[1])
    assert ceiling > 2 * chance_pixel  # the renders leave room between chance and the ceiling

    for read_out in (seg_probe, knn_transfer):
        good = read_out(*informative, "fake", FAST, 0)
        # not 1: a part seen on a validation token or two and on no training token scores 0 for any read-out
        assert good["miou"] > 0.8 and good["holdout_miou"] > 0.8, (read_out.__name__, good)
        assert good["pixel_miou"] > 0.5 * ceiling, (read_out.__name__, good, ceiling)
        bad = read_out(*blind, "fake", FAST, 0)
        assert bad["miou"] < chance_token + 0.03, (read_out.__name__, bad, chance_token)
        assert bad["pixel_miou"] < chance_pixel + 0.03, (read_out.__name__, bad, chance_pixel)


def test_left_right_probe_needs_features_that_encode_the_side(splits):
    train, val = splits
    side = sides(PARTS)
    order = torch.as_tensor(mirror_order(PARTS))
    pair = torch.minimum(torch.arange(C), order)  # left_x and right_x share one index: the part without its side

    def with_side(fr: torch.Tensor, seed: int) -> torch.Tensor:
        s = side[fr[..., 1:].argmax(-1) + 1]
        return F.one_hot(s.clamp(min=0), 2).float() * (s >= 0)[..., None] + noise((*fr.shape[:3], 2), 0.2, seed)

    def part_only(fr: torch.Tensor, seed: int) -> torch.Tensor:
        return F.one_hot(pair[fr.argmax(-1)], C).float() + noise(fr.shape, 0.2, seed)

    for features, low, high in ((with_side, 0.95, 1.0), (part_only, 0.3, 0.7)):
        t, v = fake_tokens(train, features, 0), fake_tokens(val, features, 1)
        r = left_right_probe(t, v, "fake", side, FAST, 0)
        assert min(r["train_tokens"]) >= 40 and min(r["eval_tokens"]) >= 20, r  # enough limb tokens to tell
        assert low <= r["balanced_acc"] <= high, (features.__name__, r)


def test_every_layer_is_read_and_the_best_is_chosen_on_training_images(splits):
    train, val = splits

    def layers(fr: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        return {"noise": noise((*fr.shape[:3], 8), 1.0, seed), "labels": labels_plus_noise(fr, seed)}

    fr_t, fr_v = token_fractions(train.parts, GRID, C), token_fractions(val.parts, GRID, C)
    result = evaluate_tokens(
        Tokens(layers(fr_t, 0), fr_t, train.parts), Tokens(layers(fr_v, 1), fr_v, val.parts), PARTS, FAST, seed=0
    )
    assert set(result["probe"]) == set(result["knn"]) == set(result["left_right"]) == {"noise", "labels"}
    assert result["probe_best"]["layer"] == result["knn_best"]["layer"] == "labels"
    assert result["probe_best"]["miou"] == result["probe"]["labels"]["miou"]


# --- grayscale --------------------------------------------------------------------------------------------------------


def test_grayscale_is_the_luma_in_all_three_channels(splits):
    images = splits[0].images[:4]
    gray = to_grayscale(images)
    assert gray.dtype == torch.uint8 and gray.shape == images.shape
    assert torch.equal(gray[:, 0], gray[:, 1]) and torch.equal(gray[:, 0], gray[:, 2])
    pil = np.stack([np.asarray(Image.fromarray(im.permute(1, 2, 0).numpy()).convert("L")) for im in images])
    assert np.abs(gray[:, 0].numpy().astype(int) - pil).max() <= 1


def test_grayscale_inputs_reach_the_backbone_for_training_and_evaluation_images(splits):
    seen: list[torch.Tensor] = []

    def spy(images: torch.Tensor) -> dict[str, torch.Tensor]:
        seen.append(images)
        return {"x": noise((len(images), *GRID, 4), 1.0, len(seen))}

    train, val = splits
    for grayscale in (True, False):
        seen.clear()
        out = FrozenEval(FAST, (8,), grayscale=grayscale).run(spy, train, val.head(8), PARTS)
        assert sum(len(s) for s in seen) == 8 + 8 and out["config"]["grayscale"] is grayscale
        equal = [bool((s[:, 0] == s[:, 1]).all() and (s[:, 1] == s[:, 2]).all()) for s in seen]
        assert all(equal) if grayscale else not any(equal)


# --- the job ------------------------------------------------------------------------------------------------------------


def test_the_job_probes_the_random_init_fine_tuning_starts_from(renders, tmp_path):
    out = tmp_path / "probe.json"
    argv = ["--data", str(renders), "--backbone", "random", "--out", str(out), "--labels", "8,16", "--seed", "3",
            "--iters", "20", "--val-limit", "12"]  # fmt: skip
    assert probe.main(argv) == 0
    result = json.loads(out.read_text())
    layers = ["block0", "block1", "block2", "block3", FINAL]  # tiny: 4 blocks, then the normed output
    assert result["config"]["layers"] == layers and result["config"]["labels"] == [8, 16]
    assert result["config"]["backbone"] == "random" and result["config"]["seed"] == 3
    assert result["config"]["grid"] == list(GRID) and result["config"]["eval_images"] == 12
    for n in ("8", "16"):
        r = result["results"][n]
        assert set(r["probe"]) == set(r["knn"]) == set(r["left_right"]) == set(layers)
        assert 0 <= r["probe_best"]["miou"] <= 1 and 0 <= r["knn_best"]["miou"] <= 1
        assert r["left_right_best"]["balanced_acc"] is None or 0 <= r["left_right_best"]["balanced_acc"] <= 1
    assert result["timing"]["total_s"] > 0

    # the same numbers as fine-tuning's own random backbone for seed 3, read out directly
    cfg = load_config(FinetuneConfig, TINY, ["seed=3"])
    train, info = read_split(str(renders / "train"), 16)
    backbone = build_model(cfg, make_task("seg", cfg, info, cfg.model.backbone()), None).backbone
    direct = FrozenEval(ProbeSettings(iters=20), (8, 16), seed=3).run(
        backbone_features(backbone), train, read_split(str(renders / "val"), 12)[0], info.parts
    )
    assert direct["results"] == result["results"]

    test = tmp_path / "test.json"  # another split to score on: the training shards, then the split
    split = ["--data", str(renders / "train"), "--val-data", str(renders / "test"), "--labels", "8", "--iters", "5"]
    assert probe.main([*split, "--backbone", "random", "--out", str(test)]) == 0
    assert json.loads(test.read_text())["config"]["eval_images"] == 8


def test_the_job_refuses_what_it_cannot_probe(renders, tmp_path, capsys):
    out = str(tmp_path / "x.json")
    assert probe.main(["--data", str(renders), "--backbone", str(tmp_path / "none.safetensors"), "--out", out]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert probe.main(["--data", str(renders), "--backbone", "random", "--out", out, "--labels", "100"]) == 2
    assert "the training split holds 24 samples" in capsys.readouterr().err


def test_the_test_split_holds_other_figures_and_smaller_sets_are_prefixes(renders, tmp_path):
    def keys(folder: Path) -> list[str]:
        return [
            k
            for f in sorted(folder.glob("part-*.parquet"))
            for k in pq.read_table(f, columns=["key"])["key"].to_pylist()
        ]

    train, val, test = (keys(renders / s) for s in ("train", "val", "test"))
    assert len(test) == 8 and not set(test) & (set(train) | set(val))
    small = tmp_path / "small"
    assert make_synthetic.main(["--out", str(small), "--n", "8", "--val", "4", "--keypoints", "17", "--seed", "1"]) == 0
    assert keys(small / "train") == train[:8] and keys(small / "val") == val[:4]
    assert not (small / "test").exists()
