"""Loss scaling: the built-in policies follow their documented rules, overflow steps leave the
model untouched, state survives a round trip, plugins load from files and drive real fp16 training."""
from __future__ import annotations

import argparse
import copy
import csv
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import model_args, run_trainer

from library import loss_scaling
from library.errors import UserError
from library.loss_scaling import LossScaler, ScalePolicy, create_loss_scaler, register_loss_scaler
from networks import lora

EXAMPLE_PLUGIN = Path(__file__).resolve().parents[1] / "examples" / "loss_scaler_plugin.py"
INPUT = torch.linspace(-1.0, 1.0, 4)


def f32(value: float) -> float:
    """What a float32 scale tensor holds (the test's own rounding, for the expected values)."""
    return float(np.float32(value))


def make_scaler(name: str, *items: str, mixed_precision: str = "fp16",
                device: torch.device = torch.device("cpu")) -> LossScaler | None:
    """Build a scaler the way the trainer does: through the parsed command-line options."""
    parser = argparse.ArgumentParser()
    loss_scaling.add_arguments(parser)
    args = parser.parse_args(["--loss_scaler", name, *(["--loss_scaler_args", *items] if items else [])])
    args.mixed_precision = mixed_precision
    return create_loss_scaler(args, device)


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32,
               device: torch.device = torch.device("cpu")) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(device, dtype)


def backward(scaler, model: torch.nn.Module, overflow: bool) -> None:
    """A real scaled backward; on ``overflow`` one gradient element becomes inf (as fp16 would)."""
    first = next(model.parameters())
    loss = model(INPUT.to(first.device, first.dtype)).float().square().sum()
    scaler.scale(loss).backward()
    if overflow:
        next(model.parameters()).grad.view(-1)[0] = float("inf")


def drive(scaler: LossScaler, pattern: str, model: torch.nn.Module | None = None,
          optimizer: torch.optim.Optimizer | None = None) -> tuple[list[float], list[bool]]:
    """Run one iteration per letter (C clean, O overflow); return the scale after each update
    and whether each step stepped."""
    model = model or make_model()
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.01)
    scales, stepped = [], []
    for letter in pattern:
        backward(scaler, model, overflow=letter == "O")
        stepped.append(scaler.step(optimizer))
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
    return scales, stepped


# --------------------------------------------------------------------------- built-in rules


def test_dynamic_halves_on_overflow_and_doubles_after_growth_interval_clean_steps():
    scaler = make_scaler("dynamic", "growth_interval=3")
    assert scaler.get_scale() == 2.0**16
    scales, stepped = drive(scaler, "CCCOCCOCCC")
    #           C      C      C (3rd: x2) O (x0.5) C      C      O: counter restarted, no growth yet
    assert scales == [65536, 65536, 131072, 65536, 65536, 65536, 32768, 32768, 32768, 65536]
    assert stepped == [letter == "C" for letter in "CCCOCCOCCC"]
    assert scaler.overflow_count == 2


@pytest.mark.device
def test_dynamic_matches_torch_grad_scaler_exactly(device):
    """Same scales (float32 arithmetic included) and bit-identical parameters as torch's GradScaler."""
    options = dict(init_scale=1000.5, growth_factor=1.7, backoff_factor=0.3, growth_interval=2)
    ours = make_scaler("dynamic", *(f"{key}={value}" for key, value in options.items()), device=device)
    theirs = torch.amp.GradScaler(device.type, **options)
    models = [make_model(device=device), make_model(device=device)]
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-2) for model in models]
    for letter in "CCOCCCCOOCCCCC":
        for scaler, model, optimizer in zip((ours, theirs), models, optimizers):
            backward(scaler, model, overflow=letter == "O")
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        assert ours.get_scale() == theirs.get_scale()
        for mine, reference in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(mine, reference)


def test_static_never_changes_and_still_skips_overflow_steps():
    scaler = make_scaler("static", "scale=1024")
    scales, stepped = drive(scaler, "COOCCCO")
    assert scales == [1024.0] * 7
    assert stepped == [True, False, False, True, True, True, False]
    assert make_scaler("static").get_scale() == 2.0**16  # the documented default


