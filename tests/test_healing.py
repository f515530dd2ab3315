"""Runs that heal themselves (docs/healing.md): the decision core, the healthy point, and real tiny-SDXL
trainings that diverge in fp16, meet a NaN latent, rewind, resume after SIGKILL and run on two processes."""
from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (REPO, SCRIPT_ENV, full_matrix, model_args, run_script_as_main, run_sdxl_script, run_trainer,
                      run_trainer_output)

from library import healing
from library.healing import HealingConfig, HealingPolicy, SampleOutcome, StepOutcome
from networks.lora import read_lora_file
from networks.network_base import read_lora_metadata



# --------------------------------------------------------------------------- the decision core


def outcome(step: int, losses: list[float], inputs: list[bool] | None = None, norm: float = 1.0,
            scaler: bool = True, images: list[int] | None = None) -> StepOutcome:
    images = images or list(range(len(losses)))
    inputs = inputs or [True] * len(losses)
    samples = tuple(SampleOutcome(image, image, loss, finite) for image, loss, finite in zip(images, losses, inputs))
    finite = [loss for loss in losses if math.isfinite(loss)]
    window_loss = sum(finite) / len(finite) if len(finite) == len(losses) else math.nan
    return StepOutcome(step, samples, window_loss, norm, has_scaler=scaler)


def policy(num_images: int = 10, **options) -> HealingPolicy:
    config = HealingConfig(**{"rewind_on_divergence": True, "quarantine_bad_samples": True, **options})
    healer = HealingPolicy(config, num_images, describe=lambda image: (f"img{image}.png", f"caption {image}"))
    healer.mark_healthy(0)
    return healer


def test_forward_overflow_is_told_from_gradient_overflow():
    healer = policy()
    assert healer.assess(outcome(1, [0.5, 0.6])) == healing.HEALTHY
    with_scaler = healer.assess(outcome(2, [0.5, 0.6], norm=math.inf))
    assert with_scaler.train and with_scaler.report == "gradient"  # the scaler's business
    assert not healer.assess(outcome(3, [0.5, 0.6], norm=math.nan, scaler=False)).train  # no scaler: skipped
    nan_loss = healer.assess(outcome(4, [math.nan, math.nan], norm=math.nan))
    assert not nan_loss.train and nan_loss.problem == "non-finite loss" and nan_loss.report == "loss"
    assert (healer.nonfinite_loss_steps, healer.nonfinite_grad_steps) == (1, 1)


def test_non_finite_inputs_quarantine_at_once_and_a_finite_input_sample_after_two_strikes():
    healer = policy()
    verdict = healer.assess(outcome(1, [math.nan], inputs=[False], images=[3]))  # batch 1: no rest of the step
    assert [entry.file for entry in verdict.quarantined] == ["img3.png"] and verdict.quarantined[0].certain
    assert not verdict.rewind and healer.now.nan_streak == 0  # explained by its inputs: no divergence
    first = healer.assess(outcome(2, [math.nan, 0.5], images=[4, 5]))
    assert not first.quarantined and not first.train
    second = healer.assess(outcome(3, [0.4, math.nan], images=[6, 4]))
    assert [entry.image for entry in second.quarantined] == [4] and not second.quarantined[0].certain
    assert healer.quarantined_images == {3, 4}


def test_divergence_rewinds_after_consecutive_all_nan_steps_and_stops_past_the_cap():
    healer = policy(max_rewinds=1, divergence_nan_steps=2)
    assert not healer.assess(outcome(1, [math.nan, math.nan])).rewind
    verdict = healer.assess(outcome(2, [math.nan, math.nan]))
    assert verdict.rewind == "non-finite loss at 2 consecutive steps" and not verdict.train
    event = healer.rewound(2, verdict.rewind, batches_skipped=2)
    assert (event.to_step, event.lr_scale, healer.lr_multiplier) == (0, 0.1, 0.1)
    healer.assess(outcome(3, [math.nan, math.nan]))
    stopped = healer.assess(outcome(4, [math.nan, math.nan]))
    assert stopped.stop and "--max_rewinds 1 rewinds are used up" in stopped.stop_reason


