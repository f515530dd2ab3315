"""Validation loss (kohya's --validation_split family): the split, the schedule, the value, and that
training is untouched by it."""
from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from conftest import model_args, run_script_as_main, run_trainer, train_expecting_user_error
from PIL import Image
from safetensors import safe_open

import sdxl_train_network
import train_network
from library import noise, text_encoding, validation
from library.datasets import dataset as datasets
from library.datasets.plan import split_train_validation
from networks import lora

REPO = Path(__file__).resolve().parent.parent
CAPTION_EXTENSION = ".txt"


def write_folder(folder: Path, count: int, seed: int = 0) -> None:
    """``count`` random 64x64 PNGs with comma-separated captions."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for index in range(count):
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(folder / f"{index:02d}.png")
        (folder / f"{index:02d}{CAPTION_EXTENSION}").write_text(f"thing, colour {index}, texture")


@pytest.fixture(scope="module")
def six_images(tmp_path_factory) -> Path:
    """One DreamBooth folder of six images: --validation_split 0.34 keeps ceil(6 * 0.66) = 4 for training."""
    root = tmp_path_factory.mktemp("six")
    write_folder(root / "1_thing", 6)
    return root


def trainer_args(tiny_models, dataset: Path, output_dir: Path, *extra: str, model: str = "sdxl") -> list[str]:
    return model_args(tiny_models, model) + [
        "--train_data_dir", str(dataset), "--caption_extension", CAPTION_EXTENSION, "--resolution", "64",
        "--output_dir", str(output_dir), "--seed", "3", "--max_data_loader_n_workers", "0",
        "--network_train_unet_only", "--network_dim", "4", "--learning_rate", "1e-2", *extra,
    ]


def jsonl_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def rows_with(rows: list[dict], key: str) -> dict[int, float]:
    return {row["step"]: row[key] for row in rows if key in row}


def file_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as file:
        return file.metadata()


def safetensors_parts(path: Path) -> tuple[dict, dict, bytes]:
    """(tensor header, metadata, tensor bytes) of a safetensors file."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    metadata = header.pop("__metadata__", {})
    return header, metadata, data[8 + length :]


def sdxl_args(*argv: str):
    return sdxl_train_network.setup_parser().parse_args(list(argv))


def planned_paths(dataset) -> list[str]:
    return [image.path for image in dataset.plan.images]


# -- the split ------------------------------------------------------------------------------------
def test_split_sizes_disjoint_deterministic_and_kohyas_training_part():
    for count in range(13):
        items = [f"image{index:02d}" for index in range(count)]
        for split in (0.1, 0.25, 0.34, 0.5, 0.9):
            training, held_out = split_train_validation(items, split, seed=5)
            assert len(training) == math.ceil(count * (1 - split))
            assert sorted(training + held_out) == items and not set(training) & set(held_out)
            assert training == sorted(training) and held_out == sorted(held_out)  # each part keeps the order
            assert split_train_validation(items, split, seed=5) == (training, held_out)
            # kohya: random.seed(validation_seed); random.shuffle(...); the first ceil(n * (1 - split)) train
            shuffled = list(items)
            random.Random(5).shuffle(shuffled)
            assert set(training) == set(shuffled[: math.ceil(count * (1 - split))])
    items = [f"image{index:02d}" for index in range(10)]
    assert split_train_validation(items, 0.5, seed=1) != split_train_validation(items, 0.5, seed=2)
    # kohya cuts its validation part as shuffled[n - round(n * split):]: 5 images at 0.3 train ceil(3.5) = 4
    # and validate shuffled[3:], 2 images of which one is trained on; ours validates the 1 that is not.
    items = items[:5]
    training, held_out = split_train_validation(items, 0.3, seed=0)
    shuffled = list(items)
    random.Random(0).shuffle(shuffled)
    kohya_validation = shuffled[len(items) - round(len(items) * 0.3) :]
    assert (len(training), len(held_out), len(kohya_validation)) == (4, 1, 2)
    assert len(set(kohya_validation) & set(training)) == 1 and set(held_out) < set(kohya_validation)


