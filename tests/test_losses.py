"""Diffusion losses: each option against its formula, the numerical traps at their extremes,
and exact normalisation under gradient accumulation (a tiny nn.Linear stands in for the UNet)."""
from __future__ import annotations

import argparse
import copy
import math
from dataclasses import replace
from typing import Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from library import losses, noise
from library.errors import UserError
from library.losses import LossOptions

PLAIN = noise.training_noise_scheduler().alphas_cumprod
ZERO_TERMINAL = noise.training_noise_scheduler(zero_terminal_snr=True).alphas_cumprod
FP16_MAX = 65504.0
SUBNORMAL = 1e-40


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    losses.add_arguments(parser)
    parser.add_argument("--alpha_mask", action="store_true")
    parser.add_argument("--dataset_config", default=None)
    return parser.parse_args(list(argv))


# --------------------------------------------------------------------------- kohya's formulas, written out


def kohya_huber_c(options: LossOptions, alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    t = timesteps.double()
    if options.huber_schedule == "exponential":
        alpha = -math.log(options.huber_c) / 1000
        return torch.exp(-alpha * t) * options.huber_scale
    if options.huber_schedule == "snr":
        a = alphas_cumprod.double()[timesteps]
        sigmas = ((1.0 - a) / a) ** 0.5
        return (1 - options.huber_c) / (1 + sigmas) ** 2 + options.huber_c
    return torch.full_like(t, options.huber_c * options.huber_scale)


def kohya_elementwise(prediction, target, loss_type: str, c: Optional[torch.Tensor]) -> torch.Tensor:
    d = prediction.double() - target.double()
    if loss_type == "l2":
        return d**2
    if loss_type == "l1":
        return d.abs()
    c = c.double().view(-1, 1, 1, 1)
    if loss_type == "huber":
        return 2 * c * (torch.sqrt(d**2 + c**2) - c)
    return 2 * (torch.sqrt(d**2 + c**2) - c)


def kohya_post_process(loss, options: LossOptions, alphas_cumprod, timesteps) -> torch.Tensor:
    a = alphas_cumprod.double()[timesteps]
    snr = a / (1 - a)
    if options.min_snr_gamma:
        min_snr = torch.minimum(snr, torch.full_like(snr, options.min_snr_gamma))
        loss = loss * (min_snr / (snr + 1) if options.v_parameterization else min_snr / snr)
    snr_t = torch.minimum(snr, torch.ones_like(snr) * 1000)
    scale = snr_t / (snr_t + 1)
    if options.scale_v_pred_loss_like_noise_pred:
        loss = loss * scale
    if options.v_pred_like_loss:
        loss = loss + loss / scale * options.v_pred_like_loss
    if options.debiased_estimation_loss:
        loss = loss * (1 / (snr_t + 1) if options.v_parameterization else 1 / torch.sqrt(snr_t))
    return loss


def kohya_batch_loss(prediction, target, options, alphas_cumprod, timesteps, weights, pixel_masks=None):
    """kohya's NetworkTrainer.process_batch after the forward, in float64."""
    loss = kohya_elementwise(prediction, target, options.loss_type, kohya_huber_c(options, alphas_cumprod, timesteps))
    if pixel_masks is not None:
        loss = loss * F.interpolate(pixel_masks.double().unsqueeze(1), size=loss.shape[2:], mode="area")
    loss = loss.mean(dim=(1, 2, 3)) * weights.double()
    return kohya_post_process(loss, options, alphas_cumprod, timesteps).mean()


def ours(prediction, target, options, alphas_cumprod, timesteps, weights, pixel_masks=None) -> torch.Tensor:
    """Our normalised loss of one batch forming a whole window."""
    mask = None if pixel_masks is None else losses.mask_to_latent(pixel_masks, tuple(prediction.shape[2:]))
    batch = losses.batch_weights(options, alphas_cumprod, timesteps, weights, tuple(prediction.shape[1:]), mask)
    result = losses.batch_loss(prediction, target, batch, options)
    denominator = losses.window_denominator([result.weight_sum], options.loss_normalization, 1)
    return losses.normalize(result.loss_sum, denominator)


WEIGHTINGS = [
    {},
    {"min_snr_gamma": 5.0},
    {"min_snr_gamma": 5.0, "v_parameterization": True},
    {"scale_v_pred_loss_like_noise_pred": True, "v_parameterization": True},
    {"v_pred_like_loss": 0.3},
    {"debiased_estimation_loss": True},
    {"debiased_estimation_loss": True, "v_parameterization": True},
    {"min_snr_gamma": 2.0, "v_pred_like_loss": 0.1, "debiased_estimation_loss": True},
]
TIMESTEPS = torch.tensor([0, 1, 37, 250, 500, 998, 999])


@pytest.mark.parametrize("loss_type", losses.LOSS_TYPES)
@pytest.mark.parametrize("schedule", losses.HUBER_SCHEDULES)
def test_loss_types_and_huber_schedules_match_kohya(loss_type: str, schedule: str):
    options = LossOptions(loss_type=loss_type, huber_schedule=schedule, huber_c=0.2, huber_scale=1.5)
    generator = torch.Generator().manual_seed(0)
    prediction, target = torch.randn(7, 4, 3, 3, generator=generator), torch.randn(7, 4, 3, 3, generator=generator)
    c = losses.huber_thresholds(options, PLAIN, TIMESTEPS, 1000)
    if loss_type in ("l1", "l2"):
        assert c is None
    else:
        torch.testing.assert_close(c.double(), kohya_huber_c(options, PLAIN, TIMESTEPS), rtol=1e-6, atol=0)
    torch.testing.assert_close(
        losses.elementwise_loss(prediction, target, loss_type, c).double(),
        kohya_elementwise(prediction, target, loss_type, c), rtol=1e-5, atol=1e-7,
    )


@pytest.mark.parametrize("weighting", WEIGHTINGS, ids=lambda w: ",".join(w) or "none")
def test_timestep_weightings_match_kohya(weighting: dict):
    options = LossOptions(**weighting)
    expected = kohya_post_process(torch.ones(len(TIMESTEPS), dtype=torch.float64), options, PLAIN, TIMESTEPS)
    actual = losses.timestep_weights(options, losses.timestep_snr(PLAIN, TIMESTEPS))
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual.double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("weighting", WEIGHTINGS, ids=lambda w: ",".join(w) or "none")
@pytest.mark.parametrize("loss_type", ["l2", "huber"])
def test_batch_loss_is_kohyas_with_and_without_masks(weighting: dict, loss_type: str):
    generator = torch.Generator().manual_seed(1)
    prediction, target = torch.randn(4, 4, 2, 3, generator=generator), torch.randn(4, 4, 2, 3, generator=generator)
    timesteps, weights = torch.tensor([3, 400, 800, 999]), torch.tensor([1.0, 0.5, 2.0, 1.0])
    pixel_masks = torch.rand(4, 16, 24, generator=generator)
    for normalization in losses.NORMALIZATIONS:  # exact (masks over the whole image, the default) and micro
        options = LossOptions(loss_type=loss_type, loss_normalization=normalization, **weighting)
        for masks in (None, pixel_masks):
            expected = kohya_batch_loss(prediction, target, options, PLAIN, timesteps, weights, masks)
            actual = ours(prediction, target, options, PLAIN, timesteps, weights, masks)
            assert actual.item() == pytest.approx(expected.item(), rel=1e-5)
    # the mask's area as denominator differs from kohya's whenever the masks are not all ones
    options = LossOptions(loss_type=loss_type, masked_loss_normalization="mask", **weighting)
    expected = kohya_batch_loss(prediction, target, options, PLAIN, timesteps, weights, pixel_masks)
    actual = ours(prediction, target, options, PLAIN, timesteps, weights, pixel_masks)
    assert actual.item() == pytest.approx(expected.item() / float(pixel_masks.mean()), rel=1e-5)


def test_mask_normalisation_averages_over_the_unmasked_elements():
    prediction, target = torch.ones(2, 4, 2, 2), torch.zeros(2, 4, 2, 2)
    target[0, :, 0, 0] = 3.0  # error 4 where sample 0 counts, error 1 elsewhere
    masks = torch.zeros(2, 2, 2)
    masks[0, 0, 0] = 1.0
    masks[1] = 0.5
    loss_sum = 4 * 4.0 * 1 + 2.0 * 16 * 0.5 * 1.0
    for normalization, weight_sum in (("mask", 4 * (1 + 4 * 0.5)), ("image", 2 * 4 * 2 * 2)):
        options = LossOptions(masked_loss_normalization=normalization)
        batch = losses.batch_weights(options, PLAIN, torch.tensor([5, 5]), torch.tensor([1.0, 2.0]), (4, 2, 2),
                                     masks.unsqueeze(1))
        result = losses.batch_loss(prediction, target, batch, options)
        assert result.weight_sum.item() == weight_sum
        assert result.loss_sum.item() == pytest.approx(loss_sum)


def test_mask_to_latent_is_an_area_average():
    mask = torch.rand(3, 16, 24)
    expected = F.avg_pool2d(mask.unsqueeze(1), 8)
    torch.testing.assert_close(losses.mask_to_latent(mask, (2, 3)), expected)
    torch.testing.assert_close(losses.mask_to_latent(mask.unsqueeze(1).double(), (2, 3)), expected)
    assert losses.mask_to_latent(mask.half(), (2, 3)).dtype == torch.float32


# --------------------------------------------------------------------------- numerical traps


@pytest.mark.parametrize("alphas_cumprod", [PLAIN, ZERO_TERMINAL], ids=["plain", "zero_terminal_snr"])
@pytest.mark.parametrize("weighting", WEIGHTINGS, ids=lambda w: ",".join(w) or "none")
def test_timestep_weights_are_finite_at_the_first_and_last_timestep(alphas_cumprod, weighting: dict):
    snr = losses.timestep_snr(alphas_cumprod, torch.tensor([0, 999]))
    weights = losses.timestep_weights(LossOptions(**weighting), snr)
    assert torch.isfinite(weights).all() and (weights >= 0).all()


def test_snr_zero_gets_the_documented_limits():
    snr = losses.timestep_snr(ZERO_TERMINAL, torch.tensor([999]))
    assert snr.item() == 0.0

    def weight(**options) -> float:
        return losses.timestep_weights(LossOptions(**options), snr).item()

    assert weight(min_snr_gamma=5.0) == 1.0  # min(s, g)/s -> 1 as s -> 0
    assert weight(min_snr_gamma=5.0, v_parameterization=True) == 0.0
    assert weight(scale_v_pred_loss_like_noise_pred=True) == 0.0
    assert weight(debiased_estimation_loss=True) == pytest.approx(1 / math.sqrt(losses.WEIGHTING_SNR_MIN))
    assert weight(debiased_estimation_loss=True, v_parameterization=True) == 1.0
    assert weight(v_pred_like_loss=0.5) == pytest.approx(1 + 0.5 * (1 + 1 / losses.WEIGHTING_SNR_MIN))
    # without zero-terminal SNR the floor never acts: kohya's numbers at the last step
    assert losses.timestep_snr(PLAIN, torch.tensor([999])).item() > losses.WEIGHTING_SNR_MIN


def test_huber_snr_schedule_at_zero_snr_is_huber_c():
    options = LossOptions(loss_type="huber", huber_c=0.1)
    assert losses.huber_thresholds(options, ZERO_TERMINAL, torch.tensor([999]), 1000).item() == pytest.approx(0.1)


@pytest.mark.parametrize("loss_type", ["huber", "smooth_l1"])
@pytest.mark.parametrize("huber_c, schedule", [(1e-30, "constant"), (1e-45, "constant"), (1e-38, "exponential"),
                                               (1e-30, "snr")])
def test_huber_with_tiny_c_has_finite_loss_and_gradient(loss_type: str, huber_c: float, schedule: str):
    options = LossOptions(loss_type=loss_type, huber_c=huber_c, huber_schedule=schedule)
    timesteps = torch.tensor([0, 500, 999, 999])
    c = losses.huber_thresholds(options, ZERO_TERMINAL, timesteps, 1000)
    assert (c > 0).all()
    prediction = torch.tensor([0.0, 1e-30, SUBNORMAL, FP16_MAX]).view(4, 1, 1, 1).requires_grad_(True)
    target = torch.tensor([0.0, 0.0, 0.0, -FP16_MAX]).view(4, 1, 1, 1)
    loss = losses.elementwise_loss(prediction, target, loss_type, c)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(prediction.grad).all()
    assert prediction.grad[0].item() == 0.0  # d = 0: the minimum, zero gradient (not 0/0)
    if loss_type == "smooth_l1":  # far from the minimum smooth_l1 is 2|d|: gradient 2 sign(d)
        assert prediction.grad[3].item() == pytest.approx(2.0)


@pytest.mark.parametrize("loss_type", losses.LOSS_TYPES)
def test_fp16_range_predictions_and_subnormal_targets(loss_type: str):
    prediction = torch.tensor([[FP16_MAX, -FP16_MAX], [SUBNORMAL, 0.0]]).view(2, 1, 1, 2).half().float()
    prediction.requires_grad_(True)
    target = torch.tensor([[-FP16_MAX, FP16_MAX], [-SUBNORMAL, SUBNORMAL]]).view(2, 1, 1, 2)
    options = LossOptions(loss_type=loss_type, min_snr_gamma=5.0, debiased_estimation_loss=True, v_pred_like_loss=1.0)
    batch = losses.batch_weights(options, ZERO_TERMINAL, torch.tensor([0, 999]), torch.ones(2), (1, 1, 2))
    result = losses.batch_loss(prediction, target, batch, options)
    objective = losses.micro_batch_objective(result.loss_sum, losses.window_denominator([result.weight_sum]), 4.0)
    objective.backward()
    assert torch.isfinite(objective) and torch.isfinite(prediction.grad).all()


@pytest.mark.parametrize("loss_type", losses.LOSS_TYPES)
def test_half_precision_inputs_are_computed_in_fp32(loss_type: str):
    generator = torch.Generator().manual_seed(2)
    prediction = (torch.randn(2, 4, 3, 3, generator=generator) * 300).half().requires_grad_(True)
    target = torch.randn(2, 4, 3, 3, generator=generator).bfloat16()
    options = LossOptions(loss_type=loss_type, huber_schedule="constant")
    timesteps = torch.tensor([1, 2])
    batch = losses.batch_weights(options, PLAIN, timesteps, torch.ones(2), (4, 3, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        result = losses.batch_loss(prediction, target, batch, options)
    assert result.loss_sum.dtype == torch.float32 and result.weight_sum.dtype == torch.float32
    c = kohya_huber_c(options, PLAIN, timesteps) if loss_type in ("huber", "smooth_l1") else None
    expected = kohya_elementwise(prediction.float(), target.float(), loss_type, c).sum()
    assert result.loss_sum.item() == pytest.approx(expected.item(), rel=1e-6)
    result.loss_sum.backward()
    assert prediction.grad.dtype == torch.float16 and torch.isfinite(prediction.grad).all()


def test_an_all_zero_mask_adds_nothing_to_either_sum():
    generator = torch.Generator().manual_seed(3)
    prediction, target = torch.randn(2, 4, 2, 2, generator=generator), torch.randn(2, 4, 2, 2, generator=generator)
    masks = torch.stack([torch.ones(1, 2, 2), torch.zeros(1, 2, 2)])
    options = LossOptions(min_snr_gamma=5.0, masked_loss_normalization="mask")
    timesteps, weights = torch.tensor([10, 20]), torch.tensor([1.0, 3.0])
    both = losses.batch_loss(
        prediction, target, losses.batch_weights(options, PLAIN, timesteps, weights, (4, 2, 2), masks), options
    )
    first = losses.batch_loss(
        prediction[:1], target[:1],
        losses.batch_weights(options, PLAIN, timesteps[:1], weights[:1], (4, 2, 2), masks[:1]), options,
    )
    assert both.loss_sum.item() == pytest.approx(first.loss_sum.item()) and both.weight_sum == first.weight_sum


def test_a_window_without_weight_has_loss_zero_and_zero_gradient():
    prediction = torch.randn(2, 4, 2, 2, requires_grad=True)
    options = LossOptions(loss_type="huber", masked_loss_normalization="mask")
    batch = losses.batch_weights(options, ZERO_TERMINAL, torch.tensor([0, 999]), torch.ones(2), (4, 2, 2),
                                 torch.zeros(2, 1, 2, 2))
    result = losses.batch_loss(prediction, torch.randn(2, 4, 2, 2), batch, options)
    denominator = losses.window_denominator([result.weight_sum, result.weight_sum])
    assert denominator.item() == 0.0
    objective = losses.micro_batch_objective(result.loss_sum, denominator, 2.0)
    objective.backward()
    assert objective.item() == 0.0 and torch.equal(prediction.grad, torch.zeros_like(prediction))
    assert losses.window_denominator([]).item() == 0.0


@pytest.mark.parametrize("tiny", [1e-30, 1e-40])
def test_near_zero_mask_values_count_as_zero(tiny: float):
    """Otherwise 1/weight_sum overflows (1e-40 is subnormal) and the gradient is inf."""
    options = LossOptions(masked_loss_normalization="mask")
    mask = torch.full((1, 1, 2, 2), tiny)
    batch = losses.batch_weights(options, PLAIN, torch.tensor([3]), torch.ones(1), (4, 2, 2), mask)
    assert batch.weight_sum.item() == 0.0 and torch.equal(batch.mask, torch.zeros_like(mask))
    prediction = torch.randn(1, 4, 2, 2, requires_grad=True)
    result = losses.batch_loss(prediction, torch.randn(1, 4, 2, 2), batch, options)
    losses.micro_batch_objective(result.loss_sum, losses.window_denominator([result.weight_sum]), 1.0).backward()
    assert torch.isfinite(prediction.grad).all()


FINITE = dict(allow_nan=False, allow_infinity=False, width=32)
SCALAR = dict(allow_nan=False, allow_infinity=False)  # flags are float64


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    batch_size=st.integers(1, 3),
    zero_terminal_snr=st.booleans(),
    loss_type=st.sampled_from(losses.LOSS_TYPES),
    huber_schedule=st.sampled_from(losses.HUBER_SCHEDULES),
    huber_c=st.floats(1e-300, 10.0, **SCALAR),
    huber_scale=st.floats(1e-3, 10.0, **SCALAR),
    min_snr_gamma=st.none() | st.floats(1e-6, 100.0, **SCALAR),
    v_pred_like_loss=st.none() | st.floats(0.0, 10.0, **SCALAR),
    flags=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()),
    normalization=st.sampled_from(losses.NORMALIZATIONS),
)
def test_finite_inputs_give_finite_losses_and_gradients(
    data, batch_size, zero_terminal_snr, loss_type, huber_schedule, huber_c, huber_scale, min_snr_gamma,
    v_pred_like_loss, flags, normalization,
):
    options = LossOptions(
        loss_type=loss_type, huber_c=huber_c, huber_scale=huber_scale, huber_schedule=huber_schedule,
        min_snr_gamma=min_snr_gamma, v_pred_like_loss=v_pred_like_loss, scale_v_pred_loss_like_noise_pred=flags[0],
        debiased_estimation_loss=flags[1], v_parameterization=flags[2], loss_normalization=normalization,
    )
    shape = (batch_size, 2, 2, 2)
    values = st.floats(-FP16_MAX, FP16_MAX, allow_subnormal=True, **FINITE)
    prediction = torch.from_numpy(data.draw(arrays(np.float32, shape, elements=values))).requires_grad_(True)
    target = torch.from_numpy(data.draw(arrays(np.float32, shape, elements=values)))
    timestep = st.sampled_from([0, 1, 998, 999]) | st.integers(0, 999)  # the extremes often
    timesteps = torch.tensor(data.draw(st.lists(timestep, min_size=batch_size, max_size=batch_size)))
    weights = torch.from_numpy(data.draw(arrays(np.float32, (batch_size,), elements=st.floats(0, 10, **FINITE))))
    mask = None
    if flags[3]:
        value = st.sampled_from([0.0, 1e-40, 1e-30, 1.0]) | st.floats(0, 1, **FINITE)  # subnormal, all zero
        mask = torch.from_numpy(data.draw(arrays(np.float32, (batch_size, 1, 2, 2), elements=value)))
    alphas_cumprod = ZERO_TERMINAL if zero_terminal_snr else PLAIN
    batch = losses.batch_weights(options, alphas_cumprod, timesteps, weights, shape[1:], mask)
    result = losses.batch_loss(prediction, target, batch, options)
    denominator = losses.window_denominator([result.weight_sum], normalization, 2)
    objective = losses.micro_batch_objective(result.loss_sum, denominator, 2.0)
    objective.backward()
    assert torch.isfinite(result.loss_sum) and torch.isfinite(result.weight_sum) and result.weight_sum >= 0
    assert torch.isfinite(objective) and torch.isfinite(prediction.grad).all()


# --------------------------------------------------------------------------- exact normalisation


LATENT = (2, 3, 3)
FEATURES = 5


def accumulation_fixture():
    generator = torch.Generator().manual_seed(4)
    inputs = torch.randn(4, FEATURES, generator=generator)
    targets = torch.randn(4, *LATENT, generator=generator)
    pixel_masks = torch.zeros(4, 24, 24)
    pixel_masks[0] = 1.0  # whole image
    pixel_masks[1, :, :12] = 1.0  # left half
    pixel_masks[2, :6, :9] = 0.7  # a soft corner
    # sample 3: all zero, counts for nothing
    return inputs, targets, pixel_masks, torch.tensor([1.0, 0.5, 2.0, 1.5]), torch.tensor([20, 300, 650, 999])


def accumulated_gradients(splits: list[list[list[int]]], options: LossOptions, masked: bool = True) -> torch.Tensor:
    """Gradients after one window, as the trainer computes them.

    ``splits[p]`` lists process p's micro-batches (sample ids). Simulates accelerate (divides
    every backward by gradient_accumulation_steps) and DDP (averages over processes).
    """
    inputs, targets, pixel_masks, sample_weights, timesteps = accumulation_fixture()
    torch.manual_seed(5)
    base = torch.nn.Linear(FEATURES, math.prod(LATENT))
    processes = len(splits)
    accumulation_steps = max(len(micro_batches) for micro_batches in splits)
    models = [copy.deepcopy(base) for _ in splits]
    planned = []  # look ahead: every micro-batch's weights before the first backward
    for micro_batches in splits:
        planned.append([
            losses.batch_weights(
                options, ZERO_TERMINAL, timesteps[ids], sample_weights[ids], LATENT,
                losses.mask_to_latent(pixel_masks[ids], LATENT[1:]) if masked else None,
            )
            for ids in micro_batches
        ])
    local = [losses.window_denominator([w.weight_sum for w in weights], options.loss_normalization, accumulation_steps)
             for weights in planned]
    denominator = torch.stack(local).sum()  # accelerator.reduce(local, "sum")
    for model, micro_batches, weights in zip(models, splits, planned):
        for ids, batch in zip(micro_batches, weights):
            prediction = model(inputs[ids]).view(len(ids), *LATENT)
            result = losses.batch_loss(prediction, targets[ids], batch, options)
            objective = losses.micro_batch_objective(result.loss_sum, denominator, processes * accumulation_steps)
            (objective / accumulation_steps).backward()  # what accelerator.backward does
    return torch.stack([torch.cat([p.grad.flatten() for p in model.parameters()]) for model in models]).mean(0)


EXACT = LossOptions(loss_type="huber", huber_c=0.3, min_snr_gamma=5.0, v_parameterization=True,
                    masked_loss_normalization="mask")  # the split-dependent denominator: the harder case
MICRO = LossOptions(loss_type="huber", huber_c=0.3, min_snr_gamma=5.0, v_parameterization=True,
                    loss_normalization="micro")
SPLITS = {
    "batch4_acc1": [[[0, 1, 2, 3]]],
    "batch1_acc4": [[[0], [1], [2], [3]]],
    "batch2_acc2": [[[0, 1], [2, 3]]],
    "uneven_3_1": [[[0, 1, 2], [3]]],
    "shuffled": [[[3, 1], [0, 2]]],
    "2_processes_batch1_acc2": [[[0], [1]], [[2], [3]]],
    "2_processes_batch2_acc1": [[[0, 2]], [[1, 3]]],
}


@pytest.mark.parametrize("name", [name for name in SPLITS if name != "batch4_acc1"])
def test_exact_gradients_do_not_depend_on_how_the_window_is_split(name: str):
    reference = accumulated_gradients(SPLITS["batch4_acc1"], EXACT)
    split = accumulated_gradients(SPLITS[name], EXACT)
    assert reference.abs().max() > 1e-3
    torch.testing.assert_close(split, reference, rtol=1e-6, atol=1e-6 * reference.abs().max().item())


def test_micro_normalisation_differs_visibly():
    exact = accumulated_gradients(SPLITS["batch4_acc1"], EXACT)
    micro = accumulated_gradients(SPLITS["batch4_acc1"], MICRO)
    assert (micro - exact).norm() > 0.1 * exact.norm()  # masks of different areas are weighed differently
    uneven = accumulated_gradients(SPLITS["uneven_3_1"], MICRO)
    assert (uneven - micro).norm() > 0.1 * micro.norm()  # and micro depends on the split


def test_micro_equals_exact_without_masks_for_full_equal_windows():
    exact = accumulated_gradients(SPLITS["batch2_acc2"], EXACT, masked=False)
    micro = accumulated_gradients(SPLITS["batch2_acc2"], MICRO, masked=False)
    torch.testing.assert_close(micro, exact, rtol=1e-6, atol=0)
    # kohya's whole-image rule (the default) makes masks no exception
    exact_image = accumulated_gradients(SPLITS["batch2_acc2"], replace(EXACT, masked_loss_normalization="image"))
    micro = accumulated_gradients(SPLITS["batch2_acc2"], MICRO)
    torch.testing.assert_close(micro, exact_image, rtol=1e-6, atol=1e-7 * micro.abs().max().item())


def test_micro_objective_is_kohyas_loss():
    """micro: accelerator.backward(objective) gives the gradient of kohya's batch loss / acc steps."""
    loss_sum = torch.tensor(2.5, requires_grad=True)
    denominator = losses.window_denominator([torch.tensor(1.0)], "micro", accumulation_steps=4) * 2  # 2 processes
    objective = losses.micro_batch_objective(loss_sum, denominator, 2 * 4)
    assert objective.item() == 2.5  # accelerate then divides by 4 and DDP averages the 2 processes


def test_accelerate_backward_divides_by_the_accumulation_steps():
    """The contract micro_batch_objective's gradient_divisor relies on."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(gradient_accumulation_steps=3)
        parameter = torch.ones(2, requires_grad=True)
        accelerator.backward(parameter.sum())
        torch.testing.assert_close(parameter.grad, torch.full((2,), 1 / 3))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


# --------------------------------------------------------------------------- flags


def test_defaults_are_kohyas():
    args = parse()
    assert (args.loss_type, args.huber_c, args.huber_scale, args.huber_schedule) == ("l2", 0.1, 1.0, "snr")
    assert args.loss_normalization == "exact" and args.min_snr_gamma is None and not args.masked_loss
    assert args.masked_loss_normalization == "image"
    losses.validate_arguments(args)
    assert LossOptions.from_args(args) == LossOptions()


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--huber_c", "0"], "--huber_c"),
        (["--huber_scale", "-1"], "--huber_scale"),
        (["--min_snr_gamma", "-5"], "--min_snr_gamma"),
        (["--v_pred_like_loss", "-0.1"], "--v_pred_like_loss"),
        (["--masked_loss"], "--masked_loss"),
        (["--scale_v_pred_loss_like_noise_pred"], "--scale_v_pred_loss_like_noise_pred.*needs --v_parameterization"),
        (["--v_pred_like_loss", "0.1", "--v_parameterization"], "--v_pred_like_loss.*--v_parameterization"),
    ],
)
def test_bad_values_raise_user_errors_naming_the_flag(argv: list[str], flag: str):
    with pytest.raises(UserError, match=flag):
        losses.validate_arguments(parse(*argv))


def test_v_prediction_weightings_with_their_own_kind_are_valid():
    losses.validate_arguments(parse("--scale_v_pred_loss_like_noise_pred", "--v_parameterization"))
    losses.validate_arguments(parse("--v_pred_like_loss", "0.1"))


def test_masked_loss_with_a_mask_source_is_valid():
    losses.validate_arguments(parse("--masked_loss", "--alpha_mask"))
    losses.validate_arguments(parse("--masked_loss", "--dataset_config", "x.toml"))

