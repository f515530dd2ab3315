"""EMA of the LoRA weights (library/ema.py): diffusers' own EMAModel as the reference, the files, samples
and validation that use the average, resume after SIGKILL, two processes, skipped steps and rewinds."""
from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from conftest import (REPO, SCRIPT_ENV, model_args, run_trainer_output, run_training_process,
                      train_expecting_user_error)
from diffusers.training_utils import EMAModel

import sdxl_train_network
import train_network
from library import config_file, fault_injection, healing, sampling, train_state
from library.ema import EmaConfig, LoraEma
from networks.lora import read_lora_file
from networks.network_base import read_lora_metadata

UNIT_ROUNDOFF = 2.0 ** -24  # float32


def rounding_tolerance(updates: int, magnitude: float) -> float:
    """How far two float32 averages of the same weights may drift apart by rounding alone. An update
    rounds a difference (|.| <= 2 * magnitude), its product with 1 - decay and a sum (|.| <= magnitude)
    once each: at most 5 units of roundoff of ``magnitude`` per implementation (ours: lerp; diffusers':
    two subtractions), 10 for the pair. An earlier discrepancy is multiplied by the decay (< 1), so they
    add up at most linearly in the number of updates."""
    return updates * 10 * UNIT_ROUNDOFF * magnitude


def trainable_copies(parameters: list[torch.Tensor]) -> list[torch.Tensor]:
    """float32 copies that diffusers' EMAModel averages (it copies weights that do not require a gradient)."""
    return [parameter.detach().float().requires_grad_() for parameter in parameters]


def diffusers_reference(parameters: list[torch.Tensor], config: EmaConfig) -> EMAModel:
    """diffusers' EMAModel with ``config``'s schedule (diffusers' own defaults where an option is unset)."""
    given = {name: value for name, value in (("inv_gamma", config.inv_gamma), ("power", config.power))
             if value is not None}
    return EMAModel(parameters, decay=config.decay, use_ema_warmup=config.warmup, **given)


# --------------------------------------------------------------------------- the average itself


@pytest.mark.parametrize("config", [
    EmaConfig(decay=0.999), EmaConfig(decay=0.9, warmup=True),
    EmaConfig(decay=0.9999, warmup=True, inv_gamma=7.0, power=0.75)], ids=["default", "warmup", "warmup-7-0.75"])
def test_the_decay_schedule_is_diffusers_own(config):
    reference = diffusers_reference([torch.zeros(1)], config)
    assert [config.decay_at(update) for update in range(1, 3000)] == \
        [reference.get_decay(update) for update in range(1, 3000)]


