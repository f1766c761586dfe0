"""The joint MAE + self-distillation objective: MAE targets and loss, EMA teacher, centring, views, NaN guard,
the contrastive term's diagnostics and collapse detection, and a tiny model learning on the sample photos."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode

from pretrain.backbone import SIZES, BackboneOutput, build
from pretrain.masking import Masks, generate_masks
from pretrain.objective import (
    TERMS,
    CLConfig,
    CollapseMonitor,
    JointObjective,
    MAEConfig,
    MAEDecoder,
    NonFiniteLossError,
    ObjectiveConfig,
    collapse_state,
    contrastive_diagnostics,
    decoder_macs,
    distillation_loss,
    mae_loss,
    mae_targets,
    patchify,
    sinkhorn_knopp,
    teacher_momentum,
    teacher_temperature,
    unpatchify,
)
from pretrain.views import Views, ViewsConfig, colour_augment, make_views, normalize

SMALL_VIEWS = ViewsConfig(global_size=(64, 48), local_size=(32, 32), n_local=2)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small_config(**changes) -> ObjectiveConfig:
    cfg = ObjectiveConfig(
        mae=MAEConfig(width=32, depth=1, heads=4),
        cl=CLConfig(hidden=64, bottleneck=32, prototypes=64),
        views=SMALL_VIEWS,
    )
    return cfg.model_copy(update=changes)


def tiny_objective(total_steps: int = 100, **changes) -> JointObjective:
    torch.manual_seed(0)
    return JointObjective(build("tiny"), small_config(**changes), total_steps=total_steps)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- MAE ----------------------------------------------------------------------------------------------------------


def test_patchify_layout_and_pixel_shuffle_roundtrip() -> None:
    x = torch.randn(2, 3, 48, 32)
    p = patchify(x, 16)
    assert p.shape == (2, 6, 768)
    # patch (row 1, col 1) of the 3x2 grid is index 3, laid out (C, 16, 16)
    assert torch.equal(p[1, 3], x[1, :, 16:32, 16:32].reshape(-1))
    assert torch.equal(unpatchify(p, (3, 2), 16), x)


def test_mae_targets_are_normalised_per_patch() -> None:
    x = torch.rand(2, 3, 32, 32) * 5 + 3
    t = mae_targets(x, 16)
    assert t.mean(-1).abs().max() < 1e-5
    assert (t.var(-1) - 1).abs().max() < 1e-3
    assert torch.equal(mae_targets(x, 16, norm_pix=False), patchify(x, 16))


def test_mae_loss_zero_on_perfect_prediction_and_blind_to_visible_patches() -> None:
    target = mae_targets(torch.rand(4, 3, 64, 48), 16)  # 4x3 grid
    masks = generate_masks(4, (4, 3), generator=_gen())
    assert mae_loss(target.clone(), target, masks.masked).item() == 0.0

    pred = (target + torch.randn_like(target)).requires_grad_(True)
    loss = mae_loss(pred, target, masks.masked)
    manual = ((pred - target) ** 2).mean(-1)[masks.mask].mean()
    assert loss.item() > 0.5 and loss.item() == pytest.approx(manual.item(), rel=1e-5)

    # Anything at the visible patches, even NaN, changes neither the loss nor any gradient.
    other = pred.detach().clone()
    other[~masks.mask] = float("nan")
    other.requires_grad_(True)
    other_loss = mae_loss(other, target, masks.masked)
    assert other_loss.item() == loss.item()
    loss.backward()
    other_loss.backward()
    assert torch.equal(other.grad, pred.grad)
    assert (pred.grad[~masks.mask] == 0).all() and (pred.grad[masks.mask] != 0).any()


def test_decoder_fills_masked_positions_from_mask_tokens() -> None:
    obj = tiny_objective()
    images = torch.randn(3, 3, 64, 48)
    masks = generate_masks(3, (4, 3), generator=_gen())
    enc = obj.student(images, masks.keep)
    pred = obj.decoder(enc)
    assert pred.shape == (3, 12, 3 * 16 * 16)
    mae_loss(pred, mae_targets(images, 16), masks.masked).backward()
    assert obj.decoder.mask_token.grad.abs().sum() > 0  # masked positions are predicted from the mask token


# --- teacher ------------------------------------------------------------------------------------------------------


def test_momentum_and_temperature_schedules() -> None:
    assert teacher_momentum(0, 1000) == pytest.approx(0.996)
    assert teacher_momentum(500, 1000) == pytest.approx(0.998)
    assert teacher_momentum(1000, 1000) == 1.0 and teacher_momentum(5000, 1000) == 1.0
    cl = CLConfig(teacher_temp_warmup=0.04, teacher_temp=0.07, teacher_temp_warmup_steps=30)
    assert teacher_temperature(0, cl) == pytest.approx(0.04)
    assert teacher_temperature(15, cl) == pytest.approx(0.055)
    assert teacher_temperature(30, cl) == teacher_temperature(10_000, cl) == 0.07


def test_ema_update_is_m_teacher_plus_one_minus_m_student() -> None:
    obj = tiny_objective(total_steps=1000)
    teacher = [*obj.teacher["backbone"].parameters(), *obj.teacher["head"].parameters()]
    student = [*obj.student.parameters(), *obj.head.parameters()]
    assert len(teacher) == len(student) > 10
    with torch.no_grad():
        for t, s in zip(teacher, student):
            t.copy_(torch.randn_like(t))
            s.copy_(torch.randn_like(s))
    before = [t.detach().clone() for t in teacher]
    m = obj.update_teacher(500)
    assert m == pytest.approx(0.998)
    for t, t0, s in zip(teacher, before, student):
        torch.testing.assert_close(t, m * t0 + (1 - m) * s, rtol=1e-6, atol=1e-6)


def test_centering_math() -> None:
    cl = CLConfig(prototypes=8, teacher_temp_warmup=0.04, teacher_temp=0.07, teacher_temp_warmup_steps=10)
    obj = tiny_objective(cl=cl)
    s1, s2 = torch.randn(6, 8), torch.randn(6, 8)
    # First batch: the centre starts at its mean.
    p1 = obj.teacher_probs(s1, step=0)
    c1 = s1.mean(0, keepdim=True)
    torch.testing.assert_close(p1, F.softmax((s1 - c1) / 0.04, dim=-1))
    torch.testing.assert_close(obj.center, c1)
    # Later: softmax against the current centre, then centre <- m * centre + (1 - m) * batch mean.
    p2 = obj.teacher_probs(s2, step=5)
    torch.testing.assert_close(p2, F.softmax((s2 - c1) / 0.055, dim=-1))
    torch.testing.assert_close(obj.center, 0.9 * c1 + 0.1 * s2.mean(0, keepdim=True))


def test_sinkhorn_balances_prototypes() -> None:
    scores = torch.randn(32, 8) + torch.tensor([3.0] + [0.0] * 7)  # prototype 0 would dominate a softmax
    q = sinkhorn_knopp(scores, temp=0.1, iters=50)
    torch.testing.assert_close(q.sum(1), torch.ones(32))
    torch.testing.assert_close(q.sum(0), torch.full((8,), 4.0), rtol=1e-3, atol=1e-3)
    assert F.softmax(scores / 0.1, -1).sum(0)[0] > 20  # ... which the balancing undid


def test_distillation_loss_pairs_every_teacher_view_with_the_other_student_views() -> None:
    g, v, b, k = 2, 5, 3, 7
    probs = F.softmax(torch.randn(g, b, k), -1)
    logits = torch.randn(v, b, k)
    expected = [
        -(probs[i] * F.log_softmax(logits[j] / 0.1, -1)).sum(-1).mean() for i in range(g) for j in range(v) if i != j
    ]
    assert distillation_loss(probs, logits, 0.1).item() == pytest.approx(torch.stack(expected).mean().item(), rel=1e-5)


def test_no_gradient_reaches_the_teacher() -> None:
    obj = tiny_objective()
    assert all(not p.requires_grad for p in obj.teacher.parameters())
    out = obj(torch.rand(4, 3, 96, 72), step=0, generator=_gen())
    assert tuple(out) == TERMS and out["loss"].requires_grad
    assert all(v.ndim == 0 and not v.requires_grad and v.grad_fn is None for k, v in out.items() if k != "loss")
    out["loss"].backward()
    assert all(p.grad is None for p in obj.teacher.parameters())
    for module in (obj.student, obj.decoder, obj.head):
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())
    before = [p.clone() for p in obj.teacher.parameters()]
    torch.optim.SGD([p for p in obj.parameters() if p.requires_grad], lr=1.0).step()
    assert all(torch.equal(a, p) for a, p in zip(before, obj.teacher.parameters()))  # only update_teacher moves it
    obj.update_teacher(0)
    assert not all(torch.equal(a, p) for a, p in zip(before, obj.teacher.parameters()))
    obj.train()
    assert obj.student.training and not obj.teacher.training


# --- diagnostics and collapse detection ---------------------------------------------------------------------------


def test_diagnostics_on_constructed_inputs() -> None:
    g, b, k = 2, 3, 16
    cls = torch.randn(g * b, 8)
    logits = torch.randn(g, b, k)
    uniform = contrastive_diagnostics(torch.full((g, b, k), 1 / k), torch.zeros(g, b, k), cls, 0.1)
    assert uniform["teacher_entropy"].item() == pytest.approx(math.log(k), rel=1e-6)
    assert uniform["student_entropy"].item() == pytest.approx(math.log(k), rel=1e-6)  # equal logits: uniform

    same = F.one_hot(torch.full((g, b), 5), k).float()  # every row one-hot on prototype 5
    d = contrastive_diagnostics(same, logits, cls, 0.1)
    assert d["teacher_entropy"].item() == 0.0 and d["proto_used"].item() == 1.0
    expected = torch.distributions.Categorical(logits=logits / 0.1).entropy().mean()
    assert d["student_entropy"].item() == pytest.approx(expected.item(), rel=1e-5)
    spread = F.one_hot(torch.tensor([[0, 1, 1], [2, 9, 0]]), k).float()
    assert contrastive_diagnostics(spread, logits, cls, 0.1)["proto_used"].item() == 4.0

    flat = contrastive_diagnostics(same, logits, torch.randn(1, 8).expand(g * b, 8), 0.1)
    assert flat["cls_std"].item() == 0.0 and flat["cls_rms"].item() > 0.1
    two = contrastive_diagnostics(same[:1, :2], logits[:1, :2], torch.tensor([[0.0, 0.0], [2.0, 2.0]]), 0.1)
    assert two["cls_std"].item() == pytest.approx(math.sqrt(2))  # unbiased std of {0, 2} in each dim
    assert two["cls_rms"].item() == pytest.approx(math.sqrt(2))  # sqrt((0 + 0 + 4 + 4) / 4)
    one_row = contrastive_diagnostics(same[:1, :1], logits[:1, :1], cls[:1], 0.1)
    assert one_row["cls_std"].item() == 0.0  # not NaN


def test_the_distillation_loss_is_the_teacher_entropy_plus_the_students_kl() -> None:
    """L_CL = H(teacher targets) + KL(teacher || student), averaged over the view pairs: every teacher view meets
    the same number of student views, so H is the diagnostics' teacher_entropy and cl - teacher_entropy (the
    console's "kl", the part of L_CL the student can lower) is a mean KL divergence, never negative."""
    g, v, b, k, temp = 2, 4, 3, 16, 0.1  # two global views (the teacher's) and two local ones
    probs = torch.softmax(torch.randn(g, b, k) / 0.3, dim=-1)
    logits = torch.randn(v, b, k)
    cl = distillation_loss(probs, logits, temp)
    d = contrastive_diagnostics(probs, logits[:g], torch.randn(g * b, 8), temp)
    log_s = F.log_softmax(logits / temp, dim=-1)
    kl = [
        F.kl_div(log_s[s], probs[t], reduction="batchmean")  # KL(teacher view t || student view s), batch mean
        for t in range(g)
        for s in range(v)
        if s != t
    ]
    assert cl.item() == pytest.approx(d["teacher_entropy"].item() + torch.stack(kl).mean().item(), rel=1e-5)
    assert cl.item() - d["teacher_entropy"].item() > 0
    # views whose targets agree and a student that matches them exactly: only H is left, the part it cannot move
    agree = probs[:1].expand(g, b, k)
    exact = agree[:1].log().expand(v, b, k) * temp
    h = contrastive_diagnostics(agree, exact[:g], torch.randn(g * b, 8), temp)["teacher_entropy"].item()
    assert distillation_loss(agree, exact, temp).item() == pytest.approx(h, rel=1e-5)