def test_without_rewinding_nothing_rewinds_but_the_end_is_failed():
    healer = HealingPolicy(HealingConfig(), 4)
    for step in range(1, 4):
        verdict = healer.conclude(healer.assess(outcome(step, [math.nan])), "loss")
        assert not verdict.rewind and not verdict.stop and not verdict.train
    assert "the last 3 steps had a non-finite loss on every sample" in healer.failure_at_end()


def test_a_loss_runaway_is_measured_against_the_healthy_point():
    healer = policy(divergence_window=4, divergence_loss_ratio=3.0, divergence_grad_ratio=0)
    for step in range(1, 5):  # the initial healthy point's reference: the first window after it
        assert healer.assess(outcome(step, [1.0])) == healing.HEALTHY
    assert healer.now.reference == (1.0, 1.0)
    assert healer.assess(outcome(5, [10.0])) == healing.HEALTHY  # the median is not above 3x yet
    verdict = healer.assess(outcome(6, [10.0]))
    assert verdict.rewind.startswith("loss runaway: median loss of the last 4 steps 5.5 is 5.5x the 1 at the "
                                     "healthy point")


def test_a_stuck_run_is_a_divergence():
    healer = policy()
    verdict = healing.HEALTHY
    for step in range(1, healing.FAILED_END_STEPS + 1):
        verdict = healer.conclude(healer.assess(outcome(step, [0.5], norm=1e9)), "guard")
    assert verdict.rewind == f"no step trained in the last {healing.FAILED_END_STEPS} (guard 10)"


def test_policy_state_round_trips_through_json():
    healer = policy()
    healer.assess(outcome(1, [math.nan], inputs=[False], images=[2]))
    healer.assess(outcome(2, [math.nan, 0.5], images=[5, 6]))
    healer.conclude(healer.assess(outcome(3, [0.3, 0.4], norm=math.inf)), "scaler")
    state = json.loads(json.dumps(healer.state_dict()))
    again = policy()
    again.load_state_dict(state)
    assert again.state_dict() == healer.state_dict()
    for restored in (healer, again):
        assert [entry.image for entry in restored.assess(outcome(4, [0.2, math.nan], images=[7, 5])).quarantined] == [5]