def test_folders_split_per_subset_and_reg_images_are_never_held_out(tmp_path):
    write_folder(tmp_path / "train" / "2_dog", 10, seed=1)
    write_folder(tmp_path / "train" / "1_cat", 3, seed=2)
    write_folder(tmp_path / "reg" / "1_animal", 5, seed=3)
    flags = ["--train_data_dir", str(tmp_path / "train"), "--reg_data_dir", str(tmp_path / "reg"),
             "--caption_extension", CAPTION_EXTENSION, "--resolution", "64", "--validation_split", "0.4"]

    def build(*extra: str):
        args = sdxl_args(*flags, *extra)
        train = datasets.build_dataset(args, 32)
        return train, datasets.build_validation_dataset(args, train, 32)

    train, held_out = build("--seed", "3")
    for subset, count, repeats in (("2_dog", 10, 2), ("1_cat", 3, 1)):
        trained = [path for path in planned_paths(train) if f"{os.sep}{subset}{os.sep}" in path]
        validated = [path for path in planned_paths(held_out) if f"{os.sep}{subset}{os.sep}" in path]
        assert len(trained) == math.ceil(count * 0.6) and len(trained) + len(validated) == count
        assert not set(trained) & set(validated)
    assert held_out.num_train_images == 4 * 2 + 1 * 1  # with repeats
    assert held_out.num_reg_images == 0
    assert not any(f"{os.sep}1_animal{os.sep}" in path for path in planned_paths(held_out))
    # the reg folder is whole: kohya's balancing takes reg images up to the 6 * 2 + 2 training samples
    reg = next(subset for planned in train.plan.datasets for subset in planned.subsets if subset.spec.is_reg)
    assert reg.img_count == 5 and train.num_train_images == 14

    assert planned_paths(build("--seed", "3")[1]) == planned_paths(held_out)  # deterministic
    assert planned_paths(build("--seed", "4")[1]) != planned_paths(held_out)  # the seed decides
    # --validation_seed decides when given, whatever --seed is
    assert planned_paths(build("--seed", "4", "--validation_seed", "3")[1]) == planned_paths(held_out)
    assert held_out.seed == 3 and build("--seed", "4", "--validation_seed", "9")[1].seed == 9


def test_dataset_config_keys_split_like_the_flags(six_images, tmp_path):
    config = tmp_path / "data.toml"
    config.write_text(f'[general]\nresolution = 64\ncaption_extension = "{CAPTION_EXTENSION}"\n'
                      f'validation_split = 0.34\n\n[[datasets]]\nvalidation_seed = 11\n\n'
                      f'[[datasets.subsets]]\nimage_dir = "{six_images / "1_thing"}"\n')
    args = sdxl_args("--dataset_config", str(config), "--seed", "3")
    from_config = datasets.build_validation_dataset(args, datasets.build_dataset(args, 32), 32)
    args = sdxl_args("--train_data_dir", str(six_images), "--caption_extension", CAPTION_EXTENSION,
                     "--resolution", "64", "--seed", "3", "--validation_split", "0.34")
    from_flags = datasets.build_validation_dataset(args, datasets.build_dataset(args, 32), 32)
    assert len(planned_paths(from_config)) == len(planned_paths(from_flags)) == 2
    order = list(range(6))
    random.Random(11).shuffle(order)  # the dataset's validation_seed, not --seed
    assert planned_paths(from_config) == [str(six_images / "1_thing" / f"{i:02d}.png") for i in sorted(order[4:])]


def test_fixed_timesteps_and_the_batch_cap(six_images):
    assert validation.fixed_timesteps(None, None, 1000) == [200, 400, 600, 800]  # kohya's defaults
    assert validation.fixed_timesteps(100, 900, 1000) == [260, 420, 580, 740]
    args = sdxl_args("--train_data_dir", str(six_images), "--caption_extension", CAPTION_EXTENSION,
                     "--resolution", "64", "--seed", "3", "--validation_split", "0.34")
    held_out = datasets.build_validation_dataset(args, datasets.build_dataset(args, 32), 32)
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True)
    assert len(validation.Validation(args, held_out, accelerator, 1000, 0).loader) == 2
    args.max_validation_steps = 1
    assert len(validation.Validation(args, held_out, accelerator, 1000, 0).loader) == 1


# -- bad values -----------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [
    ("validation_split", "1.0"), ("validation_split", "-0.1"), ("validate_every_n_steps", "0"),
    ("validate_every_n_epochs", "-1"), ("max_validation_steps", "0"),
])
def test_bad_flag_values_are_refused_by_name(flag, value, tiny_models, six_images, tmp_path, capsys):
    output_dir = tmp_path / "out"
    error = train_expecting_user_error(trainer_args(tiny_models, six_images, output_dir, f"--{flag}", value), capsys)
    assert error.startswith(f"error: --{flag} {value} must be")
    assert not output_dir.exists()