def _diag(
    entropy: float, batch: float | None = None, std: float = 0.5, rms: float = 1.0, used: float = 8.0
) -> dict[str, float]:
    """Diagnostics with mean target entropy ``entropy`` and batch-mean target entropy ``batch`` (default: 1.5 nats
    more: informative targets)."""
    batch = entropy + 1.5 if batch is None else batch
    return {"teacher_entropy": entropy, "batch_entropy": batch, "student_entropy": entropy, "cls_std": std,
            "cls_rms": rms, "proto_used": used}  # fmt: skip


def test_collapse_state_names_each_failure() -> None:
    k, b = 64, 16  # the rule's scale: ln 16 = 2.77 nats of information when each image has its own target
    assert collapse_state(_diag(2.0), k, b) is None
    assert collapse_state(_diag(0.1, 2.5), k, b) is None  # sharp targets, each image its own prototype: healthy
    # both DINO collapses leave targets that are the same for every image (information ~ 0)
    assert collapse_state(_diag(math.log(k), math.log(k)), k, b) == "uniform targets"
    assert collapse_state(_diag(3.75, 3.85), k, b) == "uniform targets"  # 0.9 of ln K, the same for every image
    assert collapse_state(_diag(0.018, 0.02), k, b) == "one prototype"  # every row one-hot on one prototype
    assert collapse_state(_diag(0.74, 0.82), k, b) == "uniform targets"  # one shared, fairly sharp target
    assert collapse_state(_diag(0.3, 0.35), k, b) == "one prototype"  # (nearly) all rows on a prototype
    assert collapse_state(_diag(2.0, 2.0 + 0.2 * math.log(b) + 0.01), k, b) is None  # just above the rule
    assert collapse_state(_diag(2.0, 2.0 + 0.2 * math.log(b) - 0.01), k, b) == "uniform targets"
    assert collapse_state(_diag(3.0, 3.5), k, 2) is None  # 0.5 nats of ln 2 at two images per worker
    assert collapse_state(_diag(2.0, std=1e-3), k, b) == "constant CLS"
    assert collapse_state(_diag(2.0, std=0.1, rms=100.0), k, b) == "constant CLS"  # relative to the scale
    assert collapse_state(_diag(2.0, std=0.1, rms=1.0), k, b) is None
    assert collapse_state(_diag(math.log(k), math.log(k), std=0.0), k, b) == "uniform targets + constant CLS"
    # from the diagnostics themselves: every row one-hot on one prototype
    one_hot = F.one_hot(torch.zeros(2, 4, dtype=torch.long), k).float()
    d = contrastive_diagnostics(one_hot, torch.randn(2, 4, k), torch.randn(8, 16), 0.1)
    assert d["batch_entropy"].item() == pytest.approx(0.0, abs=1e-6)
    assert collapse_state({n: v.item() for n, v in d.items()}, k, 4) == "one prototype"
    # each image on its own prototype, its two views agreeing: ln 4 nats of information
    own = F.one_hot(torch.arange(4).repeat(2, 1), k).float()
    d = contrastive_diagnostics(own, torch.randn(2, 4, k), torch.randn(8, 16), 0.1)
    assert d["batch_entropy"].item() - d["teacher_entropy"].item() == pytest.approx(math.log(4), rel=1e-5)
    assert collapse_state({n: v.item() for n, v in d.items()}, k, 4) is None