def test_aggressive_quarters_on_overflow_restarts_counter_and_caps_growth():
    scaler = make_scaler("aggressive", "growth_interval=3", f"max_scale={2**18}")
    scales, _ = drive(scaler, "CCC" "CCC" "CCC" "O" "CCO" "CC" "C")
    grown_once = f32(65536 * 1.8)
    grown_twice = f32(grown_once * 1.8)
    expected = (
        [65536, 65536, grown_once]
        + [grown_once, grown_once, grown_twice]
        + [grown_twice, grown_twice, 2.0**18]  # 1.8 x grown_twice > the cap
        + [2.0**16]  # x0.25
        + [2.0**16, 2.0**16, 2.0**14]  # two clean steps, then x0.25: the counter restarts
        + [2.0**14, 2.0**14]  # so two more clean steps are not enough...
        + [f32(2.0**14 * 1.8)]  # ...the third is
    )
    assert scales == expected


def test_floored_backs_off_to_the_floor_keeps_counting_and_pauses_after_five_overflows():
    scaler = make_scaler("floored", f"init_scale={2**14}", "growth_interval=3")
    pattern = "O" "CCOC" "CCOOOOC" "CCOOOOO" "CCC"
    scales, stepped = drive(scaler, pattern)
    after_first = f32(2**14 * 0.3)  # 4915.2 is above the 4096 floor
    expected = (
        [after_first]
        + [after_first, after_first, 4096.0, 8192.0]  # 1474.56 -> floor; the overflow kept the counter at 2
        + [8192.0, 8192.0, 4096.0, 4096.0, 4096.0, 4096.0, 8192.0]  # 4 overflows in a row: still no pause
        + [8192.0, 8192.0, 4096.0, 4096.0, 4096.0, 4096.0, 4096.0]  # the 5th overflow pauses growth
        + [4096.0, 4096.0, 8192.0]  # the counter restarted at the first clean step after the pause
    )
    assert scales == expected
    assert stepped == [letter == "C" for letter in pattern]


@pytest.mark.parametrize(
    "name, clean_steps, grown, after_overflow",
    [
        ("dynamic", 2000, 2.0**17, 2.0**16),
        ("aggressive", 1500, f32(2**16 * 1.8), f32(2**16 * 1.8) * 0.25),
        ("floored", 2000, 2.0**17, f32(2**17 * 0.3)),
    ],
)
def test_default_intervals_and_factors(name, clean_steps, grown, after_overflow):
    scaler = make_scaler(name)
    scales, _ = drive(scaler, "C" * clean_steps + "O")
    assert scales[clean_steps - 2] == 2.0**16
    assert scales[clean_steps - 1] == grown
    assert scales[-1] == f32(after_overflow)


def test_aggressive_cap_and_floored_floor_defaults():
    assert make_scaler("aggressive").policy.max_scale == 2.0**24
    assert make_scaler("floored").policy.min_scale == 2.0**12
    scaler = make_scaler("floored")
    assert drive(scaler, "O" * 12)[0][-1] == 2.0**12


def test_bf16_and_fp32_have_no_scaler():
    assert make_scaler("dynamic", mixed_precision="bf16") is None
    assert make_scaler("floored", mixed_precision="no") is None


# --------------------------------------------------------------------------- mechanics


@pytest.mark.device
def test_overflow_step_leaves_weights_and_optimizer_state_untouched_and_next_step_trains_normally(device):
    """Clean, overflow, clean with the scaler == clean, clean without it, bit for bit (AdamW)."""
    model, reference = make_model(device=device), make_model(device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    scaler = make_scaler("dynamic", device=device)

    drive(scaler, "C", model, optimizer)
    weights = copy.deepcopy(model.state_dict())
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    scales, stepped = drive(scaler, "O", model, optimizer)
    assert stepped == [False] and scaler.last_step_skipped and scales == [2.0**15]
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key])
    after = optimizer.state_dict()
    for index, state in optimizer_state["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][index][key], value), key

    _, stepped = drive(scaler, "C", model, optimizer)
    assert stepped == [True] and not scaler.last_step_skipped
    for _ in range(2):  # the reference never saw the overflow
        reference(INPUT.to(device)).square().sum().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
    for mine, expected in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, expected)