@pytest.mark.parametrize("dtype, config", [
    (torch.float32, EmaConfig(decay=0.95)),
    (torch.float32, EmaConfig(decay=0.9, warmup=True, power=0.75, update_every=3)),
    (torch.float16, EmaConfig(decay=0.9, warmup=True)),  # fp16 weights: copied into a float32 buffer first
], ids=["default", "warmup-every-3", "fp16-weights"])
def test_the_average_equals_diffusers_ema_model_stepped_on_the_same_weights(dtype, config):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(dtype)
    parameters = list(model.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=0.05, eps=1e-4)
    average = LoraEma(parameters, config)
    reference = diffusers_reference(trainable_copies(parameters), config)
    magnitude, updates = 0.0, 0
    for step in range(1, 31):
        model(torch.randn(5, 8, dtype=dtype)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        average.after_optimizer_step()
        if step % config.update_every == 0:
            reference.step(trainable_copies(parameters))
            updates += 1
        magnitude = max([magnitude] + [parameter.detach().float().abs().max().item() for parameter in parameters])
    assert (average.updates, average.trained_steps) == (updates, 30)
    tolerance = rounding_tolerance(updates, magnitude)
    for ours, theirs in zip(average.average, reference.shadow_params):
        assert ours.dtype == torch.float32
        assert (ours - theirs).abs().max().item() <= tolerance
    # and the average is not the weights: the comparison above can fail
    assert any(not torch.allclose(ours, weights.detach().float()) for ours, weights in zip(average.average, parameters))


def test_the_swap_puts_the_training_weights_back_bit_for_bit():
    torch.manual_seed(1)
    parameters = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    average = LoraEma(parameters, EmaConfig(decay=0.5))
    training = [parameter.detach().clone() for parameter in parameters]
    for tensor in average.average:
        tensor.mul_(0.5)  # an average unlike the weights
    with average.swapped_in():
        assert all(torch.equal(parameter, tensor) for parameter, tensor in zip(parameters, average.average))
        with average.training_weights():
            assert all(torch.equal(parameter, tensor) for parameter, tensor in zip(parameters, training))
        assert all(torch.equal(parameter, tensor) for parameter, tensor in zip(parameters, average.average))
    assert all(torch.equal(parameter, tensor) for parameter, tensor in zip(parameters, training))
    with pytest.raises(ValueError, match="do not match"):
        average.load_state_dict({"updates": 1, "trained_steps": 1, "average": [torch.zeros(4, 3)]})


# --------------------------------------------------------------------------- options


def not_loaded_args(tiny_models, dataset: Path, tmp_path: Path, *extra: str) -> list[str]:
    """Arguments whose model file is empty: an error found after loading would say so instead."""
    (tmp_path / "not_loaded.safetensors").write_bytes(b"")
    argv = ema_args(tiny_models, dataset, tmp_path, *extra)
    argv[argv.index("--pretrained_model_name_or_path") + 1] = str(tmp_path / "not_loaded.safetensors")
    return argv


@pytest.mark.parametrize("flags, expected", [
    (["--ema_decay", "1"], "--ema_decay 1.0 must be between 0 and 1, both excluded"),
    (["--ema_decay", "0"], "--ema_decay 0.0 must be between 0 and 1"),
    (["--ema_decay", "-0.5"], "--ema_decay -0.5 must be between 0 and 1"),
    (["--ema_decay", "nan"], "--ema_decay nan must be between 0 and 1"),
    (["--ema_decay", "0.9", "--ema_update_every", "0"], "--ema_update_every 0 must be a whole number of optimizer "
                                                        "steps >= 1"),
    (["--ema_decay", "0.9", "--ema_update_every", "-2"], "--ema_update_every -2 must be a whole number"),
    (["--ema_decay", "0.9", "--ema_warmup", "--ema_power", "-1"], "--ema_power -1.0 must be a number > 0"),
    (["--ema_decay", "0.9", "--ema_warmup", "--ema_inv_gamma", "0"], "--ema_inv_gamma 0.0 must be a number > 0"),
    (["--ema_decay", "0.9", "--ema_power", "0.75"], "--ema_power shapes the warm-up of --ema_warmup"),
    (["--ema_save_raw"], "--ema_save_raw needs --ema_decay D"),
    (["--ema_decay", "0.9", "--ema_device", "gpu"], "--ema_device: invalid choice: 'gpu'"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_bad_ema_values_are_one_line_before_the_model_loads(flags, expected, tiny_models, demo_dataset, tmp_path,
                                                            capsys):
    message = train_expecting_user_error(not_loaded_args(tiny_models, demo_dataset, tmp_path, *flags), capsys)
    assert expected in message


def test_ema_options_read_from_a_gui_toml(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text("[ema]\nema_decay = 0.995\nema_warmup = true\nema_power = 0.75\nema_update_every = 2\n"
                      "ema_device = \"cpu\"\nema_save_raw = true\n")
    args, explicit = config_file.parse_args(sdxl_train_network.setup_parser(), ["--config_file", str(config)])
    assert EmaConfig.from_args(args) == EmaConfig(0.995, True, None, 0.75, 2, "cpu", True)
    assert {"ema_decay", "ema_warmup", "ema_power", "ema_update_every", "ema_device", "ema_save_raw"} <= explicit


# --------------------------------------------------------------------------- real trainings


def ema_args(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "run", "--seed", "4", "--max_data_loader_n_workers", "0",
        "--network_train_unet_only", "--network_dim", "4", "--learning_rate", "2e-2", "--save_precision", "float",
        *extra,
    ]


class Recorder:
    """What a recording trainer saw: per step the result and the EMA before and after it, diffusers'
    EMAModel stepped on the same weights, the weights samples and validation saw, captures and rewinds."""

    def __init__(self) -> None:
        self.run: Optional[train_network.Run] = None
        self.keys: list[str] = []  # the LoRA key of each trainable parameter
        self.reference: Optional[EMAModel] = None
        self.reference_updates = 0
        self.magnitude = 0.0
        self.trained = 0
        self.steps: dict[int, dict] = {}
        self.sampled: dict[int, dict[str, torch.Tensor]] = {}
        self.validated: dict[int, dict[str, torch.Tensor]] = {}
        self.captured: dict[int, dict] = {}
        self.rewinds: list[tuple[dict, dict, dict]] = []  # (EMA before, after, at the healthy point's capture)

    def ema_state(self, average: Optional[LoraEma] = None) -> dict:
        state = (average or self.run.optimization.ema).state_dict()
        return {**state, "average": [tensor.clone() for tensor in state["average"]]}

    def as_file(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {key: tensor.detach().float().cpu() for key, tensor in zip(self.keys, tensors)}

    def training_weights(self) -> list[torch.Tensor]:
        return [parameter.detach().clone() for parameter in self.run.optimization.trainable_params]


def held_weights(network: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the weights the network holds now (``lora_state_dict`` shares CPU tensors' memory)."""
    return {key: value.clone() for key, value in network.lora_state_dict().items()}


def recording_trainer(recorder: Recorder) -> type:
    class RecordingTrainer(sdxl_train_network.SdxlNetworkTrainer):
        def train_step(self, run, window):
            if recorder.run is None:
                recorder.run = run
                names = {id(parameter): name for name, parameter in run.network.named_parameters()}
                recorder.keys = [names[id(parameter)] for parameter in run.optimization.trainable_params]
                recorder.reference = diffusers_reference(trainable_copies(recorder.training_weights()),
                                                         run.optimization.ema.config)
            before = recorder.ema_state()
            result = super().train_step(run, window)
            if result.stepped:
                recorder.trained += 1
                if recorder.trained % run.optimization.ema.config.update_every == 0:
                    recorder.reference.step(trainable_copies(recorder.training_weights()))
                    recorder.reference_updates += 1
            weights = recorder.training_weights()
            recorder.magnitude = max([recorder.magnitude] + [weight.abs().max().item() for weight in weights])
            recorder.steps[result.step] = {
                "result": result, "before": before, "after": recorder.ema_state(), "weights": recorder.as_file(weights),
                "kind": healing.step_kind(result.stepped, result.decision.skip, result.verdict)}
            return result

        def validate(self, run, kind, where):
            recorder.validated[run.progress.global_step] = held_weights(run.network)
            super().validate(run, kind, where)

        def capture_healthy_point(self, states, healer, progress):
            super().capture_healthy_point(states, healer, progress)
            recorder.captured[progress.global_step] = recorder.ema_state(states.components["ema"])

        def rewind(self, run, step, reason):
            before = recorder.ema_state()
            super().rewind(run, step, reason)
            recorder.rewinds.append((before, recorder.ema_state(), recorder.captured[run.states.healthy_point["step"]]))

    return RecordingTrainer


def train_recorded(argv: list[str]) -> tuple[Recorder, str]:
    """Train in this process with a recording trainer; (recorder, stdout). Sample images are recorded
    with the weights the network holds while they are drawn."""
    recorder = Recorder()
    original = sampling.sample_images

    def sample_images(args, accelerator, models, network, device, *, when, step, epoch=None, **options):
        if sampling.is_sample_point(args, when, step, epoch):
            recorder.sampled[step] = held_weights(network)
        return original(args, accelerator, models, network, device, when=when, step=step, epoch=epoch, **options)

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    output = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(output):
        patch.setattr(sampling, "sample_images", sample_images)
        patch.setenv("SOURCE_DATE_EPOCH", SCRIPT_ENV["SOURCE_DATE_EPOCH"])  # byte-comparable with the subprocess runs
        train_network.main(recording_trainer(recorder), sdxl_train_network.setup_parser, argv)
    return recorder, output.getvalue()


# fp16 with an injected Inf gradient at step 3 (the loss scaler skips it) and a NaN latent (a non-finite loss
# once per epoch); an update every 2 trained steps with diffusers' power warm-up; files, states and validation
# every 2 steps, samples every 4.
EMA_FLAGS = ("--ema_decay", "0.8", "--ema_warmup", "--ema_power", "0.75", "--ema_update_every", "2",
             "--ema_save_raw", "--mixed_precision", "fp16", "--debug_inject_grad", "3=inf", "--debug_inject_sample",
             "002.png=nan", "--max_train_steps", "8", "--save_every_n_steps", "2", "--save_state",
             "--validation_split", "0.25", "--validate_every_n_steps", "2", "--sample_every_n_steps", "4")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red circle --w 64 --h 64 --s 1 --d 7\n")
    return path


@pytest.fixture(scope="module")
def ema_run(tiny_models, demo_dataset, prompts, tmp_path_factory) -> tuple[Path, Recorder, str]:
    output_dir = tmp_path_factory.mktemp("ema_run")
    recorder, output = train_recorded(ema_args(tiny_models, demo_dataset, output_dir, *EMA_FLAGS, "--sample_prompts",
                                               str(prompts)))
    return output_dir, recorder, output


def assert_same(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    for key, value in expected.items():
        assert torch.equal(value, actual[key]), key


def test_the_trained_average_equals_diffusers_ema_model_and_is_in_the_final_file(ema_run):
    output_dir, recorder, _ = ema_run
    final = read_lora_file(str(output_dir / "run.safetensors"))
    average = recorder.run.optimization.ema
    assert average.updates == recorder.reference_updates == recorder.trained // 2 >= 2  # every 2 trained steps
    tolerance = rounding_tolerance(recorder.reference_updates, recorder.magnitude)
    expected = recorder.as_file(recorder.reference.shadow_params)
    assert max((final[key] - expected[key]).abs().max().item() for key in expected) <= tolerance
    raw = read_lora_file(str(output_dir / "run-raw.safetensors"))
    assert_same(recorder.steps[8]["weights"], raw)
    assert any(not torch.equal(raw[key], final[key]) for key in expected)  # the average is not the weights
    assert final.keys() == raw.keys() and any(key.endswith(".alpha") for key in final)


def test_files_samples_and_validation_hold_the_average_and_the_state_the_training_weights(ema_run):
    output_dir, recorder, output = ema_run
    for step in (2, 4, 6, 8):
        average = recorder.as_file(recorder.steps[step]["after"]["average"])
        if step == 2:  # no update yet (the first is at step 4): the untrained LoRA, no file (it would replace one)
            assert recorder.steps[step]["after"]["updates"] == 0
            assert not (output_dir / "run-step00000002.safetensors").exists()
            assert not (output_dir / "run-step00000002-raw.safetensors").exists()
            assert f"not saving {output_dir / 'run-step00000002.safetensors'}: the EMA has not updated yet" in output
        else:
            assert_same(average, read_lora_file(str(output_dir / f"run-step{step:08d}.safetensors")))
            raw = read_lora_file(str(output_dir / f"run-step{step:08d}-raw.safetensors"))
            assert_same(recorder.steps[step]["weights"], raw)
        if step >= 6:  # the first update (step 4) copied the weights (decay 0); since then the average lags
            assert any(not torch.equal(average[key], recorder.steps[step]["weights"][key]) for key in average)
        if step % 4 == 0:
            assert_same(average, recorder.sampled[step])
        assert_same(average, recorder.validated[step])
        state = output_dir / train_state.step_state_name("run", step)
        assert_same(recorder.steps[step]["weights"], read_lora_file(str(state / "lora.safetensors")))
        components = torch.load(state / "components.pt", weights_only=False)
        assert [tensor.shape for tensor in components["ema"]["average"]] == [value.shape for value in average.values()]
        assert_same(average, recorder.as_file(components["ema"]["average"]))
        after = recorder.steps[step]["after"]
        assert (components["ema"]["updates"], components["ema"]["trained_steps"]) == \
            (after["updates"], after["trained_steps"])
    samples = sorted(path.name for path in (output_dir / "sample").iterdir())
    assert [name[:10] for name in samples] == ["run_000004", "run_000008"]
    assert "EMA of the LoRA weights: decay 0.8, power warm-up, every 2 trained step(s)" in output


def test_metadata_says_which_weights_a_file_holds(ema_run):
    output_dir, _, _ = ema_run
    for name, weights in (("run.safetensors", "ema"), ("run-raw.safetensors", "raw"),
                          ("run-step00000004.safetensors", "ema"), ("run-step00000004-raw.safetensors", "raw")):
        found = read_lora_metadata(str(output_dir / name))
        assert found["ss_weights"] == weights and found["ss_ema_decay"] == "0.8", name
        assert found["ss_ema_warmup"] == "power inv_gamma=1.0 power=0.75" and found["ss_ema_update_every"] == "2"
        assert found["sshs_model_hash"]  # the hashes are the file's own
    assert read_lora_metadata(str(output_dir / "run.safetensors"))["sshs_model_hash"] != \
        read_lora_metadata(str(output_dir / "run-raw.safetensors"))["sshs_model_hash"]


def test_a_step_that_does_not_train_leaves_the_average_unchanged(ema_run, tiny_models, demo_dataset, tmp_path):
    _, recorder, _ = ema_run
    # and a guard skip (minimal preset, NaN gradient at step 2)
    skipping, _ = train_recorded(ema_args(tiny_models, demo_dataset, tmp_path, "--ema_decay", "0.5",
                                          "--grad_guard_preset", "minimal", "--debug_inject_grad", "2=nan",
                                          "--max_train_steps", "3"))
    kinds = set()
    for record in [*recorder.steps.values(), *skipping.steps.values()]:
        before, after = record["before"], record["after"]
        kinds.add(record["kind"])
        if record["result"].stepped:
            assert after["trained_steps"] == before["trained_steps"] + 1
            continue
        assert (after["updates"], after["trained_steps"]) == (before["updates"], before["trained_steps"])
        assert all(torch.equal(a, b) for a, b in zip(before["average"], after["average"]))
    assert {"trained", "scaler", "guard", "loss"} <= kinds
    assert skipping.run.optimization.ema.trained_steps == sum(r["result"].stepped for r in skipping.steps.values())


def test_a_rewind_restores_the_average_of_the_healthy_point(tiny_models, tmp_path):
    from tools.make_demo_dataset import make_demo_dataset

    dataset = tmp_path / "dataset"
    make_demo_dataset(str(dataset))  # the quickstart's: at --learning_rate 1 the fp16 forward overflows
    recorder, output = train_recorded(model_args(tiny_models, "sdxl") + [  # test_healing's SIGKILL run
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64", "--output_dir",
        str(tmp_path / "out"), "--network_dim", "4", "--network_alpha", "16", "--network_args", "conv_dim=4",
        "conv_alpha=4", "--mixed_precision", "fp16", "--seed", "42", "--max_data_loader_n_workers", "0",
        "--grad_guard_preset", "stable", "--learning_rate", "1", "--max_train_steps", "8", "--rewind_every_n_steps",
        "2", "--ema_decay", "0.9"])
    assert recorder.rewinds, output[-2000:]
    for before, after, captured in recorder.rewinds:
        assert (after["updates"], after["trained_steps"]) == (captured["updates"], captured["trained_steps"])
        assert all(torch.equal(a, b) for a, b in zip(after["average"], captured["average"]))
    moved = [before for before, _, captured in recorder.rewinds
             if any(not torch.equal(a, b) for a, b in zip(before["average"], captured["average"]))]
    assert moved  # the average had moved since the healthy point: the restore did something


@pytest.mark.device
def test_sigkill_then_resume_auto_gives_identical_bytes(ema_run, tiny_models, demo_dataset, prompts, tmp_path):
    reference, _, _ = ema_run
    argv = ema_args(tiny_models, demo_dataset, tmp_path, *EMA_FLAGS, "--sample_prompts", str(prompts))
    # while writing step 4's state, in a process of its own (a fork of this one: no imports to wait for)
    killed = run_training_process("sdxl_train_network", argv + ["--debug_kill_in_state_write", "2"])
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    resumed = run_trainer_output("sdxl_train_network", argv + ["--resume", "auto"])  # needs no process of its own
    assert "resumed at step 2 " in resumed
    for name in ("run.safetensors", "run-raw.safetensors", "run-step00000004.safetensors",
                 "run-step00000008-raw.safetensors"):
        assert (tmp_path / name).read_bytes() == (reference / name).read_bytes(), name
    final_state = train_state.final_state_name("run")
    assert (tmp_path / final_state / "components.pt").read_bytes() != b""
    ours = torch.load(tmp_path / final_state / "components.pt", weights_only=False)["ema"]
    theirs = torch.load(reference / final_state / "components.pt", weights_only=False)["ema"]
    assert ours["updates"] == theirs["updates"] and all(map(torch.equal, ours["average"], theirs["average"]))


def test_resume_with_other_ema_settings_is_refused(ema_run, tiny_models, demo_dataset, tmp_path, capsys):
    reference, _, _ = ema_run
    state = reference / train_state.step_state_name("run", 2)
    message = train_expecting_user_error(ema_args(tiny_models, demo_dataset, tmp_path, "--mixed_precision", "fp16",
                                                  "--max_train_steps", "6", "--resume", str(state)), capsys)
    assert "the state was written with ema={'decay': 0.8," in message and "this run has ema=None" in message


def test_two_processes_hold_the_same_average(tiny_models, demo_dataset, tmp_path):
    argv = ema_args(tiny_models, demo_dataset, tmp_path, "--ema_decay", "0.7", "--ema_save_raw", "--max_train_steps",
                    "3", "--debug_report_weights")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(29500 + os.getpid() % 1000 + 11), str(REPO / "sdxl_train_network.py"), *argv]
    result = subprocess.run(command, cwd=REPO, env=SCRIPT_ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    hashes = dict(re.findall(r"rank (\d) lora_sha256 ([0-9a-f]{64})", result.stdout))
    assert len(hashes) == 2 and hashes["0"] == hashes["1"]  # the weights meant for use: the average
    final = read_lora_file(str(tmp_path / "run.safetensors"))
    raw = read_lora_file(str(tmp_path / "run-raw.safetensors"))
    assert any(not torch.equal(final[key], raw[key]) for key in final)
    assert fault_injection.weights_sha256(final) == hashes["0"]  # what the ranks hashed is the file's average
