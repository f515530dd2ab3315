"""Sample images during training: kohya's prompt formats, schedule and names; sampling never
changes what is trained."""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import model_args, run_trainer
from PIL import Image

from library import sampling
from library.errors import UserError
from networks.lora import read_lora_file


def test_txt_prompt_line_options(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("# a comment\n\nmasterpiece, a cat --n low quality, blurry --w 100 --h 64 --d 42 --s 3 --l 5.5\n"
                    "a dog --ss euler_a --g 3\n", encoding="utf-8")
    first, second = sampling.load_prompts(path)
    assert first == sampling.SamplePrompt(index=0, prompt="masterpiece, a cat", negative_prompt="low quality, blurry",
                                          width=96, height=64, seed=42, sample_steps=3, scale=5.5)
    assert second.prompt == "a dog" and second.sampler == "euler_a" and second.index == 1
    assert (second.width, second.height, second.sample_steps, second.scale, second.seed) == (512, 512, 30, 7.5, None)


def test_toml_and_json_prompt_files(tmp_path):
    toml_path = tmp_path / "prompts.toml"
    toml_path.write_text('[prompt]\nnegative_prompt = "bad"\nwidth = 64\nheight = 64\nsample_steps = 2\n'
                         '[[prompt.subset]]\nprompt = "a cat"\nseed = 1\n'
                         '[[prompt.subset]]\nprompt = "a dog"\nwidth = 128\nsample_sampler = "k_euler"\n')
    cat, dog = sampling.load_prompts(toml_path)
    assert (cat.prompt, cat.negative_prompt, cat.width, cat.seed, cat.sample_steps) == ("a cat", "bad", 64, 1, 2)
    assert (dog.width, dog.sampler, dog.index) == (128, "k_euler", 1)
    json_path = tmp_path / "prompts.json"
    json_path.write_text(json.dumps([{"prompt": "a cat", "width": 64, "seed": 3}, "a dog --d 5"]))
    cat, dog = sampling.load_prompts(json_path)
    assert (cat.width, cat.seed, dog.prompt, dog.seed) == (64, 3, "a dog", 5)


@pytest.mark.parametrize("content,suffix,match", [
    ("a cat --w wide", ".txt", "--w"), ("a cat --ss magic", ".txt", "sampler"),
    ("{", ".json", "JSON"), ("[prompt]\n", ".toml", "subset"), ("a cat", ".yaml", ".txt, .toml or .json"),
])
def test_bad_prompt_files(tmp_path, content, suffix, match):
    path = tmp_path / f"p{suffix}"
    path.write_text(content)
    with pytest.raises(UserError, match=match):
        sampling.load_prompts(path)


@pytest.mark.parametrize("suffix", [".txt", ".toml", ".json"])
def test_empty_or_missing_prompt_files_have_no_prompts(tmp_path, suffix):
    path = tmp_path / f"p{suffix}"
    assert sampling.load_prompts(path) == []
    path.write_text("\n  \n")  # the kohya_ss GUI writes "" when its Samples box is empty
    assert sampling.load_prompts(path) == []


@pytest.mark.parametrize("content,schedule,kept,notice", [
    (None, {}, False, None), ("", {}, False, None), ("a cat --d x", {}, False, "no sample point scheduled"),
    (None, {"sample_at_first": True}, False, "empty or missing"),
    ("# only a comment\n", {"sample_every_n_epochs": 1}, False, "empty or missing"),
    ("a cat", {"sample_every_n_steps": 1}, True, None),
])
def test_unused_prompt_file_is_dropped_with_at_most_one_line(tmp_path, content, schedule, kept, notice):
    path = tmp_path / "prompt.txt"
    if content is not None:
        path.write_text(content)
    args = argparse.Namespace(**{"sample_prompts": str(path), "sample_at_first": False, "sample_every_n_steps": None,
                                 "sample_every_n_epochs": None, "sample_sampler": "ddim", **schedule})
    sampling.validate_arguments(args)  # unscheduled, the malformed "--d x" is not read
    lines = []
    sampling.drop_unused_prompt_file(args, announce=lines.append)
    assert (args.sample_prompts == str(path)) == kept == sampling.is_scheduled(args)
    assert len(lines) == (notice is not None) and all(notice in line for line in lines)


@pytest.mark.parametrize("sampler", sampling.SAMPLERS)
def test_every_sampler_name_maps_to_a_scheduler(sampler, tiny_models):
    config = json.loads((Path(tiny_models["sdxl_config"]) / "scheduler" / "scheduler_config.json").read_text())
    if sampler.endswith("lms") and importlib.util.find_spec("scipy") is None:
        with pytest.raises(UserError, match="pip install scipy"):
            sampling.make_scheduler(sampler, config)
        return
    scheduler = sampling.make_scheduler(sampler, config, v_parameterization=True)
    assert scheduler.config.prediction_type == "v_prediction"
    assert scheduler.config.num_train_timesteps == config["num_train_timesteps"]
    if sampler.startswith("dpmsolver"):
        assert scheduler.config.algorithm_type == sampler


def test_schedule_follows_kohya():
    args = argparse.Namespace(sample_prompts="p.txt", sample_at_first=False, sample_every_n_steps=2,
                              sample_every_n_epochs=None)
    assert [s for s in range(1, 7) if sampling.is_sample_point(args, "step", s)] == [2, 4, 6]
    assert not sampling.is_sample_point(args, "first", 0) and not sampling.is_sample_point(args, "epoch", 4, 2)
    args.sample_every_n_epochs = 2  # replaces the step schedule
    assert not sampling.is_sample_point(args, "step", 2)
    assert [e for e in range(1, 5) if sampling.is_sample_point(args, "epoch", 0, e)] == [2, 4]
    args.sample_prompts = None
    assert not sampling.is_sample_point(args, "epoch", 0, 2)


@pytest.mark.parametrize("zero", [0, -1])
def test_every_n_zero_is_off_with_kohyas_line(tmp_path, zero):
    path = tmp_path / "prompt.txt"
    path.write_text("a cat")
    args = argparse.Namespace(sample_prompts=str(path), sample_at_first=False, sample_every_n_steps=2,
                              sample_every_n_epochs=zero, sample_sampler="ddim")
    sampling.validate_arguments(args)
    lines = []
    sampling.drop_unused_prompt_file(args, announce=lines.append)
    assert lines == [f"--sample_every_n_epochs {zero}: 0 or less, so sampling by it is off (as in kohya)"]
    # kohya sets it to None: the step schedule applies again
    assert [s for s in range(1, 5) if sampling.is_sample_point(args, "step", s)] == [2, 4]
    assert not any(sampling.is_sample_point(args, "epoch", 0, e) for e in range(1, 5))
    args.sample_every_n_steps = zero
    assert not sampling.is_scheduled(args) and not sampling.is_sample_point(args, "step", 2)


@pytest.fixture(scope="module", params=["sdxl", "sd15"])
def in_memory_models(request):
    from tools.build_tiny_models import tiny_sd, tiny_sdxl

    return tiny_sdxl() if request.param == "sdxl" else tiny_sd("sd1")


def test_sample_prompts_keep_a1111_weights(in_memory_models):
    plain = sampling.prompt_embeddings(in_memory_models, sampling.SamplePrompt(0, "a red cat"))
    weighted = sampling.prompt_embeddings(in_memory_models, sampling.SamplePrompt(0, "a (red:1.5) cat"))
    # <BOS>, "a", then "red" (3 byte tokens here): the hidden states of those tokens are 1.5 times larger
    torch.testing.assert_close(weighted["prompt_embeds"][0, 2:5], plain["prompt_embeds"][0, 2:5] * 1.5)
    torch.testing.assert_close(weighted["prompt_embeds"][0, :2], plain["prompt_embeds"][0, :2])
    torch.testing.assert_close(weighted["prompt_embeds"][0, 5:], plain["prompt_embeds"][0, 5:])
    torch.testing.assert_close(weighted["negative_prompt_embeds"], plain["negative_prompt_embeds"])
    if in_memory_models.is_sdxl:  # the pooled output is not weighted (kohya)
        torch.testing.assert_close(weighted["pooled_prompt_embeds"], plain["pooled_prompt_embeds"])


def test_long_sample_prompts_are_not_cut_at_77_tokens(in_memory_models, capsys):
    head = "a photo of a cat " * 7  # 91 tokens with the tiny byte-level tokenizer (a letter each): two chunks
    embeddings = [sampling.prompt_embeddings(in_memory_models, sampling.SamplePrompt(0, head + tail, "blurry"))
                  for tail in ("sitting", "running")]
    assert embeddings[0]["prompt_embeds"].shape[1] == 152  # <BOS> + 150 + <EOS>, as training's 150 tokens
    assert embeddings[0]["negative_prompt_embeds"].shape == embeddings[0]["prompt_embeds"].shape
    assert not torch.equal(embeddings[0]["prompt_embeds"], embeddings[1]["prompt_embeds"])  # the tail counts
    sampling.prompt_embeddings(in_memory_models, sampling.SamplePrompt(3, "x" * 300))
    assert "sample prompt 3: 300 tokens, the first 225 are used" in capsys.readouterr().out


def test_a_prompt_file_broken_during_the_run_skips_that_point(tmp_path, capsys):
    from accelerate import PartialState

    path = tmp_path / "prompt.txt"
    args = argparse.Namespace(sample_prompts=str(path), sample_at_first=False, sample_every_n_steps=2,
                              sample_every_n_epochs=None, sample_sampler="ddim", output_dir=str(tmp_path))
    for content, said in [("a cat --s many\n", "--s 'many' is not an integer"), ("", "no prompts now")]:
        path.write_text(content)  # an edit after the start-up check: the run goes on without images
        written = sampling.sample_images(args, PartialState(), None, None, torch.device("cpu"), when="step", step=2)
        out = capsys.readouterr().out
        assert written == [] and said in out and "no sample images at step 2" in out
    assert not (tmp_path / "sample").exists()


def train_args(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "run", "--seed", "3", "--max_data_loader_n_workers", "0",
        "--network_dim", "4", "--learning_rate", "1e-2", "--max_train_steps", "4",
        # dropout draws from the global torch RNG at every step: sampling that consumed or reseeded it
        # would change the trained weights
        "--network_dropout", "0.2", "--network_args", "rank_dropout=0.2", *extra,
    ]


@pytest.mark.device
def test_sampling_during_training_changes_nothing(tiny_models, demo_dataset, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2 --d 7 --l 3\na blue square --n green --w 64 --h 64 --s 1\n")
    plain, sampled = tmp_path / "plain", tmp_path / "sampled"
    # both runs with checkpointing: sampling is the only difference between them
    run_trainer("sdxl_train_network", train_args(tiny_models, demo_dataset, plain, "--gradient_checkpointing"))
    run_trainer("sdxl_train_network", train_args(
        tiny_models, demo_dataset, sampled, "--sample_prompts", str(prompts), "--sample_every_n_steps", "2",
        "--sample_at_first", "--sample_sampler", "euler_a", "--gradient_checkpointing"))

    without, with_sampling = read_lora_file(str(plain / "run.safetensors")), read_lora_file(str(sampled / "run.safetensors"))
    assert without.keys() == with_sampling.keys()
    for key in without:
        assert torch.equal(without[key], with_sampling[key]), key

    names = sorted(path.name for path in (sampled / "sample").iterdir())
    pattern = re.compile(r"run_(\d{6})_(\d{2})_\d{14}(_7)?\.png")
    found = sorted((match.group(1), match.group(2)) for match in map(pattern.fullmatch, names) if match)
    assert len(found) == len(names) == 6
    assert found == [(step, index) for step in ("000000", "000002", "000004") for index in ("00", "01")]
    assert all(name.endswith("_7.png") == ("_00_" in name) for name in names)  # the seed suffix
    with Image.open(sampled / "sample" / names[0]) as image:
        assert image.size == (64, 64)
    assert not (plain / "sample").exists()


def test_epoch_sampling_names_and_bad_prompt_file(tiny_models, demo_dataset, tmp_path):
    prompts = tmp_path / "prompts.toml"
    prompts.write_text('[prompt]\nwidth = 64\nheight = 64\nsample_steps = 1\n[[prompt.subset]]\nprompt = "a cat"\n')
    output_dir = tmp_path / "epochs"
    # 4 images, batch 1: 4 steps per epoch
    run_trainer("sdxl_train_network", train_args(tiny_models, demo_dataset, output_dir, "--sample_prompts",
                                                 str(prompts), "--sample_every_n_epochs", "1",
                                                 "--max_train_steps", "8", "--sample_sampler", "k_dpm_2",
                                                 "--mixed_precision", "fp16", "--cache_latents"))
    names = sorted(path.name for path in (output_dir / "sample").iterdir())
    assert [name[:14] for name in names] == ["run_e000001_00", "run_e000002_00"]

    bad = tmp_path / "bad.txt"
    bad.write_text("a cat --s many\n")
    with pytest.raises(UserError, match="--sample_prompts"):
        run_trainer("sdxl_train_network", train_args(tiny_models, demo_dataset, tmp_path / "bad",
                                                     "--sample_prompts", str(bad), "--sample_at_first"))


def test_sample_images_reach_the_trackers(tiny_models, demo_dataset, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 1 --d 1\na blue square --w 64 --h 64 --s 1 --d 2\n")
    logging_dir = tmp_path / "logs"
    run_trainer("sdxl_train_network", train_args(
        tiny_models, demo_dataset, tmp_path / "out", "--sample_prompts", str(prompts), "--sample_every_n_steps", "2",
        "--max_train_steps", "2", "--logging_dir", str(logging_dir)))
    images = {}
    for event_file in logging_dir.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(event_file), size_guidance={"images": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["images"]:
            images[tag] = [(event.step, event.width, event.height) for event in accumulator.Images(tag)]
    assert images == {"sample_0": [(2, 64, 64)], "sample_1": [(2, 64, 64)]}