def test_collapse_monitor_reports_a_lasting_collapse_once_and_its_end() -> None:
    monitor = CollapseMonitor(patience=10)
    u = "uniform targets"
    states = [None, u, None, u, u, u, u, None, u, None, None, None]
    changes = {}
    for i, state in enumerate(states):  # windows of 5 steps
        change = monitor.update(state, 5 * i, 5 * (i + 1))
        if change:
            changes[5 * (i + 1)] = change
    # a one-window blip is never reported; the collapse from step 15 is once it has held 10 steps, and its end
    # (from step 45, after a one-window relapse) once the run has been healthy for 10 steps
    assert changes == {25: (u, 15), 55: (None, 45)}
    assert monitor.reported is None


def _repeated_views(image: torch.Tensor, g: int, b: int) -> Views:
    one = make_views(image[None], SMALL_VIEWS.model_copy(update={"n_local": 0}), _gen())
    rows = (g * b, -1, -1, -1)
    return Views(one.global_clean[:1].expand(rows), one.global_aug[:1].expand(rows), one.local, g, 0)


def test_losses_diagnose_a_constant_cls_and_uniform_targets() -> None:
    k = 64
    # The same crop of one image in every row, masked alike: one [CLS], and Sinkhorn turns identical teacher
    # scores into uniform targets.
    obj = tiny_objective(cl=CLConfig(hidden=64, bottleneck=32, prototypes=k, normalize="sinkhorn"))
    views = _repeated_views(torch.rand(3, 96, 72), 2, 4)
    one = obj.masks_for(Views(views.global_clean[:1], views.global_aug[:1], views.local, 1, 0), _gen())
    masks = Masks(*(t.expand(8, *t.shape[1:]) for t in (one.mask, one.keep, one.blockwise)))
    out = obj.losses(views, 0, masks)
    assert out["cls_std"].item() < 1e-6 * out["cls_rms"].item()
    assert out["teacher_entropy"].item() == pytest.approx(math.log(k), rel=1e-5)
    assert collapse_state({n: v.item() for n, v in out.items()}, k, 4) == "uniform targets + constant CLS"