def test_bad_dataset_values_are_refused_by_name(tiny_models, six_images, tmp_path, capsys):
    config = tmp_path / "data.toml"
    config.write_text(f'[[datasets]]\nresolution = 64\nvalidation_split = 1.5\n\n'
                      f'[[datasets.subsets]]\nimage_dir = "{six_images / "1_thing"}"\n')
    argv = trainer_args(tiny_models, six_images, tmp_path / "out", "--dataset_config", str(config))
    assert "[[datasets]] #1: validation_split 1.5 must be" in train_expecting_user_error(argv, capsys)
    # kohya does not split fine-tuning datasets: refused instead of validating on the training images
    metadata = tmp_path / "meta.json"
    metadata.write_text(json.dumps({"00": {"caption": "thing"}}))
    argv = trainer_args(tiny_models, six_images / "1_thing", tmp_path / "out", "--in_json", str(metadata),
                        "--validation_split", "0.5")
    error = train_expecting_user_error(argv, capsys)
    assert error.startswith(f"error: --in_json {metadata}: validation_split 0.5 needs DreamBooth subsets")
    # 6 images at 0.1 keep ceil(5.4) = 6 for training: nothing to validate on
    argv = trainer_args(tiny_models, six_images, tmp_path / "out", "--validation_split", "0.1")
    assert "validation_split 0.1 holds out no image" in train_expecting_user_error(argv, capsys)
    assert not (tmp_path / "out").exists()


# -- the schedule, the scalars, the value ---------------------------------------------------------
def test_scalars_at_the_scheduled_steps_and_epochs(tiny_models, six_images, tmp_path, capsys):
    # 4 training images, batch 1: epochs end at steps 4 and 8; epoch validation every 2nd epoch
    log = tmp_path / "log.jsonl"
    capsys.readouterr()
    run_trainer("sdxl_train_network", trainer_args(
        tiny_models, six_images, tmp_path / "out", "--max_train_steps", "10", "--validation_split", "0.34",
        "--validate_every_n_steps", "4", "--validate_every_n_epochs", "2", "--log_jsonl", str(log)))
    output = capsys.readouterr().out
    rows = jsonl_rows(log)
    step_values = rows_with(rows, "loss/validation/step_average")
    epoch_values = rows_with(rows, "loss/validation/epoch_average")
    assert list(step_values) == [4, 8] and list(epoch_values) == [8]
    # same weights, same inputs: the same number, to the bit; other weights, another number
    assert epoch_values[8] == step_values[8] and step_values[4] != step_values[8]
    average = rows_with(rows, "loss/average")
    for kind, values in (("step", step_values), ("epoch", epoch_values)):
        divergence = rows_with(rows, f"loss/validation/{kind}_divergence")
        assert all(divergence[step] == value - average[step] for step, value in values.items())
    assert re.findall(r"validation loss after (step \d+|epoch \d+ \(step \d+\)):", output) == [
        "step 4", "step 8", "epoch 2 (step 8)"]

    metadata = file_metadata(tmp_path / "out" / "last.safetensors")
    assert {key: metadata[key] for key in metadata if "valid" in key} == {
        "ss_num_validation_images": "2", "ss_validation_seed": "None", "ss_validation_split": "0.34",
        "ss_max_validation_steps": "None", "ss_validate_every_n_epochs": "2", "ss_validate_every_n_steps": "4"}
    assert metadata["ss_num_train_images"] == "4"