def test_window_samples_vector_round_trips_over_processes():
    rows = []
    for rank in range(2):
        samples = healing.WindowSamples(rank, 2, accumulation_steps=2, max_batch_size=2)
        samples.add(torch.tensor([10 + rank, 20]), torch.tensor([0.5, math.nan]), torch.tensor([True, False]), False)
        samples.add(torch.tensor([30]), torch.tensor([0.25]), None, padding=rank == 1)
        rows.append(samples.vector(torch.tensor(1.0 + rank)))
    summed = (rows[0] + rows[1]).tolist()  # what the all-reduce gives
    assert summed[0] == 3.0
    found = healing.WindowSamples.outcomes(summed, image_of=lambda sample_id: sample_id // 10)
    assert [(s.sample_id, s.image, s.inputs_finite, s.padding) for s in found] == [
        (10, 1, True, False), (20, 2, False, False), (30, 3, True, False),
        (11, 1, True, False), (20, 2, False, False), (30, 3, True, True)]
    assert math.isnan(found[1].loss) and found[2].loss == 0.25


def test_learning_rates_scale_with_the_schedule():
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([parameter], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    scheduler.step()
    assert healing.scale_learning_rates(optimizer, scheduler, 0.1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 3)


def test_the_healthy_point_restores_twice_and_never_aliases_the_live_state(tmp_path):
    from library.train_state import RunStates, StateStore

    network = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(network.parameters(), lr=0.1)

    class Wrapped(torch.nn.Module):  # the network interface RunStates uses
        def __init__(self, module):
            super().__init__()
            self.module = module

        def training_state_dict(self):
            return self.module.state_dict()

        def load_training_state_dict(self, state):
            self.module.load_state_dict(state)

    def train_step():
        network(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    states = RunStates(StateStore(str(tmp_path), "run", {}), Wrapped(network), {"optimizer": optimizer})
    train_step()
    states.capture(1, position=(1, 1))
    captured = [value.clone() for value in network.state_dict().values()]
    captured_moment = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    for _ in range(2):
        train_step()
        assert states.restore(torch.device("cpu")) == 1
        assert all(torch.equal(a, b) for a, b in zip(network.state_dict().values(), captured))
        assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], captured_moment)
    assert states.healthy_point_bytes() > 0


# --------------------------------------------------------------------------- real trainings


@pytest.fixture(scope="module")
def quickstart_dataset(tmp_path_factory) -> Path:
    """The quickstart's dataset: eight generated shapes with captions, ten repeats."""
    from tools.make_demo_dataset import make_demo_dataset

    root = tmp_path_factory.mktemp("quickstart_dataset")
    make_demo_dataset(str(root))
    return root


def quickstart_args(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    """scripts/quickstart.sh's command (fp16, the stable preset), to be varied by ``extra``."""
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "q", "--network_dim", "16", "--network_alpha", "16",
        "--network_args", "conv_dim=16", "conv_alpha=16", "--optimizer_type", "AdamW", "--mixed_precision", "fp16",
        "--seed", "42", "--max_data_loader_n_workers", "0", "--grad_guard_preset", "stable", *extra,
    ]


def train(argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, stdout) of an in-process training."""
    capsys.readouterr()
    code = 0
    try:
        run_trainer("sdxl_train_network", argv)
    except SystemExit as exited:
        code = exited.code
    return code, capsys.readouterr().out


def log_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


@pytest.fixture(scope="module")
def learning_rate_one(tiny_models, quickstart_dataset, tmp_path_factory) -> tuple[Path, str]:
    """The issue's run: the quickstart at --learning_rate 1 (the fp16 forward overflows from step 2). 20 steps: on
    CPU it rewinds at steps 3 and 7, then trains 13 steps at 0.01, so the last ten, all after the rewinds, show
    the run learning again and the file of step 10 comes after both rewinds."""
    output_dir = tmp_path_factory.mktemp("lr_one")
    argv = quickstart_args(tiny_models, quickstart_dataset, output_dir, "--learning_rate", "1",
                           "--max_train_steps", "20", "--log_jsonl", str(output_dir / "log.jsonl"),
                           "--save_every_n_steps", "10")
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):  # a module fixture: capsys is per test
        run_trainer("sdxl_train_network", argv)
    return output_dir, buffer.getvalue()


def test_a_diverging_fp16_run_rewinds_and_ends_with_a_usable_lora(learning_rate_one):
    output_dir, output = learning_rate_one
    rows = log_rows(output_dir / "gradient_logs+q.txt")
    losses = [float(row["Loss"]) for row in rows]
    last_ten = losses[-10:]
    assert all(math.isfinite(loss) for loss in last_ten) and sum(last_ten) / 10 < losses[0]
    rewinds = re.findall(r"^step (\d+): (.*): rewound to the healthy point of step (\d+), learning rate now "
                         r"([0-9.e+-]+), (\d+) batches of the diverged span skipped", output, re.M)
    assert rewinds and rewinds[0][1] == "non-finite loss at 2 consecutive steps"
    final = output.strip().splitlines()[-1]
    assert final.startswith("done: 20 steps, ") and f"rewinds {len(rewinds)} (learning rate now " \
        f"{float(rewinds[-1][3]):.4g}" in final and "final average loss" in final
    # the loss scale never fell: a forward overflow is not the scaler's business
    assert {row["Scale"] for row in rows} == {"65536.0"}
    weights = read_lora_file(str(output_dir / "q.safetensors"))
    assert all(torch.isfinite(value).all() for value in weights.values())
    recorded = json.loads(read_lora_metadata(str(output_dir / "q.safetensors"))["ss_rewinds"])
    assert [(event["step"], event["to_step"]) for event in recorded] == [(int(s), int(t)) for s, _, t, _, _ in rewinds]
    assert read_lora_metadata(str(output_dir / "q-step00000010.safetensors"))["ss_rewinds"] == json.dumps(
        [event for event in recorded if event["step"] <= 10])  # the files saved during the run too
    events = [json.loads(line) for line in (output_dir / "log.jsonl").read_text().splitlines()]
    assert [event["step"] for event in events if event.get("event") == "rewind"] == [int(s) for s, *_ in rewinds]
    assert [event.get("train/rewinds") for event in events if "loss/current" in event][-1] == len(rewinds)


def test_the_nan_report_names_the_step_the_samples_and_the_first_module(learning_rate_one):
    output_dir, output = learning_rate_one
    report = (output_dir / "q-nan_report.txt").read_text()
    assert f"step 2: first non-finite loss; what it was: {output_dir / 'q-nan_report.txt'}" in output
    assert report.startswith("== first non-finite loss: optimizer step 2 (epoch 1) ==")
    assert re.search(r"10_shape/\d{3}\.png, caption '[a-z ]+', loss nan, timestep \d+, noisy latents finite, "
                     r"text conditioning finite", report)
    assert re.search(r"first non-finite module output in a re-run of the forward: unet\.\S+ \(float16; output "
                     r"(nan|inf)", report)
    assert "loss scale: 65536" in report and "learning rates: 1, 1, 1" in report


def test_replay_and_plot_show_the_rewinds(learning_rate_one, tmp_path):
    output_dir, _ = learning_rate_one
    log = output_dir / "gradient_logs+q.txt"
    events = [row for row in log_rows(output_dir / "healing_log+q.txt")]
    assert events[0] == {"Step": "0", "Event": "healthy", "Detail": ""}
    replayed = tmp_path / "replayed.csv"
    result = run_script_as_main([sys.executable, str(REPO / "tools" / "replay_grad_guard.py"), str(log), "--out",
                                 str(replayed), "--grad_guard_preset", "stable"], REPO, expect=None)
    assert result.returncode == 0, result.stderr
    rewinds = [row for row in events if row["Event"] == "rewind"]
    assert f"rewinds={len(rewinds)} quarantined=0" in result.stdout
    for row, again in zip(log_rows(log), log_rows(replayed)):
        assert (row["Threshold"], row["ThreshOff"]) == (again["Threshold"], again["ThreshOff"])
        expected = next((f"rewind to {e['Detail']}" for e in rewinds if e["Step"] == row["Step"]), "")
        assert again["Event"] == expected
    from tools.plot_grad_log import draw_logs, read_gradient_log

    figure = draw_logs([read_gradient_log(log)])
    lines = [artist for ax in figure.axes for artist in ax.get_lines() if artist.get_gid() == "rewind"]
    assert len(lines) == 2 * len(rewinds)  # the norm and loss panels
    assert f"{len(rewinds)} rewinds" in figure._suptitle.get_text()


def test_a_learning_rate_typo_heals_or_stops_with_the_last_healthy_weights(tiny_models, quickstart_dataset,
                                                                           tmp_path, capsys):
    code, output = train(quickstart_args(tiny_models, quickstart_dataset, tmp_path, "--learning_rate", "1e4",
                                         "--max_train_steps", "40"), capsys)
    final = output.strip().splitlines()[-1]
    if code == 0:
        assert final.startswith("done: 40 steps") and "rewinds " in final
        losses = [float(row["Loss"]) for row in log_rows(tmp_path / "gradient_logs+q.txt")]
        assert sum(losses[-10:]) / 10 < losses[0]
    else:
        assert code == 1 and final.startswith("failed: ") and (tmp_path / "q-last_healthy.safetensors").exists()
        assert not (tmp_path / "q.safetensors").exists()


def test_without_healing_a_run_whose_last_steps_failed_is_not_done(tiny_models, quickstart_dataset, tmp_path, capsys):
    code, output = train(quickstart_args(tiny_models, quickstart_dataset, tmp_path, "--learning_rate", "1",
                                         "--max_train_steps", "6", "--no-rewind_on_divergence"), capsys)
    final = output.strip().splitlines()[-1]
    assert code == 1 and final.startswith("failed: the last 5 steps had a non-finite loss on every sample")
    assert "--rewind_on_divergence (in --grad_guard_preset stable) rewinds such a run" in final
    assert "no last healthy weights written" in final and not (tmp_path / "q.safetensors").exists()
    scales = {row["Scale"] for row in log_rows(tmp_path / "gradient_logs+q.txt")}
    assert scales == {"65536.0"}  # the scale did not fall 5 times for nothing


def test_a_nan_latent_is_quarantined_by_name_and_no_other_image_is_lost(tiny_models, quickstart_dataset, tmp_path,
                                                                        capsys, monkeypatch):
    import sdxl_train_network
    from library.run_data import TrainingData

    trained: list[list[int]] = []  # the sample ids of every optimizer step
    datasets_seen = []
    original_window = sdxl_train_network.SdxlNetworkTrainer.backward_window
    original_init = TrainingData.__init__

    def backward_window(self, run, window, *args, **kwargs):
        trained.append([sample_id for batch in window for sample_id in batch["sample_indices"].tolist()])
        return original_window(self, run, window, *args, **kwargs)

    def init(self, args, dataset, *rest, **kwargs):
        datasets_seen.append(dataset)
        original_init(self, args, dataset, *rest, **kwargs)

    monkeypatch.setattr(sdxl_train_network.SdxlNetworkTrainer, "backward_window", backward_window)
    monkeypatch.setattr(TrainingData, "__init__", init)
    # 10 steps: 003.png is in step 2's batch, and steps 3-7 already hold each of the 7 other images (seed 42)
    argv = quickstart_args(tiny_models, quickstart_dataset, tmp_path, "--learning_rate", "5e-3", "--max_train_steps",
                           "10", "--train_batch_size", "2", "--debug_inject_sample", "003.png=nan",
                           "--save_state", "--save_every_n_steps", "10")
    code, output = train(argv, capsys)
    assert code == 0
    quarantine_lines = [line for line in output.splitlines() if "quarantined" in line and line.startswith("step")]
    assert len(quarantine_lines) == 1 and "10_shape/003.png (caption 'a yellow circle'): its inputs are non-finite" \
        in quarantine_lines[0]
    quarantined_at = int(quarantine_lines[0].split(":")[0].split()[1])
    file_of = lambda sample_id: Path(datasets_seen[0].image_of(sample_id).path).name  # noqa: E731
    seen_after = [file_of(sample_id) for step in trained[quarantined_at:] for sample_id in step]
    assert "003.png" in {file_of(sample_id) for sample_id in trained[quarantined_at - 1]}
    assert set(seen_after) == {f"{index:03d}.png" for index in range(8)} - {"003.png"}  # no other image lost
    final = output.strip().splitlines()[-1]
    assert final.startswith("done: 10 steps, 9 trained") and "quarantined samples 1" in final
    report = (tmp_path / "q-nan_report.txt").read_text()
    assert "003.png, caption 'a yellow circle', loss nan" in report and "noisy latents NON-FINITE" in report
    recorded = json.loads(read_lora_metadata(str(tmp_path / "q.safetensors"))["ss_quarantined_samples"])
    assert [Path(entry["file"]).name for entry in recorded] == ["003.png"]
    state = torch.load(tmp_path / "q-state" / "components.pt", weights_only=False)
    assert [Path(entry["file"]).name for entry in state["healing"]["quarantine"]] == ["003.png"]
    assert "quarantine" in (tmp_path / "healing_log+q.txt").read_text()


def test_healthy_runs_do_not_change_with_the_healing(tiny_models, quickstart_dataset, tmp_path, capsys, monkeypatch):
    """The stable preset with and without its self-healing part: the same bytes when nothing diverges."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")  # the metadata's start time
    for name, extra in (("healing", ["--rewind_every_n_steps", "2"]),  # (refused without rewinding)
                        ("plain", ["--no-rewind_on_divergence", "--no-quarantine_bad_samples", "--no-nan_report"])):
        code, _ = train(quickstart_args(tiny_models, quickstart_dataset, tmp_path / name, "--learning_rate", "5e-3",
                                        "--max_train_steps", "5", *extra), capsys)
        assert code == 0
    healing_dir, plain_dir = tmp_path / "healing", tmp_path / "plain"
    assert (healing_dir / "q.safetensors").read_bytes() == (plain_dir / "q.safetensors").read_bytes()
    assert (healing_dir / "gradient_logs+q.txt").read_text() == (plain_dir / "gradient_logs+q.txt").read_text()
    # two points captured mid-run, each followed by steps that trained from it
    assert [row["Step"] for row in log_rows(healing_dir / "healing_log+q.txt")] == ["0", "2", "4"]
    assert not (plain_dir / "healing_log+q.txt").exists()


