"""Keyed per-sample noise: batch independence, each option against its formula, the schedule."""
from __future__ import annotations

import argparse
import logging

import pytest
import torch
import torch.nn.functional as F

from library import noise
from library.errors import UserError
from library.noise import NoiseOptions

SHAPE = (4, 16, 12)
EVERYTHING = NoiseOptions(
    min_timestep=100, max_timestep=900, noise_offset=0.1, noise_offset_random_strength=True, adaptive_noise_scale=0.05,
    multires_noise_iterations=6, multires_noise_discount=0.3, ip_noise_gamma=0.1, ip_noise_gamma_random_strength=True,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    noise.add_arguments(parser)
    parser.add_argument("--v_parameterization", action="store_true")
    return parser.parse_args(list(argv))


def latents_for(indices: list[int]) -> torch.Tensor:
    """Latents that depend on the sample only (as real ones do)."""
    return torch.stack([torch.full(SHAPE, 0.1 * index - 0.3) + torch.linspace(-1, 1, SHAPE[2]) for index in indices])


def draw(indices: list[int], options: NoiseOptions = EVERYTHING, seed: int = 7, epoch: int = 2) -> noise.DiffusionNoise:
    return noise.draw_diffusion_noise(seed, epoch, indices, SHAPE, 1000, options=options, latents=latents_for(indices))


def test_a_sample_gets_the_same_draws_in_any_batch():
    together = draw([0, 1, 2, 3])
    for indices in ([2], [3, 1], [1, 0, 3]):
        apart = draw(indices)
        for position, index in enumerate(indices):
            assert torch.equal(apart.noise[position], together.noise[index])
            assert torch.equal(apart.input_noise[position], together.input_noise[index])
            assert apart.timesteps[position] == together.timesteps[index]


def test_draws_depend_on_seed_epoch_and_sample():
    base = draw([0, 1])
    assert not torch.equal(base.noise[0], base.noise[1])
    assert not torch.equal(draw([0], seed=8).noise[0], base.noise[0])
    assert not torch.equal(draw([0], epoch=3).noise[0], base.noise[0])


def test_an_option_never_changes_the_other_draws():
    plain = draw([3, 4], NoiseOptions())
    with_ip = draw([3, 4], NoiseOptions(ip_noise_gamma=0.1))
    assert torch.equal(plain.noise, with_ip.noise) and torch.equal(plain.timesteps, with_ip.timesteps)
    assert plain.input_noise is plain.noise


def test_look_ahead_timesteps_match_the_draw():
    drawn = draw([5, 9, 11])
    assert torch.equal(noise.draw_timesteps(7, 2, [5, 9, 11], 1000, 100, 900), drawn.timesteps)


def test_timestep_range_and_fixed_timestep():
    timesteps = noise.draw_timesteps(0, 1, list(range(2000)), 1000, 200, 300)
    assert timesteps.dtype == torch.long and timesteps.min() == 200 and timesteps.max() == 299
    assert set(noise.draw_timesteps(0, 1, list(range(50)), 1000, 999, 999).tolist()) == {999}
    everything = noise.draw_timesteps(0, 1, list(range(10000)), 1000)
    assert everything.min() == 0 and everything.max() == 999


def test_legacy_positional_call_still_works():
    legacy = noise.draw_diffusion_noise(1, 1, [0, 1], SHAPE, 1000, 10, 20, 0.05)
    explicit = noise.draw_diffusion_noise(
        1, 1, [0, 1], SHAPE, 1000, options=NoiseOptions(min_timestep=10, max_timestep=20, noise_offset=0.05)
    )
    assert torch.equal(legacy.noise, explicit.noise) and torch.equal(legacy.timesteps, explicit.timesteps)
    with pytest.raises(TypeError):
        noise.draw_diffusion_noise(1, 1, [0], SHAPE, 1000, 10, options=NoiseOptions())


def stream(index: int, name: int, seed: int = 7, epoch: int = 2) -> torch.Generator:
    return noise.sample_generator(seed, epoch, index, name)


def base_noise(index: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=stream(index, noise._STREAM_DIFFUSION))


@pytest.mark.parametrize("random_strength", [False, True])
def test_noise_offset_formula(random_strength: bool):
    options = NoiseOptions(noise_offset=0.2, noise_offset_random_strength=random_strength)
    drawn = draw([4], options)
    generator = stream(4, noise._STREAM_OFFSET)
    direction = torch.randn((SHAPE[0], 1, 1), generator=generator)
    factor = torch.rand((), generator=generator) if random_strength else 1.0
    torch.testing.assert_close(drawn.noise[0], base_noise(4) + 0.2 * factor * direction, rtol=0, atol=1e-6)


def test_adaptive_noise_scale_formula():
    options = NoiseOptions(noise_offset=0.1, adaptive_noise_scale=-0.5)
    latents = latents_for([6])
    drawn = noise.draw_diffusion_noise(7, 2, [6], SHAPE, 1000, options=options, latents=latents)
    direction = torch.randn((SHAPE[0], 1, 1), generator=stream(6, noise._STREAM_OFFSET))
    strength = (0.1 - 0.5 * latents[0].mean(dim=(1, 2)).abs()).clamp(min=0).view(-1, 1, 1)  # kohya clamps at 0
    torch.testing.assert_close(drawn.noise[0], base_noise(6) + strength * direction, rtol=0, atol=1e-6)
    with pytest.raises(ValueError):
        noise.draw_diffusion_noise(7, 2, [6], SHAPE, 1000, options=options)


def test_multires_formula_per_kohya():
    options = NoiseOptions(multires_noise_iterations=10, multires_noise_discount=0.4)
    drawn = draw([2], options)
    generator = stream(2, noise._STREAM_MULTIRES)
    expected = base_noise(2)
    height, width = SHAPE[1:]
    octaves = 0
    for octave in range(10):
        ratio = torch.rand((), generator=generator).item() * 2 + 2
        low_h, low_w = max(1, int(height / ratio**octave)), max(1, int(width / ratio**octave))
        low = torch.randn((1, SHAPE[0], low_h, low_w), generator=generator)
        expected = expected + torch.nn.Upsample(size=(height, width), mode="bilinear")(low)[0] * 0.4**octave
        octaves += 1
        if low_h == 1 or low_w == 1:
            break
    assert octaves < 10  # the 1-pixel stop was exercised
    torch.testing.assert_close(drawn.noise[0], expected / expected.std(), rtol=0, atol=1e-5)
    assert drawn.noise[0].std().item() == pytest.approx(1.0, abs=1e-5)


def test_multires_noise_is_smoother_than_white_noise():
    multires = draw(list(range(8)), NoiseOptions(multires_noise_iterations=6, multires_noise_discount=0.8)).noise
    white = draw(list(range(8)), NoiseOptions()).noise

    def neighbour_correlation(tensor: torch.Tensor) -> float:
        return float(F.cosine_similarity(tensor[..., 1:].flatten(), tensor[..., :-1].flatten(), dim=0))

    assert neighbour_correlation(multires) > neighbour_correlation(white) + 0.2


@pytest.mark.parametrize("random_strength", [False, True])
def test_input_perturbation_formula(random_strength: bool):
    options = NoiseOptions(ip_noise_gamma=0.3, ip_noise_gamma_random_strength=random_strength)
    drawn = draw([1], options)
    generator = stream(1, noise._STREAM_INPUT_PERTURBATION)
    perturbation = torch.randn(SHAPE, generator=generator)
    factor = torch.rand((), generator=generator).item() if random_strength else 1.0
    assert torch.equal(drawn.noise[0], base_noise(1))  # the target keeps the plain noise
    torch.testing.assert_close(drawn.input_noise[0], base_noise(1) + 0.3 * factor * perturbation, rtol=0, atol=1e-6)


def test_to_device_keeps_shared_noise_shared():
    moved = draw([0], NoiseOptions()).to("cpu")
    assert moved.input_noise is moved.noise


def test_zero_terminal_snr_rescales_as_kohya():
    plain, fixed = noise.training_noise_scheduler(), noise.training_noise_scheduler(zero_terminal_snr=True)
    old = plain.alphas_cumprod.double().sqrt()
    # kohya: shift sqrt(alphas_cumprod) so the last is 0, rescale so the first is unchanged
    expected = (old - old[-1]) * old[0] / (old[0] - old[-1])
    torch.testing.assert_close(fixed.alphas_cumprod.double().sqrt(), expected, rtol=0, atol=2e-6)
    assert fixed.alphas_cumprod[-1] == 0 and fixed.alphas_cumprod[0] == pytest.approx(plain.alphas_cumprod[0].item())
    assert torch.equal(fixed.alphas, 1 - fixed.betas)
    torch.testing.assert_close(torch.cumprod(fixed.alphas, 0), fixed.alphas_cumprod)
    latents, pure_noise = torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8)
    noisy = fixed.add_noise(latents, pure_noise, torch.tensor([999]))
    torch.testing.assert_close(noisy, pure_noise)  # SNR 0: pure noise, finite
    torch.testing.assert_close(fixed.get_velocity(latents, pure_noise, torch.tensor([999])), -latents)