def test_value_equals_an_independent_recomputation(tiny_models, six_images, tmp_path):
    """SD1.5, batch 1: the epoch-end value is the mean plain-MSE over the 2 held-out images x 4 timesteps,
    with the latent sample and noise keyed by (validation seed, -1 - timestep, sample)."""
    log = tmp_path / "log.jsonl"
    argv = trainer_args(tiny_models, six_images, tmp_path / "out", "--max_train_steps", "4", "--save_precision",
                        "float", "--validation_split", "0.34", "--validation_seed", "11", "--log_jsonl", str(log),
                        model="sd15")
    run_trainer("train_network", argv)
    reported = rows_with(jsonl_rows(log), "loss/validation/epoch_average")[4]

    trainer = train_network.NetworkTrainer()
    args = train_network.setup_parser().parse_args(argv)
    models = trainer.load_models(args)
    weights = lora.read_lora_file(str(tmp_path / "out" / "last.safetensors"))
    network = lora.create_network_from_weights(1.0, weights, models.text_encoders, models.unet,
                                               trainer.unet_module_names(models))
    network.load_state_dict(weights)
    network.apply_to()
    held_out = datasets.build_validation_dataset(args, datasets.build_dataset(args, 64), 64)
    scheduler = noise.training_noise_scheduler()
    values = []
    with torch.no_grad():
        for index in range(len(held_out)):
            batch = held_out[index]
            ids = batch["sample_indices"].tolist()
            distribution = models.vae.encode(batch["images"]).latent_dist
            shape = tuple(distribution.mean.shape[1:])
            hidden = text_encoding.encode_sd(models.tokenizers[0], models.text_encoders[0], batch["captions"],
                                             None, None)
            for timestep in (200, 400, 600, 800):
                key = -1 - timestep
                eps = noise.draw_latent_samples(11, key, ids, shape)
                latents = (distribution.mean + distribution.std * eps) * models.vae.config.scaling_factor
                target = noise.draw_diffusion_noise(11, key, ids, shape, 1000).noise
                timesteps = torch.full((len(ids),), timestep)
                prediction = models.unet(scheduler.add_noise(latents, target, timesteps), timesteps, hidden).sample
                values.append(float(((prediction.float() - target) ** 2).mean()))
    assert len(values) == 8
    assert reported == pytest.approx(float(np.mean(values)), rel=1e-6)  # measured: equal to the bit


