"""Knowing when the LoRA is good (docs/know_your_lora.md): the best checkpoint kept by validation,
the trend of each validation and early stopping."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import run_trainer, train_expecting_user_error
from test_validation import file_metadata, jsonl_rows, rows_with, safetensors_parts, trainer_args, write_folder

from library import best_checkpoint, checkpoint_keys, lora_effect, lr_finder
from library.errors import UserError
from networks import convert_to_lora, network_base, registry


@pytest.fixture(scope="module")
def three_images(tmp_path_factory) -> Path:
    """Three images: --validation_split 0.34 trains on 2 and validates on 1."""
    root = tmp_path_factory.mktemp("three")
    write_folder(root / "1_thing", 3)
    return root


def test_trend_against_the_best():
    margin = 0.01
    assert best_checkpoint.trend(1.0, float("inf"), margin) == best_checkpoint.IMPROVING
    assert best_checkpoint.trend(0.98, 1.0, margin) == best_checkpoint.IMPROVING
    # within 1% of the best, either side: a plateau (a rounding-level gain is no progress)
    assert best_checkpoint.trend(0.995, 1.0, margin) == best_checkpoint.PLATEAU
    assert best_checkpoint.trend(1.005, 1.0, margin) == best_checkpoint.PLATEAU
    assert best_checkpoint.trend(1.02, 1.0, margin) == best_checkpoint.WORSE
    assert best_checkpoint.trend(float("nan"), 1.0, margin) == best_checkpoint.WORSE


def test_patience_counts_validations_not_passes_at_the_same_step(tmp_path):
    args = argparse.Namespace(best_checkpoint_margin=0.001, early_stop_patience=2)
    tracker = best_checkpoint.BestCheckpoint(args, str(tmp_path / "best.safetensors"), is_main_process=True)
    written = []
    for step, value in ((4, 1.0), (8, 1.0), (8, 1.0), (12, 1.1)):  # step 8: the step's and the epoch's pass
        verdict = tracker.observe(step, value, written.append)
    assert [metadata["ss_best_step"] for metadata in written] == ["4"]
    assert (verdict.trend, verdict.since_best, verdict.stop) == (best_checkpoint.WORSE, 2, True)
    resumed = best_checkpoint.BestCheckpoint(args, str(tmp_path / "best.safetensors"), is_main_process=True)
    resumed.load_state_dict(tracker.state_dict())
    assert resumed.observe(16, 0.5, written.append).trend == best_checkpoint.IMPROVING and len(written) == 2


@pytest.mark.parametrize("flag,value", [("--early_stop_patience", "0"), ("--best_checkpoint_margin", "1.5")])
def test_bad_values_are_refused_by_name(flag, value, tiny_models, three_images, tmp_path, capsys):
    error = train_expecting_user_error(trainer_args(tiny_models, three_images, tmp_path / "out", flag, value), capsys)
    assert error.startswith(f"error: {flag} {value} must be")


def test_best_file_trend_and_early_stop(tiny_models, three_images, tmp_path, capsys):
    """2 training images at a high rate, validated and saved every 2 steps: improving -> plateau ->
    getting worse; --early_stop_patience 2 stops at the second validation without improvement; the best
    file holds the weights of the lowest validation loss byte for byte, and the final file is the best."""
    out, log = tmp_path / "out", tmp_path / "log.jsonl"
    capsys.readouterr()
    run_trainer("sdxl_train_network", trainer_args(
        tiny_models, three_images, out, "--learning_rate", "3e-2", "--max_train_steps", "40",
        "--validation_split", "0.34", "--validate_every_n_steps", "2", "--validate_every_n_epochs", "1000",
        "--save_every_n_steps", "2", "--early_stop_patience", "2", "--log_jsonl", str(log)))
    output = capsys.readouterr().out
    trends = re.findall(r"validation at step (\d+): (improving|plateau|getting worse)", output)
    kinds = [kind for _, kind in trends]
    # the order the issue asks for: improvements first, then no improvement, ending with "getting worse"
    first_plateau = kinds.index(best_checkpoint.PLATEAU)
    assert set(kinds[:first_plateau]) == {best_checkpoint.IMPROVING} and kinds[-1] == best_checkpoint.WORSE
    rows = jsonl_rows(log)
    values = rows_with(rows, "loss/validation/step_average")
    last_step = max(values)
    assert last_step < 40 and int(trends[-1][0]) == last_step  # stopped early, at its last validation
    best_step = min(values, key=values.get)
    metadata = file_metadata(out / "last-best.safetensors")
    assert metadata["ss_best_step"] == str(best_step) == metadata["ss_steps"]
    assert float(metadata["ss_best_validation_loss"]) == values[best_step]
    assert rows_with(rows, "loss/validation/step_best")[last_step] == values[best_step]
    best_header, _, best_bytes = safetensors_parts(out / "last-best.safetensors")
    step_header, _, step_bytes = safetensors_parts(out / f"last-step{best_step:08d}.safetensors")
    assert best_header == step_header and best_bytes == step_bytes
    assert (out / "last.safetensors").read_bytes() == (out / "last-best.safetensors").read_bytes()
    assert "--early_stop_patience 2 reached" in output


def test_no_validation_no_best_file(tiny_models, three_images, tmp_path, capsys):
    out = tmp_path / "out"
    capsys.readouterr()
    run_trainer("sdxl_train_network", trainer_args(tiny_models, three_images, out, "--max_train_steps", "2",
                                                   "--early_stop_patience", "3"))
    assert "--early_stop_patience: no validation set" in capsys.readouterr().out
    assert sorted(path.name for path in out.iterdir() if path.suffix == ".safetensors") == ["last.safetensors"]


# -- the "does nothing" warning ----------------------------------------------------------------------
def test_the_check_comes_by_step_50():
    assert lora_effect.check_step(8) == 2 and lora_effect.check_step(40) == 10
    assert max(lora_effect.check_step(steps) for steps in range(1, 100000, 7)) == lora_effect.CHECK_STEP_CAP == 50
    assert [step for step in range(1, 401) if lora_effect.is_check(step, 50)] == [50, 100, 200, 300, 400]
    assert [step for step in range(1, 9) if lora_effect.is_check(step, 2)] == [2, 4, 6, 8]


@pytest.fixture(scope="module")
def half_representable_sdxl():
    """The tiny SDXL in float32 with every weight rounded to float16 (so a float16 copy holds the same values)."""
    from tools.build_tiny_models import tiny_sdxl

    models = tiny_sdxl()
    with torch.no_grad():
        for part in (models.unet, *models.text_encoders):
            for parameter in part.parameters():
                parameter.copy_(parameter.half().float())
    return models


# GLoRA and Full broke training once (float16 base weight times float32 factors; Full takes the weight off the
# layer): always run; every other type of the GUI's 16 with the slow tests.
ALWAYS_MEASURED = ("lycoris glora", "lycoris full")


@pytest.mark.parametrize("label", [label if label in ALWAYS_MEASURED else pytest.param(label, marks=pytest.mark.slow)
                                   for label in registry.EXAMPLE_NETWORKS])
def test_weight_change_of_every_type_on_float16_base_weights(label, half_representable_sdxl):
    """The monitor's ||delta W|| / ||W|| of every module, on float16 base weights with float32 adapters (as
    --mixed_precision fp16 trains), hooked in, equals the float64 merge's (``convert_to_lora.parameter_changes``
    on the float32 model holding the same values), to float32 rounding: the merge in float32 rounds each
    element by eps/2 of |W| (at most eps/2 on the ratio), the change's own float32 arithmetic by a few eps
    of itself (Cayley/butterfly products of OFT and BOFT: tens of eps)."""
    models = half_representable_sdxl
    parts = (models.unet, *models.text_encoders)
    module, alpha, _ = registry.EXAMPLE_NETWORKS[label]
    torch.manual_seed(0)
    network = registry.network_type(module).create_network(
        1.0, 4, alpha, None, models.text_encoders, models.unet,
        unet_module_names=checkpoint_keys.unet_module_name_map(models.unet.config),
        **network_base.parse_network_args(registry.example_network_args(label, 4)))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a trained-looking network: every adapter changes its layer by a few percent or more
        for parameter in network.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    expected = torch.tensor([
        float(convert_to_lora.parameter_changes(network, lora, network.wrapped_module(lora))["weight"].norm()
              / network.wrapped_module(lora).weight.detach().double().norm()) for lora in network.all_loras()],
        dtype=torch.float64)
    try:
        for part in parts:
            part.half()
        network.apply_to()
        monitor = lora_effect.EffectMonitor(argparse.Namespace(max_train_steps=8, network_weights=None), network,
                                            is_main_process=True)
        measured = monitor.weight_ratios().double()
    finally:
        for lora in network.all_loras():
            lora.restore()
        for part in parts:
            part.float()
    eps = torch.finfo(torch.float32).eps
    assert measured.shape == expected.shape and monitor.skipped_modules == 0
    assert expected.min() > 1e-3  # the bound below is far from the values
    torch.testing.assert_close(measured, expected, rtol=64 * eps, atol=eps)


def warning_of(tiny_models, dataset, output_dir, capsys, *extra: str) -> tuple[list[str], list[dict]]:
    """The "does nothing"/"stopped learning" lines of an 8-step run and its JSON lines."""
    log = output_dir / "log.jsonl"
    capsys.readouterr()
    run_trainer("sdxl_train_network", trainer_args(tiny_models, dataset, output_dir, "--max_train_steps", "8",
                                                   "--log_jsonl", str(log), *extra))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: this LoRA")]
    return lines, jsonl_rows(log)


def test_does_nothing_at_learning_rate_1e_9_names_the_rate(tiny_models, three_images, tmp_path, capsys):
    lines, rows = warning_of(tiny_models, three_images, tmp_path / "out", capsys, "--learning_rate", "1e-9")
    assert len(lines) == 1 and lines[0].startswith("warning: this LoRA does nothing after 2 steps")
    assert "the learning rate is too low (now 1e-09)" in lines[0]
    medians = rows_with(rows, "effect/weight_rel_median")  # logged at every check step (2, 4, 6, 8)
    assert list(medians) == [2, 4, 6, 8] and 0 < medians[2] < lora_effect.DOES_NOTHING_FLOOR


def test_does_nothing_when_the_guard_skips_every_step_names_the_guard(tiny_models, three_images, tmp_path, capsys):
    # The guard's limits only act once its window holds 200 norms, so a tiny --skip_grad_norm_max cannot
    # skip the first steps; a non-finite gradient at every step is skipped at once (--skip_inf_immediate).
    lines, rows = warning_of(tiny_models, three_images, tmp_path / "out", capsys, "--skip_grad_norm",
                             "--skip_grad_norm_max", "1e-12", "--debug_inject_grad", "1=inf", "2=inf")
    assert len(lines) == 1 and "the gradient guard skipped every step (2 of 2)" in lines[0]
    assert "--skip_grad_norm_max 1e-12" in lines[0]
    changes = rows_with(rows, "effect/weight_rel_max")  # steps 3-8 (finite gradients) train
    assert list(changes) == [2, 4, 6, 8] and changes[2] == 0.0 and changes[4] > 0


def test_a_tiny_guard_limit_is_named_by_the_first_check(tiny_models, three_images, tmp_path, capsys):
    """A tiny --skip_grad_norm_max alone: the guard applies it only once its window holds 200 norms (kohya's
    fork), so the first 199 steps train; the check at step 2 already says every step will be skipped from
    step 200 on, and why."""
    lines, rows = warning_of(tiny_models, three_images, tmp_path / "out", capsys, "--skip_grad_norm",
                             "--skip_grad_norm_max", "1e-12")
    assert len(lines) == 1 and lines[0].startswith("warning: this LoRA will stop learning from about step 200: "
                                                   "every gradient norm so far (2, the smallest ")
    assert "above --skip_grad_norm_max 1e-12, which the gradient guard applies once its window holds 200" in lines[0]
    assert rows_with(rows, "effect/weight_rel_median")[2] > 100 * lora_effect.DOES_NOTHING_FLOOR  # it trains now


@pytest.mark.parametrize("seed", ["0", "1"])
def test_silent_at_the_quick_starts_settings(seed, tiny_models, demo_dataset, tmp_path, capsys):
    """The quick start's network, optimizer, rate and precision (scripts/quickstart.sh), its check step
    reached sooner (8 steps: step 2 instead of 10, so less has changed; benchmarks/bench_does_nothing.py
    runs the full quick start over 20 seeds)."""
    lines, rows = warning_of(tiny_models, demo_dataset, tmp_path / "out", capsys, "--seed", seed,
                             "--network_dim", "16", "--network_alpha", "16", "--network_args", "conv_dim=16",
                             "conv_alpha=16", "--learning_rate", "5e-3", "--optimizer_type", "AdamW",
                             "--mixed_precision", "fp16", "--grad_guard_preset", "stable")
    assert lines == []
    assert min(rows_with(rows, "effect/weight_rel_median").values()) > 100 * lora_effect.DOES_NOTHING_FLOOR


def test_training_probe_without_validation_measures_the_effect_and_changes_no_trained_bit(
        tiny_models, three_images, tmp_path):
    """Without a validation split the monitor measures on the fixed probe of training images at every check
    step: the output change and the probe loss relative to the base model (1 where the LoRA does nothing:
    at learning rate 1e-30 exactly 1, every input being the same). The probe draws nothing from training's
    random streams: a 4-step run (probed at steps 1, 2, 3, 4) writes the same LoRA bytes as the step-4 file of
    an 8-step run (probed at 2, 4, 6, 8)."""
    def run(name: str, steps: str, *extra: str) -> list[dict]:
        log = tmp_path / f"{name}.jsonl"
        run_trainer("sdxl_train_network", trainer_args(tiny_models, three_images, tmp_path / name, "--max_train_steps",
                                                       steps, "--output_name", "net", "--log_jsonl", str(log), *extra))
        return jsonl_rows(log)

    long_rows = run("long", "8", "--save_every_n_steps", "4")
    short_rows = run("short", "4")
    assert list(rows_with(long_rows, "effect/output_rel")) == [2, 4, 6, 8]
    assert list(rows_with(short_rows, "effect/probe_rel")) == [1, 2, 3, 4]
    assert all(value > 0 for value in rows_with(long_rows, "effect/output_rel").values())
    assert {key for row in long_rows for key in row if key.startswith("effect/probe_rel_t")} == {
        f"effect/probe_rel_t{timestep}" for timestep in (200, 400, 600, 800)}
    assert safetensors_parts(tmp_path / "long" / "net-step00000004.safetensors")[2] == \
        safetensors_parts(tmp_path / "short" / "net.safetensors")[2]
    nothing = run("nothing", "4", "--learning_rate", "1e-30")
    assert set(rows_with(nothing, "effect/probe_rel").values()) == {1.0}
    assert set(rows_with(nothing, "effect/output_rel").values()) == {0.0}


# -- the debiased loss ----------------------------------------------------------------------------------
def test_debiased_loss_is_1_at_the_start_and_changes_no_trained_bit(tiny_models, three_images, tmp_path):
    """A fresh LoRA adds exactly 0 (its up weights are 0), so the first step's ratio is exactly 1; the extra
    base forward draws no random number: the LoRA is the same byte for byte with or without it."""
    common = ("--max_train_steps", "4", "--network_dropout", "0.1")  # dropout: a random draw per forward
    run_trainer("sdxl_train_network", trainer_args(tiny_models, three_images, tmp_path / "plain", *common))
    log = tmp_path / "log.jsonl"
    run_trainer("sdxl_train_network", trainer_args(tiny_models, three_images, tmp_path / "debiased", *common,
                                                   "--debiased_loss", "--log_jsonl", str(log)))
    plain = safetensors_parts(tmp_path / "plain" / "last.safetensors")
    debiased = safetensors_parts(tmp_path / "debiased" / "last.safetensors")
    assert plain[0] == debiased[0] and plain[2] == debiased[2]
    values = rows_with(jsonl_rows(log), "loss/debiased")
    assert list(values) == [1, 2, 3, 4] and values[1] == 1.0 and values[4] != 1.0
    averages = rows_with(jsonl_rows(log), "loss/debiased_average")
    assert averages[2] == pytest.approx((values[1] + values[2]) / 2, rel=1e-12)


# -- the learning-rate finder -------------------------------------------------------------------------
def test_lr_window_from_the_rows():
    rows = [lr_finder.FinderRow(step, rate, 1.0, probe) for step, (rate, probe) in
            enumerate([(1e-6, 1.0), (1e-5, 1.0005), (1e-4, 0.99), (1e-3, 0.95), (1e-2, 1.2)], 1)]
    found = lr_finder.window(rows, 1.0, top=1.0)
    assert (found.low, found.unstable, found.diverged) == (1e-4, 1e-2, True)
    assert lr_finder.window(rows[:2], 1.0, top=1e-5) == lr_finder.Window(None, 1e-5, False)  # no effect, stable
    assert lr_finder.learning_rate_at(0, 5, 1e-6, 1e-2) == 1e-6
    assert lr_finder.learning_rate_at(4, 5, 1e-6, 1e-2) == pytest.approx(1e-2)


def test_find_lr_is_deterministic_and_leaves_the_run_as_it_was(tiny_models, three_images, tmp_path, capsys):
    finder = ("--find_lr_steps", "3", "--find_lr_min", "1e-4", "--find_lr_max", "1")
    # batch 3: the probe is one batch (4 forwards per measurement)
    common = ("--max_train_steps", "3", "--train_batch_size", "3", "--mixed_precision", "fp16",
              "--network_dropout", "0.1")
    capsys.readouterr()
    run_trainer("sdxl_train_network", trainer_args(tiny_models, three_images, tmp_path / "only", *common, *finder,
                                                   "--find_lr_only"))
    assert "--find_lr: " in capsys.readouterr().out
    assert not (tmp_path / "only" / "last.safetensors").exists()  # printed and stopped
    # the same test again, before a training (--find_lr): the same rows (deterministic), and then the
    # training writes the bytes of the training alone (the finder put everything back)
    run_trainer("sdxl_train_network", trainer_args(tiny_models, three_images, tmp_path / "after", *common, *finder,
                                                   "--find_lr"))
    csvs = [(tmp_path / name / "last-lr_find.csv").read_text() for name in ("only", "after")]
    assert csvs[0] == csvs[1] and len(csvs[0].splitlines()) == 4
    run_trainer("sdxl_train_network", trainer_args(tiny_models, three_images, tmp_path / "alone", *common))
    after = safetensors_parts(tmp_path / "after" / "last.safetensors")
    alone = safetensors_parts(tmp_path / "alone" / "last.safetensors")
    assert after[0] == alone[0] and after[2] == alone[2]


def test_find_lr_does_not_apply_to_prodigy(tiny_models, three_images, tmp_path, capsys):
    capsys.readouterr()
    run_trainer("sdxl_train_network", trainer_args(tiny_models, three_images, tmp_path / "out", "--max_train_steps",
                                                   "1", "--optimizer_type", "Prodigy", "--learning_rate", "1",
                                                   "--find_lr_only"))
    assert "--find_lr: does not apply to --optimizer_type Prodigy" in capsys.readouterr().out
    assert not (tmp_path / "out" / "last-lr_find.csv").exists()


# -- the plot ---------------------------------------------------------------------------------------------
def test_plot_lora_quality_draws_every_panel_and_refuses_other_files(tmp_path, capsys):
    from tools import plot_lora_quality

    log = tmp_path / "log.jsonl"
    rows = [{"step": step, "loss/current": 1.0 / step, "loss/average": 1.0, "loss/debiased": 1.0 - step / 100,
             "loss/debiased_average": 1.0} for step in range(1, 5)]
    rows += [{"step": step, "loss/validation/step_average": value, "effect/val_rel": value,
              "effect/output_rel": step / 10, "effect/weight_rel_median": step / 100, "effect/weight_rel_max": step / 50}
             for step, value in ((2, 0.9), (4, 0.95))]
    log.write_text("".join(json.dumps(row) + "\n" for row in rows))
    csv_path = tmp_path / "run-lr_find.csv"
    csv_path.write_text("step,learning_rate,train_loss,probe_loss,probe_rel\n1,1e-06,1.0,1.0,1.0\n2,1e-05,1.0,1.1,1.1\n")
    series = plot_lora_quality.read_series(log)
    assert series["loss/validation/step_average"] == [(2, 0.9), (4, 0.95)]
    out = plot_lora_quality.main([str(log), "--lr_find", str(csv_path), "--out", str(tmp_path / "q.png")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(UserError, match="line 1 is not JSON"):
        plot_lora_quality.read_series(csv_path)
    with pytest.raises(UserError, match="--out"):
        plot_lora_quality.main([str(log), "--out", str(log)])