def test_losses_diagnose_distinct_images_as_healthy_unless_the_cls_ignores_them() -> None:
    k = 64
    images = torch.rand(6, 3, 96, 72)
    cl = CLConfig(hidden=64, bottleneck=32, prototypes=k, normalize="sinkhorn")
    for layer_scale, expected in ((1.0, None), (1e-4, "uniform targets + constant CLS")):
        torch.manual_seed(0)
        backbone = build(dataclasses.replace(SIZES["tiny"], layer_scale_init=layer_scale))
        obj = JointObjective(backbone, small_config(cl=cl), total_steps=10)
        with torch.no_grad():
            out = obj(images, 0, _gen())
        diag = {n: v.item() for n, v in out.items()}
        # LayerScale 1e-4 (the default, for deep models) leaves a fresh 4-block [CLS] nearly image-independent:
        # the tiny runs' collapse, visible from step 0.
        assert collapse_state(diag, k, 6) == expected, diag
        if expected is None:
            assert diag["cls_std"] > 0.1 * diag["cls_rms"] and diag["teacher_entropy"] < math.log(0.9 * k)


# --- views --------------------------------------------------------------------------------------------------------


def test_colour_augmentation_never_touches_the_global_views() -> None:
    skin = torch.tensor([0.80, 0.55, 0.45]).view(1, 3, 1, 1)
    images = skin.expand(16, 3, 120, 90).clone()  # a constant colour: every crop of it is that colour
    cfg = SMALL_VIEWS.model_copy(update={"jitter_prob": 1.0})
    v = make_views(images, cfg, _gen())
    assert v.global_clean.shape == (32, 3, 64, 48) and v.global_aug.shape == (32, 3, 64, 48)
    assert v.local.shape == (32, 3, 32, 32)
    torch.testing.assert_close(v.global_clean, normalize(skin, cfg).expand_as(v.global_clean))
    changed = lambda t: (t - normalize(skin, cfg)).abs().amax(dim=(1, 2, 3)) > 0.05  # noqa: E731
    assert changed(v.global_aug).float().mean() > 0.9 and changed(v.local).float().mean() > 0.9