# -- training is untouched ------------------------------------------------------------------------
def test_validating_every_step_writes_the_same_lora_as_never_validating(tiny_models, six_images, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    # dropouts draw from the global torch RNG: a validation pass drawing from it would change the LoRA
    training = ("--max_train_steps", "6", "--network_dropout", "0.2",
                "--network_args", "rank_dropout=0.2", "module_dropout=0.2")
    split = ("--validation_split", "0.34")
    run_trainer("sdxl_train_network", trainer_args(tiny_models, six_images, tmp_path / "every", *split,
                                                   "--validate_every_n_steps", "1", *training))
    run_trainer("sdxl_train_network", trainer_args(tiny_models, six_images, tmp_path / "never", *split,
                                                   "--validate_every_n_epochs", "100", *training))
    every = safetensors_parts(tmp_path / "every" / "last.safetensors")
    never = safetensors_parts(tmp_path / "never" / "last.safetensors")
    assert every[2] == never[2] and every[0] == never[0]  # tensor bytes and layout
    schedule = {"ss_validate_every_n_steps", "ss_validate_every_n_epochs"}
    assert {k: v for k, v in every[1].items() if k not in schedule} == \
        {k: v for k, v in never[1].items() if k not in schedule}

    # the images left in training train exactly like a folder holding only them
    args = sdxl_args(*trainer_args(tiny_models, six_images, tmp_path / "x", *split))
    only_training = tmp_path / "only_training"
    (only_training / "1_thing").mkdir(parents=True)
    for path in planned_paths(datasets.build_dataset(args, 32)):
        for suffix in (".png", CAPTION_EXTENSION):
            shutil.copy(Path(path).with_suffix(suffix), only_training / "1_thing")
    run_trainer("sdxl_train_network", trainer_args(tiny_models, only_training, tmp_path / "alone", *training))
    assert safetensors_parts(tmp_path / "alone" / "last.safetensors")[2] == never[2]


def test_resume_with_validation_gives_identical_bytes_and_log(tiny_models, six_images, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")

    def argv(output_dir: Path, *extra: str) -> list[str]:
        return trainer_args(tiny_models, six_images, output_dir, "--output_name", "run", "--max_train_steps", "8",
                            "--validation_split", "0.34", "--validate_every_n_steps", "2", "--save_state",
                            "--save_every_n_steps", "3", "--log_jsonl", str(output_dir / "log.jsonl"), *extra)

    run_trainer("sdxl_train_network", argv(tmp_path / "whole"))
    resumed = tmp_path / "resumed"  # as if killed after the step-3 state (and its log lines)
    shutil.copytree(tmp_path / "whole" / "run-step00000003-state", resumed / "run-step00000003-state")
    shutil.copy(tmp_path / "whole" / "log.jsonl", resumed / "log.jsonl")
    run_trainer("sdxl_train_network", argv(resumed, "--resume", str(resumed / "run-step00000003-state")))
    assert (resumed / "run.safetensors").read_bytes() == (tmp_path / "whole" / "run.safetensors").read_bytes()
    assert (resumed / "log.jsonl").read_text() == (tmp_path / "whole" / "log.jsonl").read_text()
    assert len(rows_with(jsonl_rows(resumed / "log.jsonl"), "loss/validation/step_average")) == 4


def test_cached_latents_and_text_outputs_give_the_same_value(tiny_models, six_images, tmp_path):
    dataset = tmp_path / "data"
    shutil.copytree(six_images, dataset)  # the disk cache writes beside the images
    values = []
    for name, extra in (("plain", ()), ("cached", ("--cache_latents_to_disk", "--cache_text_encoder_outputs"))):
        log = tmp_path / f"{name}.jsonl"
        run_trainer("sdxl_train_network", trainer_args(
            tiny_models, dataset, tmp_path / name, "--max_train_steps", "2", "--validation_split", "0.34",
            "--validate_every_n_steps", "1", "--log_jsonl", str(log), *extra))
        values.append(rows_with(jsonl_rows(log), "loss/validation/step_average"))
    assert len(list((dataset / "1_thing").glob("*_sdxl.npz"))) == 6  # the 2 held-out images have their own
    assert list(values[0]) == list(values[1]) == [1, 2]
    for step in (1, 2):
        assert values[1][step] == pytest.approx(values[0][step], rel=1e-5)


def test_dataset_config_run_validates(tiny_models, six_images, tmp_path):
    config = tmp_path / "data.toml"
    config.write_text(f'[general]\ncaption_extension = "{CAPTION_EXTENSION}"\nvalidation_split = 0.34\n\n'
                      f'[[datasets]]\nresolution = 64\nvalidation_seed = 11\n\n'
                      f'[[datasets.subsets]]\nimage_dir = "{six_images / "1_thing"}"\n')
    log = tmp_path / "log.jsonl"
    run_trainer("sdxl_train_network", trainer_args(
        tiny_models, six_images, tmp_path / "out", "--dataset_config", str(config), "--max_train_steps", "4",
        "--log_jsonl", str(log)))
    assert list(rows_with(jsonl_rows(log), "loss/validation/epoch_average")) == [4]
    assert file_metadata(tmp_path / "out" / "last.safetensors")["ss_num_validation_images"] == "2"


# -- several processes ----------------------------------------------------------------------------
def test_two_processes_share_the_set_and_agree_with_one(tiny_models, six_images, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    def launch(processes: int, output_dir: Path, batch_size: str) -> tuple[str, dict[int, float]]:
        """Two processes by torch.distributed.run (each reports its weights' hash); one: the script as
        ``__main__`` in this process."""
        command = [sys.executable, str(REPO / "sdxl_train_network.py")]
        report = []
        if processes > 1:
            command[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                            "--master_port", str(29500 + (os.getpid() + 500) % 1000)]
            report = ["--debug_report_weights"]
        log = output_dir / "log.jsonl"
        # SGD: AdamW's first steps move each weight by about +-lr whatever the gradient's size, so the
        # rounding differences of another batch layout would not stay small
        argv = trainer_args(tiny_models, six_images, output_dir, "--train_batch_size", batch_size,
                            "--optimizer_type", "torch.optim.SGD", "--learning_rate", "0.5", "--max_train_steps", "2",
                            "--validation_split", "0.34", "--validate_every_n_steps", "1", *report,
                            "--log_jsonl", str(log))
        if processes == 1:
            result = run_script_as_main(command + argv, REPO)
        else:
            result = subprocess.run(command + argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        return result.stdout, rows_with(jsonl_rows(log), "loss/validation/step_average")

    # 2 held-out images: with batch 1 each rank scores one; in one process with batch 2 one batch holds both
    two_output, two = launch(2, tmp_path / "two", "1")
    _, one = launch(1, tmp_path / "one", "2")
    hashes = dict(re.findall(r"rank (\d) lora_sha256 ([0-9a-f]{64})", two_output))
    assert len(hashes) == 2 and hashes["0"] == hashes["1"]
    assert two_output.count("validation loss after step 1:") == 1  # printed by the main process only
    assert list(two) == list(one) == [1, 2]
    for step in (1, 2):  # measured: 1.3e-6 and 4e-8 apart (fp32 rounding of batch 1 vs 2 in the UNet)
        assert two[step] == pytest.approx(one[step], rel=1e-5)