def sigkill_args(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return quickstart_args(tiny_models, dataset, output_dir, "--learning_rate", "1", "--max_train_steps", "8",
                           "--network_dim", "4", "--network_args", "conv_dim=4", "conv_alpha=4",
                           "--save_state", "--save_every_n_steps", "1", "--rewind_every_n_steps", "2", *extra)


@pytest.fixture(scope="module")
def uninterrupted_rewinds(tiny_models, quickstart_dataset, tmp_path_factory) -> tuple[Path, list[int]]:
    output_dir = tmp_path_factory.mktemp("rewinds_reference")
    output = run_trainer_output("sdxl_train_network", sigkill_args(tiny_models, quickstart_dataset, output_dir))
    steps = [int(step) for step in re.findall(r"^step (\d+): .*rewound", output, re.M)]
    assert steps, output[-2000:]
    return output_dir, steps


def test_the_same_command_twice_gives_the_same_files(uninterrupted_rewinds, tiny_models, quickstart_dataset,
                                                     tmp_path):
    reference, _ = uninterrupted_rewinds  # trained in this process, the same command again in a process of its own
    run_sdxl_script(sigkill_args(tiny_models, quickstart_dataset, tmp_path))
    for name in ("q.safetensors", "gradient_logs+q.txt", "healing_log+q.txt", "q-nan_report.txt"):
        assert (tmp_path / name).read_bytes() == (reference / name).read_bytes(), name


# "during": the state written right after the rewind is lost, so the resume starts from the step before it and
# must make the same rewind; "after": the resume starts from the state written after the rewind (its learning-rate
# multiplier, events and skipped batches). "before" (killed one step earlier) also resumes before the rewind and
# makes it, as "during" does: --full_matrix runs it.
KILLED_AROUND_A_REWIND = ["before", "during", "after"] if full_matrix() else ["during", "after"]


@pytest.mark.device
@pytest.mark.parametrize("when", KILLED_AROUND_A_REWIND)
def test_sigkill_around_a_rewind_then_resume_gives_identical_bytes(when, uninterrupted_rewinds, tiny_models,
                                                                   quickstart_dataset, tmp_path):
    reference, rewind_steps = uninterrupted_rewinds
    # a state is written at every step: dying while writing state K kills at step K, before it is visible
    kill_at = rewind_steps[0] + {"before": -1, "during": 0, "after": 1}[when]
    argv = sigkill_args(tiny_models, quickstart_dataset, tmp_path)
    killed = run_sdxl_script(argv + ["--debug_kill_in_state_write", str(kill_at)], expect=None)
    assert killed.returncode == -signal.SIGKILL
    resumed = run_trainer_output("sdxl_train_network", argv + ["--resume", "auto"])  # needs no process of its own
    assert f"resumed at step {kill_at - 1} " in resumed
    for name in ("q.safetensors", "gradient_logs+q.txt", "healing_log+q.txt"):
        assert (tmp_path / name).read_bytes() == (reference / name).read_bytes(), name


def test_two_processes_agree_on_every_quarantine_and_rewind(tiny_models, quickstart_dataset, tmp_path):
    argv = quickstart_args(tiny_models, quickstart_dataset, tmp_path, "--learning_rate", "1", "--max_train_steps", "8",
                           "--network_dim", "4", "--network_args", "conv_dim=4", "conv_alpha=4",
                           "--debug_inject_sample", "003.png=nan", "--debug_report_weights")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(29500 + os.getpid() % 1000 + 7), str(REPO / "sdxl_train_network.py"), *argv]
    result = subprocess.run(command, cwd=REPO, env=SCRIPT_ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    hashes = dict(re.findall(r"rank (\d) lora_sha256 ([0-9a-f]{64})", result.stdout))
    assert len(hashes) == 2 and hashes["0"] == hashes["1"]
    finals = [line for line in result.stdout.splitlines() if line.startswith("done: ")]
    assert len(finals) == 2 and finals[0] == finals[1]  # both processes counted the same steps and events
    assert "quarantined samples 1" in finals[0] and "rewinds 0;" not in finals[0]
    events = (tmp_path / "healing_log+q.txt").read_text()
    assert "quarantine" in events and "rewind" in events


@pytest.mark.parametrize("flags, expected", [
    (["--rewind_lr_factor", "1.5"], "--rewind_lr_factor 1.5 must be between 0 and 1"),
    (["--rewind_every_n_steps", "0"], "--rewind_every_n_steps 0 must be a whole number of optimizer steps >= 1"),
    (["--max_rewinds", "-1"], "--max_rewinds -1 must be a whole number >= 0"),
    (["--divergence_nan_steps", "0"], "--divergence_nan_steps 0 must be a whole number"),
    (["--divergence_window", "0"], "--divergence_window 0 must be a whole number"),
    (["--divergence_loss_ratio", "0.5"], "--divergence_loss_ratio 0.5 must be a number > 1 (0: off)"),
    (["--divergence_grad_ratio", "nan"], "--divergence_grad_ratio nan must be a number > 1 (0: off)"),
    (["--debug_inject_sample", "003.png"], "--debug_inject_sample 003.png: expected NAME=nan or NAME=inf"),
])
def test_bad_healing_options_are_one_line_before_the_model_loads(flags, expected, tiny_models, quickstart_dataset,
                                                                 tmp_path, capsys):
    from conftest import train_expecting_user_error

    argv = quickstart_args(tiny_models, quickstart_dataset, tmp_path, "--max_train_steps", "2", *flags)
    argv[argv.index("--pretrained_model_name_or_path") + 1] = str(tmp_path / "not_loaded.safetensors")
    (tmp_path / "not_loaded.safetensors").write_bytes(b"")
    message = train_expecting_user_error(argv, capsys)
    assert expected in message


def test_healing_options_read_from_a_gui_toml(tiny_models, quickstart_dataset, tmp_path, capsys):
    config = tmp_path / "config.toml"
    config.write_text("rewind_on_divergence = true\nrewind_every_n_steps = 2\nrewind_lr_factor = 0.5\n"
                      "max_rewinds = 3\nquarantine_bad_samples = false\nnan_report = true\n")
    argv = quickstart_args(tiny_models, quickstart_dataset, tmp_path, "--learning_rate", "1", "--max_train_steps", "5",
                           "--config_file", str(config))
    argv.remove("--grad_guard_preset")
    argv.remove("stable")
    code, output = train(argv, capsys)
    assert "learning rate now 0.5," in output and "(rewind 1 of 3)" in output
    events = log_rows(tmp_path / "healing_log+q.txt") if (tmp_path / "healing_log+q.txt").exists() else []
    assert not events  # no --grad_norm_log without the preset: no events file, the console said it
    assert (tmp_path / "q-nan_report.txt").exists()