def test_augmented_global_views_are_the_same_crops() -> None:
    photo = torch.rand(4, 3, 120, 90)
    no_colour = SMALL_VIEWS.model_copy(
        update={"jitter_prob": 0.0, "grayscale_prob": 0.0, "global_blur_prob": (0.0, 0.0)}
    )
    v = make_views(photo, no_colour, _gen(3))
    torch.testing.assert_close(v.global_aug, v.global_clean)
    assert not torch.equal(v.global_clean[:4], v.global_clean[4:])  # two different crops per image
    again = make_views(photo, no_colour, _gen(3))
    assert torch.equal(again.global_clean, v.global_clean) and torch.equal(again.local, v.local)


def test_colour_augment_identity_when_nothing_drawn() -> None:
    x = torch.rand(3, 3, 20, 16)
    cfg = SMALL_VIEWS.model_copy(update={"jitter_prob": 0.0, "grayscale_prob": 0.0})
    torch.testing.assert_close(colour_augment(x, cfg, blur_prob=0.0, solarize_prob=0.0, generator=_gen()), x)
    solarised = colour_augment(x, cfg, blur_prob=0.0, solarize_prob=1.0, generator=_gen())
    torch.testing.assert_close(solarised, torch.where(x >= 0.5, 1 - x, x))


def test_mae_term_depends_only_on_the_clean_global_views() -> None:
    obj = tiny_objective()
    v = make_views(torch.rand(4, 3, 96, 72), SMALL_VIEWS, _gen())
    masks = obj.masks_for(v, _gen(1))
    first = obj.losses(v, 0, masks)
    swapped = Views(v.global_clean, torch.randn_like(v.global_aug), torch.randn_like(v.local), 2, 2)
    second = obj.losses(swapped, 0, masks)
    assert first["mae"].item() == second["mae"].item()
    assert first["cl"].item() != second["cl"].item()


# --- safety and variants ------------------------------------------------------------------------------------------


def test_non_finite_loss_names_step_and_term() -> None:
    obj = tiny_objective()
    v = make_views(torch.rand(2, 3, 96, 72), SMALL_VIEWS, _gen())
    masks = obj.masks_for(v, _gen())
    bad_local = Views(v.global_clean, v.global_aug, torch.full_like(v.local, float("nan")), 2, 2)
    with pytest.raises(NonFiniteLossError, match=r"step 7: loss term 'cl' is nan"):
        obj.losses(bad_local, 7, masks)
    bad_clean = Views(torch.full_like(v.global_clean, float("inf")), v.global_aug, v.local, 2, 2)
    with pytest.raises(NonFiniteLossError, match=r"step 12: loss term 'mae'"):
        obj.losses(bad_clean, 12, masks)