@pytest.mark.device
def test_fp16_gradients_are_unscaled_in_place_and_checked(device):
    model = make_model(dtype=torch.float16, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = make_scaler("dynamic", "init_scale=1024", device=device)
    backward(scaler, model, overflow=False)
    scaled = [p.grad.clone() for p in model.parameters()]
    assert all(grad.dtype == torch.float16 for grad in scaled)
    scaler.unscale_(optimizer)
    for grad, before in zip((p.grad for p in model.parameters()), scaled):
        assert torch.equal(grad, before / 1024)
    assert scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    assert drive(scaler, "O", model, optimizer) == ([512.0], [False])


def test_scale_tensor_tracks_the_float_and_call_order_is_enforced():
    scaler = make_scaler("floored", "growth_interval=1")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tensor = scaler.get_scale_tensor()
    drive(scaler, "CO", model, optimizer)
    assert tensor.dtype == torch.float32 and tensor.item() == scaler.get_scale() == f32(2**17 * 0.3)
    backward(scaler, model, overflow=False)
    scaler.unscale_(optimizer)
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    with pytest.raises(RuntimeError, match="already called"):
        scaler.step(optimizer)
    scaler.update()
    with pytest.raises(RuntimeError, match="needs unscale_"):
        scaler.update()


def test_state_dict_round_trip_continues_identically():
    original = make_scaler("floored", "growth_interval=4", f"init_scale={2**13}")
    drive(original, "CCOO")
    state = json.loads(json.dumps(original.state_dict()))  # plain JSON
    assert state == {"policy": "floored", "scale": 4096.0, "overflow_count": 2,
                     "policy_state": {"growth_tracker": 2, "overflow_streak": 2}}
    restored = make_scaler("floored", "growth_interval=4", f"init_scale={2**13}")
    restored.load_state_dict(state)
    assert restored.overflow_count == 2
    continuation = "OOOCCCCC"
    assert drive(restored, continuation) == drive(original, continuation)


def test_state_of_another_policy_keeps_the_scale_only(caplog):
    source = make_scaler("dynamic", "growth_interval=1")
    drive(source, "CC")
    target = make_scaler("aggressive")
    with caplog.at_level(logging.WARNING):
        target.load_state_dict(source.state_dict())
    assert target.get_scale() == 2.0**18
    assert target.policy.growth_tracker == 0
    assert "not the saved policy counters" in caplog.text


# --------------------------------------------------------------------------- names and plugins


def test_wrong_name_lists_the_available_scalers():
    with pytest.raises(UserError, match=r"--loss_scaler 'dynamc' is unknown; available: aggressive, dynamic, "
                                        r"floored, .*static"):
        make_scaler("dynamc")


def test_unknown_or_invalid_arguments_of_a_builtin():
    with pytest.raises(UserError, match="--loss_scaler_args growth: not an argument of loss scaler aggressive; "
                                        "valid keys: init_scale, growth_factor, backoff_factor, growth_interval, "
                                        "max_scale"):
        make_scaler("aggressive", "growth=2")
    with pytest.raises(UserError, match="backoff_factor=1.5"):
        make_scaler("dynamic", "backoff_factor=1.5")
    with pytest.raises(UserError, match="growth_interval=0"):
        make_scaler("floored", "growth_interval=0")
    with pytest.raises(UserError, match="min_scale"):
        make_scaler("floored", "init_scale=100")


def test_plugin_missing_a_method_is_rejected_naming_it(tmp_path):
    plugin = tmp_path / "half_plugin.py"
    plugin.write_text(
        "class NoNext:\n"
        "    def initial_scale(self): return 8.0\n"
        "    def state_dict(self): return {}\n"
        "    def load_state_dict(self, state): pass\n"
    )
    with pytest.raises(UserError, match=r"NoNext has no method next_scale\(\)"):
        make_scaler(f"{plugin}:NoNext")
    with pytest.raises(UserError, match="has no class"):
        make_scaler(f"{plugin}:Missing")
    with pytest.raises(UserError, match="no such file"):
        make_scaler(f"{tmp_path / 'absent.py'}:NoNext")
    with pytest.raises(UserError, match="no module named 'not_a_module'"):
        make_scaler("not_a_module.policies:Policy")

    class Subclass(ScalePolicy):  # inherits the initial_scale stub
        def next_scale(self, scale, overflow):
            return scale

    with pytest.raises(UserError, match=r"Subclass has no method initial_scale\(\)"):
        register_loss_scaler("incomplete")(Subclass)


def test_plugin_by_module_path_and_registered_name(tmp_path, monkeypatch):
    (tmp_path / "my_scalers.py").write_text(
        "from library.loss_scaling import ScalePolicy, register_loss_scaler\n"
        "@register_loss_scaler('test_triple')\n"
        "class Triple(ScalePolicy):\n"
        "    def __init__(self, *, start=3.0): self.start = start\n"
        "    def initial_scale(self): return self.start\n"
        "    def next_scale(self, scale, overflow): return scale / 3 if overflow else scale * 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        scaler = make_scaler("my_scalers:Triple", "start=9")
        assert drive(scaler, "CO")[0] == [27.0, 9.0]
        assert make_scaler("test_triple").get_scale() == 3.0  # registered when the module was imported
        with pytest.raises(UserError, match="already registered"):
            register_loss_scaler("test_triple")(loss_scaling.StaticPolicy)
        with pytest.raises(UserError, match="--loss_scaler_args stop: .* valid keys: start"):
            make_scaler("my_scalers:Triple", "stop=1")
    finally:
        loss_scaling._REGISTRY.pop("test_triple", None)


def test_a_policy_returning_a_bad_scale_is_refused():
    class Broken(ScalePolicy):
        def initial_scale(self):
            return 4.0

        def next_scale(self, scale, overflow):
            return 0.0

    scaler = LossScaler(Broken(), "cpu", name="broken")
    with pytest.raises(UserError, match="--loss_scaler broken: next_scale\\(\\) gave 0.0"):
        drive(scaler, "C")


def test_example_plugin_hysteresis_rule():
    scaler = make_scaler(f"{EXAMPLE_PLUGIN}:HysteresisPolicy", "init_scale=64", "hysteresis=2", "growth_interval=2")
    #                    O: tolerated  O: halve  C     C: x2   O: tolerated  C     C: x2
    assert drive(scaler, "OOCCOCC")[0] == [64.0, 32.0, 32.0, 64.0, 64.0, 64.0, 128.0]
    restored = make_scaler(f"{EXAMPLE_PLUGIN}:HysteresisPolicy", "init_scale=64", "hysteresis=2",
                           "growth_interval=2")
    restored.load_state_dict(scaler.state_dict())
    assert drive(restored, "OCO") == drive(scaler, "OCO")


# --------------------------------------------------------------------------- real fp16 training


def common_args(dataset_dir: Path, output_dir: Path, *extra: str) -> list[str]:
    return [
        "--train_data_dir", str(dataset_dir), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--seed", "1", "--max_data_loader_n_workers", "0",
        "--mixed_precision", "fp16", "--network_dim", "4", "--network_train_unet_only", "--learning_rate", "1e-3",
        "--grad_norm_log", "--save_precision", "float", *extra,
    ]


def read_log(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


@pytest.mark.device
def test_plugin_file_drives_real_fp16_training(tiny_models, one_image_dataset, tmp_path):
    """The example plugin, given by file path, sets the scale of a real fp16 SDXL run."""
    output_dir = tmp_path / "out"
    run_trainer(
        "sdxl_train_network",
        model_args(tiny_models, "sdxl")
        + common_args(
            one_image_dataset, output_dir, "--max_train_steps", "3",
            "--loss_scaler", f"{EXAMPLE_PLUGIN}:HysteresisPolicy",
            "--loss_scaler_args", "init_scale=1024", "growth_interval=1",
        ),
    )
    rows = read_log(output_dir / "gradient_logs+last.txt")
    assert [float(row["Scale"]) for row in rows] == [1024.0, 2048.0, 4096.0]
    assert all(math.isfinite(float(row["Gradient Norm"])) for row in rows)


@pytest.mark.device
def test_overflow_in_real_training_skips_the_step_and_the_next_one_trains(tiny_models, one_image_dataset, tmp_path):
    """A scale of 2**40 overflows the fp16 backward: that step is skipped (an applied inf/NaN step
    would leave NaN weights), the scale drops to 2**14 and the next step trains."""
    output_dir = tmp_path / "out"
    run_trainer(
        "sdxl_train_network",
        model_args(tiny_models, "sdxl")
        + common_args(
            one_image_dataset, output_dir, "--max_train_steps", "2",
            "--loss_scaler", "dynamic", "--loss_scaler_args", f"init_scale={2**40}", f"backoff_factor={2**-26}",
        ),
    )
    rows = read_log(output_dir / "gradient_logs+last.txt")
    assert [float(row["Scale"]) for row in rows] == [2.0**40, 2.0**14]
    assert not math.isfinite(float(rows[0]["Gradient Norm"]))
    assert math.isfinite(float(rows[1]["Gradient Norm"]))
    weights = lora.read_lora_file(str(output_dir / "last.safetensors"))
    ups = [value for key, value in weights.items() if "lora_up" in key]
    assert all(torch.isfinite(value).all() for value in weights.values())
    assert any(value.abs().sum() > 0 for value in ups)  # lora_up starts at zero: the clean step moved it


def test_validate_arguments_fails_fast_only_for_fp16():
    args = argparse.Namespace(mixed_precision="fp16", loss_scaler="floored", loss_scaler_args=["min_scale=-1"])
    with pytest.raises(UserError, match="min_scale"):
        loss_scaling.validate_arguments(args)
    args.mixed_precision = "bf16"
    loss_scaling.validate_arguments(args)  # ignored without fp16