def test_arguments_defaults_and_options():
    args = parse()
    assert args.multires_noise_discount == 0.3 and args.noise_offset is None and not args.zero_terminal_snr
    assert NoiseOptions.from_args(args) == NoiseOptions()
    args = parse("--noise_offset", "0.1", "--multires_noise_iterations", "6", "--ip_noise_gamma", "0.1",
                 "--ip_noise_gamma_random_strength", "--noise_offset_random_strength", "--adaptive_noise_scale", "0.01")
    noise.validate_arguments(args, 1000)
    assert NoiseOptions.from_args(args).ip_noise_gamma == 0.1


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--min_timestep", "-1"], "--min_timestep"),
        (["--max_timestep", "1001"], "--max_timestep"),
        (["--min_timestep", "500", "--max_timestep", "400"], "--min_timestep"),
        (["--min_timestep", "1000", "--max_timestep", "1000"], "--min_timestep"),
        (["--adaptive_noise_scale", "0.1"], "--adaptive_noise_scale"),
        (["--multires_noise_iterations", "-2"], "--multires_noise_iterations"),
    ],
)
def test_bad_values_raise_user_errors_naming_the_flag(argv: list[str], flag: str):
    with pytest.raises(UserError, match=flag):
        noise.validate_arguments(parse(*argv), 1000)


def test_fixed_timestep_is_valid_and_zero_terminal_snr_warns_without_v(caplog: pytest.LogCaptureFixture):
    noise.validate_arguments(parse("--min_timestep", "999", "--max_timestep", "999"), 1000)
    with caplog.at_level(logging.WARNING, logger="library.noise"):
        noise.validate_arguments(parse("--zero_terminal_snr"), 1000)
    assert "--v_parameterization" in caplog.text
    caplog.clear()
    noise.validate_arguments(parse("--zero_terminal_snr", "--v_parameterization"), 1000)
    assert not caplog.text