def test_hierarchical_backbone_masks_whole_windows() -> None:
    torch.manual_seed(0)
    views = ViewsConfig(global_size=(128, 128), local_size=(64, 64), n_local=1)
    obj = JointObjective(build("tiny-4k"), small_config(views=views), total_steps=10)
    assert obj.decoder.patch == 64  # one token per 4x4-patch window
    v = make_views(torch.rand(2, 3, 160, 160), views, _gen())
    masks = obj.masks_for(v, _gen())
    assert masks.mask.shape == (4, 4)  # 2x2 windows, 3 of 4 masked
    patch_keep = obj._patch_keep(masks.keep, v.global_clean)
    assert patch_keep.shape == (4, 16)  # every patch of the one kept window
    assert torch.equal(obj.student(v.global_clean, patch_keep).keep, masks.keep)
    out = obj.losses(v, 0, masks)
    assert torch.isfinite(out["loss"])


# --- learning on real photos --------------------------------------------------------------------------------------


def _photo_batch(height: int = 128, width: int = 96) -> torch.Tensor:
    from generators.sample_pool import load_photos

    batch = []
    for photo in load_photos().values():
        img = photo.image.convert("RGB")
        w, h = img.size
        if h * width > w * height:  # centre crop to the model's aspect, then resize
            crop_h = round(w * height / width)
            img = img.crop((0, (h - crop_h) // 2, w, (h - crop_h) // 2 + crop_h))
        else:
            crop_w = round(h * width / height)
            img = img.crop(((w - crop_w) // 2, 0, (w - crop_w) // 2 + crop_w, h))
        img = img.resize((width, height), Image.Resampling.BILINEAR)
        batch.append(torch.from_numpy(np.array(img)).permute(2, 0, 1))
    return torch.stack(batch)


@pytest.mark.slow  # 150 training steps
def test_tiny_model_joint_loss_falls_on_sample_photos() -> None:
    images = _photo_batch()  # the 12 photos that ship in packages, uint8
    assert images.shape == (12, 3, 128, 96)
    torch.manual_seed(0)
    # Four blocks need no deep-network LayerScale damping; at 1e-4 a fresh tiny model's [CLS] barely depends on
    # the image, which leaves self-distillation nothing to work with in a short run.
    backbone = build(dataclasses.replace(SIZES["tiny"], layer_scale_init=1.0))
    steps, prototypes = 150, 64
    cl = CLConfig(hidden=128, bottleneck=64, prototypes=prototypes, teacher_temp=0.04, momentum=0.99)
    obj = JointObjective(backbone, small_config(lambda_cl=0.1, cl=cl), total_steps=steps)
    trainable = [p for p in obj.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=5e-4, weight_decay=0.05, foreach=True)
    gen = _gen()
    history = []
    for step in range(steps):
        out = obj(images, step, gen)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        opt.step()
        obj.update_teacher(step)
        history.append([out[k].item() for k in ("loss", "mae", "cl")])
    h = np.array(history)
    first, last = h[:25].mean(0), h[-25:].mean(0)
    print("first 25 steps (loss, mae, cl):", first, "last 25:", last)
    assert np.isfinite(h).all()
    assert last[0] < 0.85 * first[0], (first, last)  # the joint loss falls clearly ...
    assert last[1] < 0.85 * first[1], (first, last)  # ... and so does reconstruction
    assert last[2] < 0.95 * math.log(prototypes), (first, last)  # self-distillation has not collapsed to uniform


def _koleo_reference(x: torch.Tensor, eps: float = 1e-8) -> float:
    """KoLeo as DINOv2 defines it, written out in float64: L2-normalise the rows; each row's nearest other row by
    inner product; the distance |a - b + eps| of the two vectors (torch's PairwiseDistance); -mean log(d + eps)."""
    rows = [[v / max(math.sqrt(sum(u * u for u in r)), eps) for v in r] for r in x.double().tolist()]
    total = 0.0
    for i, a in enumerate(rows):
        j = max((j for j in range(len(rows)) if j != i), key=lambda j: sum(p * q for p, q in zip(a, rows[j])))
        total += -math.log(math.sqrt(sum((p - q + eps) ** 2 for p, q in zip(a, rows[j]))) + eps)
    return total / len(rows)


def test_koleo_equals_dinov2s_definition_and_keeps_its_gradient_in_the_near_collapse() -> None:
    from pretrain.objective import koleo_loss

    torch.manual_seed(0)
    for x in (torch.randn(16, 32), torch.randn(5, 3) * 100, torch.eye(4, 8)):
        assert koleo_loss(x).item() == pytest.approx(_koleo_reference(x), rel=1e-5, abs=1e-5)
    assert koleo_loss(torch.eye(4, 8)).item() == pytest.approx(-math.log(math.sqrt(2)), abs=1e-6)
    # Near-collapse: rows 1e-5 apart. sqrt(2 - 2 cos) rounds to 0 in fp32 there (the loss would sit at -log(1e-8)
    # with no gradient); the distance of the vectors themselves keeps both.
    base = F.normalize(torch.randn(1, 32), dim=-1)
    x = (base + 1e-5 * torch.randn(8, 32)).requires_grad_(True)
    loss = koleo_loss(x)
    assert loss.item() == pytest.approx(_koleo_reference(x.detach()), rel=0.05)  # fp32 rounding of 1e-5 gaps
    assert 9.0 < loss.item() < 14.0, loss.item()  # about -log(1e-5), far from -log(1e-8) = 18.42
    loss.backward()
    assert x.grad is not None and x.grad.norm() > 0
    # a gradient step pushes the two closest rows apart
    y = torch.tensor([[1.0, 0.0, 0.0], [0.99, 0.14, 0.0], [0.0, 0.0, 1.0]], requires_grad=True)
    koleo_loss(y).backward()
    with torch.no_grad():
        moved = y - 0.05 * y.grad
    near = lambda t: F.normalize(t, dim=-1)[:2].diff(dim=0).norm().item()  # noqa: E731
    assert near(moved) > near(y.detach())


def test_the_loss_weights_koleo_as_dinov2_summed_over_global_views_and_not_by_lambda() -> None:
    """L = L_MAE + lambda * L_CL + w * sum over the global views of KoLeo(student [CLS] of that view), as DINOv2 /
    DINOv3 add ``koleo_loss_weight * sum(koleo(view) for view in the global views)``."""
    from pretrain.objective import koleo_loss

    obj = tiny_objective(lambda_cl=0.5, cl=CLConfig(hidden=64, bottleneck=32, prototypes=64, koleo=0.3))
    images = torch.rand(4, 3, 96, 72)
    views = make_views(images, obj.cfg.views, _gen())
    masks = obj.masks_for(views, _gen(1))
    with torch.no_grad():
        out = obj.losses(views, 0, masks)
        cls = obj.student(views.global_clean, obj._patch_keep(masks.keep, views.global_clean)).cls
    per_view = [koleo_loss(c).item() for c in cls.view(views.n_global, 4, -1)]
    assert out["koleo"].item() == pytest.approx(sum(per_view), rel=1e-5)
    expected = out["mae"] + 0.5 * out["cl"] + 0.3 * out["koleo"]
    assert out["loss"].item() == pytest.approx(expected.item(), rel=1e-5)


def test_the_prototype_layer_is_frozen_for_its_first_steps_as_dinov2(repo_root) -> None:
    """DINOv2 / DINOv3 hold the last layer's learning rate at 0 for ``freeze_last_layer_epochs``: the prototypes
    do not move for ``cl.freeze_prototypes_steps`` optimiser steps while the rest of the head and the backbone do,
    then they learn."""
    from common.config import load_config
    from pretrain.config import PretrainConfig
    from pretrain.train import PROTOTYPES, build_optimizer, optimizer_update

    cfg = load_config(
        PretrainConfig,
        str(repo_root / "configs/pretrain/tiny.yaml"),
        ["steps=6", "objective.cl.freeze_prototypes_steps=3", "optim.warmup_steps=1", "data.batch_size=2"],
    )
    torch.manual_seed(0)
    obj = JointObjective(build(cfg.model.backbone()), cfg.objective, total_steps=cfg.steps)
    optimizer = build_optimizer(obj, cfg.optim)
    params = [p for p in obj.parameters() if p.requires_grad]
    named = dict(obj.named_parameters())
    prototypes, mlp = named[PROTOTYPES], named["head.mlp.0.weight"]
    assert [g["name"] for g in optimizer.param_groups if any(p is prototypes for p in g["params"])] == ["prototypes"]
    images, gen = _photo_batch()[:4], _gen()
    moved = []
    for step in range(cfg.steps):
        before = prototypes.detach().clone(), mlp.detach().clone()
        obj(images, step, gen)["loss"].backward()
        assert prototypes.grad is not None and prototypes.grad.abs().sum() > 0  # it gets gradients all along
        update = optimizer_update(obj, optimizer, params, step, cfg, 4)
        moved.append((not torch.equal(prototypes, before[0]), not torch.equal(mlp, before[1])))
        assert update["lr"] > 0
    assert moved == [(False, True)] * 3 + [(True, True)] * 3


def _short_run(cfg, images: torch.Tensor, window: int = 10) -> list[dict[str, float]]:
    """The worker's step (``pretrain.train.Trainer.train_step``: schedules, frozen prototypes, clipping, AdamW, EMA)
    for ``cfg.steps`` steps at the config's global batch, in this process; the means of the objective's terms over
    each ``window`` steps, with the collapse those show (read with the images the diagnostics were taken over: the
    whole global batch here)."""
    from pretrain.train import Trainer

    torch.manual_seed(0)
    obj = JointObjective(build(cfg.model.backbone()), cfg.objective, total_steps=cfg.steps)
    trainer = Trainer(obj, cfg, torch.device("cpu"))
    batch, gen, history, windows = trainer.global_batch, _gen(), [], []
    for step in range(cfg.steps):
        drawn = images[torch.randint(len(images), (batch,), generator=gen)]
        terms, _ = trainer.train_step(step, drawn.chunk(cfg.optim.grad_accum))
        history.append(dict(zip(TERMS, terms.tolist())))
        if len(history) == window:
            means = {k: sum(h[k] for h in history) / window for k in TERMS}
            means["collapse"] = collapse_state(means, cfg.objective.cl.prototypes, batch)
            windows.append(means)
            history = []
    return windows


def test_the_shipped_tiny_recipe_learns_where_the_former_one_collapses(repo_root) -> None:
    """The shipped tiny config for its 60 steps at its global batch, on the 12 package photos: MAE falls and the
    contrastive term stays well below ln K with no collapse named in any 10-step window; the former tiny recipe
    (128x96 views at a global batch of 4, LayerScale 0.1 on both branches, teacher 0.04 with EMA 0.95 -> 0.99) has
    targets that tell the images apart in no more than one window of the run."""
    from common.config import load_config
    from pretrain.config import PretrainConfig

    images = _photo_batch()
    tiny = str(repo_root / "configs/pretrain/tiny.yaml")
    shipped = load_config(PretrainConfig, tiny)
    ln_k = math.log(shipped.objective.cl.prototypes)
    run = _short_run(shipped, images)
    assert run[-1]["mae"] < 0.9 * run[0]["mae"], run
    assert max(w["cl"] for w in run[1:]) < 0.85 * ln_k and run[-1]["cl"] < 0.8 * ln_k, run
    assert [w["collapse"] for w in run] == [None] * len(run), run
    former = load_config(
        PretrainConfig,
        tiny,
        [
            "objective.views.global_size=[128,96]",
            "objective.views.local_size=[48,48]",
            "data.batch_size=2",
            "optim.lr=6.4e-2",
            "model.layer_scale_init=0.1",
            "model.ffn_layer_scale=true",
            "objective.cl.freeze_prototypes_steps=0",
            "objective.cl.teacher_temp=0.04",
            "objective.cl.teacher_temp_warmup=0.04",
            "objective.cl.momentum=0.95",
            "objective.cl.momentum_end=0.99",
        ],
    )
    stuck = _short_run(former, images)
    assert sum(w["collapse"] is not None for w in stuck) >= len(stuck) - 1, stuck


@pytest.mark.parametrize("visible,grid,prefix", [(12, (6, 8), 5), (48, (6, 8), 1)])
def test_the_decoder_flops_equal_torch_flop_counter(visible, grid, prefix):
    """The count the MFU figure adds for the MAE decoder equals torch's own (2 FLOPs per multiply-add), on the meta
    device: with mask tokens and without."""
    cfg, width, patch = MAEConfig(width=64, depth=2, heads=4), 96, 16
    tokens = grid[0] * grid[1]
    with torch.device("meta"):
        decoder = MAEDecoder(width, cfg, patch)
        keep = torch.zeros(2, visible, dtype=torch.long) if visible < tokens else None
        enc = BackboneOutput(
            cls=torch.zeros(2, width),
            registers=torch.zeros(2, prefix - 1, width),
            patches=torch.zeros(2, visible, width),
            grid=grid,
            keep=keep,
        )
        with FlopCounterMode(display=False) as counter:
            decoder(enc)
    assert counter.get_total_flops() == 2 * 2 * decoder_macs(cfg, width, visible, tokens, prefix, 3 * patch * patch)
