"""LoRANetwork.apply_max_norm_regularization (kohya's --scale_weight_norms) on the tiny SDXL:
compared with a per-module reference that forms every weight change explicitly."""
from __future__ import annotations

import math
from typing import Iterator

import pytest
import torch

from networks import lora

MAX_NORM = 1.0


@pytest.fixture(scope="module")
def tiny_sdxl():
    from tools.build_tiny_models import tiny_sdxl

    return tiny_sdxl()


def make_network(models, seed: int = 0) -> lora.LoRANetwork:
    """Linear LoRAs (rank 4, alpha 2) and conv LoRAs (3x3 down + 1x1 up, rank 2, alpha 3) on both
    text encoders and the UNet, with random weights whose ||delta W||_F spans ~0.01x to ~100x MAX_NORM."""
    network = lora.create_network(
        1.0, 4, 2.0, None, models.text_encoders, models.unet, conv_dim="2", conv_alpha="3"
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in all_loras(network):
            for weight in (module.lora_up.weight, module.lora_down.weight):
                weight.copy_(torch.randn(weight.shape, generator=generator))
            # Scale the product to a log-uniform target norm.
            target = 10 ** (torch.rand((), generator=generator).item() * 4 - 2)
            factor = math.sqrt(target / reference_norm(module))
            module.lora_up.weight.mul_(factor)
            module.lora_down.weight.mul_(factor)
    return network


@pytest.fixture
def network(tiny_sdxl) -> Iterator[lora.LoRANetwork]:
    network = make_network(tiny_sdxl)
    network.apply_to()
    yield network
    network.restore()  # the models are shared by the tests of this file


def all_loras(network: lora.LoRANetwork) -> list[lora.LoRAModule]:
    return network.text_encoder_loras + network.unet_loras


def reference_delta(module: lora.LoRAModule) -> torch.Tensor:
    """The weight change in the wrapped module's weight shape, in float64, the obvious way."""
    up = module.lora_up.weight.detach().double()
    down = module.lora_down.weight.detach().double()
    scale = module.alpha.double() / down.shape[0]
    if down.dim() == 4:  # conv: delta[o, i, h, w] = sum_r up[o, r] * down[r, i, h, w]
        return torch.einsum("or,rihw->oihw", up[:, :, 0, 0], down) * scale
    return (up @ down) * scale


def reference_norm(module: lora.LoRAModule) -> float:
    return torch.linalg.vector_norm(reference_delta(module)).item()


def reference_max_norm(network: lora.LoRANetwork, max_norm: float):
    """kohya's rule per module on copies of the weights: (new weights by name, scaled count, mean, max)."""
    weights, reported, scaled = {}, [], 0
    for module in all_loras(network):
        norm = reference_norm(module)
        clamped = max(norm, max_norm / 2)
        ratio = min(clamped, max_norm) / clamped
        if ratio != 1:
            scaled += 1
        up = module.lora_up.weight.detach().clone()
        down = module.lora_down.weight.detach().clone()
        if ratio != 1:
            up *= math.sqrt(ratio)
            down *= math.sqrt(ratio)
        weights[module.lora_name] = (up, down)
        reported.append(norm * ratio)
    return weights, scaled, sum(reported) / len(reported), max(reported)


def is_conv3x3(module: lora.LoRAModule) -> bool:
    return tuple(module.lora_down.weight.shape[2:]) == (3, 3)


def test_matches_per_module_reference(network):
    norms = {module.lora_name: reference_norm(module) for module in all_loras(network)}
    over = {name for name, norm in norms.items() if norm > MAX_NORM}
    # The weights must cover every branch of the rule, for Linear and 3x3 conv modules alike,
    # and stay clear of the limit so that float32 rounding cannot flip a decision.
    conv_names = {module.lora_name for module in all_loras(network) if is_conv3x3(module)}
    assert conv_names & over and conv_names - over
    assert any(n <= MAX_NORM / 2 for n in norms.values()) and any(MAX_NORM / 2 < n <= MAX_NORM for n in norms.values())
    assert any(name.startswith("lora_te1") for name in over) and any(name.startswith("lora_te2") for name in over)
    assert all(abs(n / MAX_NORM - 1) > 1e-3 for n in norms.values())
    expected, expected_scaled, expected_mean, expected_max = reference_max_norm(network, MAX_NORM)

    stats = network.apply_max_norm_regularization(MAX_NORM)

    for module in all_loras(network):
        up, down = expected[module.lora_name]
        torch.testing.assert_close(module.lora_up.weight.detach(), up, rtol=1e-6, atol=0)
        torch.testing.assert_close(module.lora_down.weight.detach(), down, rtol=1e-6, atol=0)
    assert stats.keys_scaled.item() == expected_scaled == len(over)
    assert stats.mean_norm.item() == pytest.approx(expected_mean, rel=1e-6)
    assert stats.max_norm.item() == pytest.approx(expected_max, rel=1e-6)
    assert expected_max == pytest.approx(MAX_NORM)  # some module was scaled to exactly the limit


def test_norms_end_within_limit_and_small_modules_are_untouched(network):
    before = {
        module.lora_name: (module.lora_up.weight.detach().clone(), module.lora_down.weight.detach().clone())
        for module in all_loras(network)
    }
    under = {module.lora_name for module in all_loras(network) if reference_norm(module) <= MAX_NORM}
    assert under and len(under) < len(before)

    network.apply_max_norm_regularization(MAX_NORM)

    for module in all_loras(network):
        assert reference_norm(module) <= MAX_NORM * (1 + 1e-5), module.lora_name
        up, down = before[module.lora_name]
        if module.lora_name in under:
            assert torch.equal(module.lora_up.weight, up) and torch.equal(module.lora_down.weight, down)
        else:
            assert not torch.equal(module.lora_up.weight, up) and not torch.equal(module.lora_down.weight, down)


def test_second_call_only_nudges_modules_at_the_limit(network):
    first = network.apply_max_norm_regularization(MAX_NORM)
    after_first = {name: p.detach().clone() for name, p in network.named_parameters()}
    second = network.apply_max_norm_regularization(MAX_NORM)
    # A module scaled to the limit can come out a rounding error above it and be scaled again
    # (kohya's rule does the same), but only by a rounding error.
    assert second.keys_scaled.item() <= first.keys_scaled.item()
    assert second.max_norm.item() == pytest.approx(MAX_NORM, rel=1e-6)
    for name, p in network.named_parameters():
        torch.testing.assert_close(p.detach(), after_first[name], rtol=1e-6, atol=0)


def test_returns_device_tensors_not_python_numbers(network):
    stats = network.apply_max_norm_regularization(MAX_NORM)
    device = next(network.parameters()).device
    for value in (stats.keys_scaled, stats.mean_norm, stats.max_norm):
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and value.device == device
    assert not stats.keys_scaled.is_floating_point()
    with pytest.raises(AttributeError):  # frozen
        stats.keys_scaled = torch.tensor(0)


def test_fresh_network_is_left_alone(tiny_sdxl):
    network = lora.create_network(1.0, 4, 2.0, None, tiny_sdxl.text_encoders, tiny_sdxl.unet)
    before = [p.detach().clone() for p in network.parameters()]
    stats = network.apply_max_norm_regularization(MAX_NORM)  # lora_up starts at zero: every norm is 0
    assert (stats.keys_scaled.item(), stats.mean_norm.item(), stats.max_norm.item()) == (0, 0.0, 0.0)
    assert all(torch.equal(p, q) for p, q in zip(network.parameters(), before))


def test_modules_dropped_by_apply_to_are_not_touched(tiny_sdxl):
    network = make_network(tiny_sdxl)
    network.apply_max_norm_regularization(MAX_NORM)  # groups the modules before apply_to drops some
    dropped = network.text_encoder_loras[0]
    with torch.no_grad():
        dropped.lora_up.weight.mul_(100)
    big = dropped.lora_up.weight.detach().clone()
    network.apply_to(apply_text_encoder=False)
    try:
        network.unet_loras[0].lora_up.weight.data.mul_(1000)  # over the limit now
        stats = network.apply_max_norm_regularization(MAX_NORM)
    finally:
        network.restore()
    # Only UNet modules count; unet_loras[0] is the only one over the limit by more than rounding.
    assert stats.keys_scaled.item() >= 1
    assert reference_norm(network.unet_loras[0]) == pytest.approx(MAX_NORM, rel=1e-5)
    assert stats.keys_scaled.item() <= len(network.unet_loras)
    assert torch.equal(dropped.lora_up.weight, big)


def test_bfloat16_weights_stay_bfloat16_and_within_limit(tiny_sdxl):
    network = make_network(tiny_sdxl).to(torch.bfloat16)
    network.apply_max_norm_regularization(MAX_NORM)
    assert all(p.dtype == torch.bfloat16 for p in network.parameters())
    assert max(reference_norm(module) for module in all_loras(network)) <= MAX_NORM * 1.02
