"""kohya-ss options that GUIs and presets pass: accepted, honoured, or refused in one line."""
from __future__ import annotations

import argparse
import csv
import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from conftest import model_args, run_script_as_main, run_trainer, train_expecting_user_error

from library import compatibility, config_file
from networks import lora

REPO_ROOT = Path(__file__).resolve().parent.parent


def args_for(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--seed", "3", "--max_data_loader_n_workers", "0",
        "--network_train_unet_only", "--network_dim", "4", *extra,
    ]


def grad_log_rows(output_dir: Path) -> list[dict[str, str]]:
    with open(output_dir / "gradient_logs+last.txt", newline="") as file:
        return list(csv.DictReader(file))


def file_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as file:
        return file.metadata()


def jsonl_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_gui_command_line_with_inert_kohya_options_trains(tiny_models, demo_dataset, tmp_path, capsys):
    output_dir = tmp_path / "out"
    run_trainer("sdxl_train_network", args_for(
        tiny_models, demo_dataset, output_dir, "--max_train_steps", "2",
        "--xformers", "--sdpa", "--mem_eff_attn", "--disable_mmap_load_safetensors", "--skip_cache_check",
        "--ddp_timeout", "5", "--ddp_gradient_as_bucket_view", "--ddp_static_graph", "--fused_backward_pass",
        "--use_safetensors", "--zero_stage", "2", "--dynamo_backend", "inductor", "--token_warmup_min", "1",
        "--token_warmup_step", "0", "--huggingface_repo_type", "model",
    ))
    assert (output_dir / "last.safetensors").is_file()
    # no CUDA here: --xformers falls back to SDPA and says so in one line
    assert "--xformers: xformers needs a CUDA device; using torch's scaled_dot_product_attention" in \
        capsys.readouterr().out


def test_select_attention_keeps_sdpa_without_cuda(tiny_models):
    from diffusers.models.attention_processor import AttnProcessor2_0

    from library.model_loading import load_models

    models = load_models(str(tiny_models["sdxl_file"]), sdxl=True, model_config_dir=str(tiny_models["sdxl_config"]),
                         tokenizer_cache_dir=str(tiny_models["tokenizers"]))
    messages: list[str] = []
    for flags in ([], ["--sdpa"], ["--mem_eff_attn"], ["--xformers"]):
        parser = config_file.argparse.ArgumentParser()
        compatibility.add_arguments(parser)
        chosen = compatibility.select_attention(parser.parse_args(flags), models.unet, "cpu", messages.append)
        assert chosen == "sdpa"
        assert {type(p) for p in models.unet.attn_processors.values()} == {AttnProcessor2_0}
    assert len(messages) == 1 and messages[0].startswith("--xformers")


def test_misspelled_caption_extention_sets_caption_extension():
    parser = config_file.argparse.ArgumentParser()
    parser.add_argument("--caption_extension", default=".caption")
    compatibility.add_arguments(parser)
    args = parser.parse_args(["--caption_extention", ".txt"])
    compatibility.apply_aliases(args)
    assert args.caption_extension == ".txt" and args.caption_extention is None
    args = parser.parse_args([])
    compatibility.apply_aliases(args)
    assert args.caption_extension == ".caption"


@pytest.mark.parametrize("dest", sorted(compatibility.UNSUPPORTED))
def test_unsupported_option_is_refused_by_name(dest, tiny_models, demo_dataset, tmp_path, capsys):
    parser = config_file.argparse.ArgumentParser()
    compatibility.add_arguments(parser)
    action = next(action for action in parser._actions if action.dest == dest)
    value = [] if action.nargs == 0 else ["0.5" if action.type is float else "x"]
    output_dir = tmp_path / "out"
    error = train_expecting_user_error(
        args_for(tiny_models, demo_dataset, output_dir, "--max_train_steps", "1", f"--{dest}", *value), capsys)
    assert error.startswith(f"error: --{dest}") and compatibility.UNSUPPORTED[dest] in error
    assert not output_dir.exists()  # refused before anything was written


@pytest.mark.parametrize("suffix", ["ckpt", "pt"])
def test_save_model_as_ckpt_and_pt_write_kohyas_torch_files(suffix, tiny_models, demo_dataset, tmp_path):
    """kohya writes torch.save(state_dict) without metadata for these, and reads them back with torch.load."""
    output_dir = tmp_path / "out"
    run_trainer("sdxl_train_network", args_for(
        tiny_models, demo_dataset, output_dir, "--max_train_steps", "3", "--save_model_as", suffix,
        "--save_every_n_steps", "1", "--save_last_n_steps", "1"))
    # kohya's rotation (saving step 3 removes step 1) with these names
    assert sorted(path.name for path in output_dir.glob("last*")) == [
        f"last-step00000002.{suffix}", f"last-step00000003.{suffix}", f"last.{suffix}"]
    weights = torch.load(output_dir / f"last.{suffix}", weights_only=True)
    assert isinstance(weights, dict) and all(key.startswith("lora_unet_") for key in weights)
    assert weights.keys() == lora.read_lora_file(str(output_dir / f"last.{suffix}")).keys()
    # continues from it like from a safetensors file
    run_trainer("sdxl_train_network", args_for(
        tiny_models, demo_dataset, tmp_path / "again", "--max_train_steps", "1",
        "--network_weights", str(output_dir / f"last.{suffix}")))
    assert (tmp_path / "again" / "last.safetensors").is_file()


def test_gui_toml_with_default_values_of_unsupported_options_is_accepted(tmp_path):
    import train_network

    config = tmp_path / "gui.toml"
    config.write_text('deepspeed = false\nfp8_base = false\nhuggingface_repo_id = ""\ntoken_warmup_step = 0\n'
                      'torch_compile = false\nxformers = true\ncaption_extention = ".txt"\n')
    args, _ = config_file.parse_args(train_network.setup_parser(), ["--config_file", str(config)])
    lines = []
    compatibility.check_arguments(args, sdxl=True, announce=lines.append)  # nothing asked for is unsupported
    assert args.xformers is True and lines == []


def test_clip_skip_on_sdxl_is_ignored_with_kohyas_warning():
    import train_network

    for argv, sdxl, expected in ((["--clip_skip", "2"], True, ["--clip_skip 2: SDXL uses fixed text encoder layers, "
                                                               "it has no effect (kohya ignores it too, with a "
                                                               "warning)"]),
                                 (["--clip_skip", "1"], True, []),  # the GUI's default: no skip, nothing to say
                                 (["--clip_skip", "2"], False, [])):
        args = train_network.setup_parser().parse_args(argv)
        lines = []
        compatibility.check_arguments(args, sdxl=sdxl, announce=lines.append)
        assert lines == expected


def test_cpu_offload_checkpointing_trains_the_same(tiny_models, demo_dataset, tmp_path, capsys):
    """The offload hooks are real on CPU too (every tensor saved for backward goes through them), and change
    no bit of the result; on CUDA the same hooks keep those tensors in pinned host memory."""
    files = {}
    for name, extra in (("plain", []), ("offload", ["--cpu_offload_checkpointing"])):
        run_trainer("sdxl_train_network", args_for(tiny_models, demo_dataset, tmp_path / name, "--max_train_steps", "2",
                                                   "--gradient_checkpointing", "--learning_rate", "1e-2", *extra))
        files[name] = lora.read_lora_file(str(tmp_path / name / "last.safetensors"))
    assert all(torch.equal(files["plain"][key], files["offload"][key]) for key in files["plain"])
    assert "--cpu_offload_checkpointing: training on the CPU" in capsys.readouterr().out
    import train_network

    args = train_network.setup_parser().parse_args(["--cpu_offload_checkpointing", "--gradient_checkpointing"])
    assert isinstance(compatibility.offloaded_activations(args, torch.device("cuda")),
                      torch.autograd.graph.save_on_cpu)
    args.gradient_checkpointing = False  # kohya ignores it without checkpointing
    assert not isinstance(compatibility.offloaded_activations(args, torch.device("cuda")),
                          torch.autograd.graph.save_on_cpu)


def test_save_n_epoch_ratio_sets_the_epoch_interval(tiny_models, demo_dataset, tmp_path):
    output_dir = tmp_path / "out"
    run_trainer("sdxl_train_network", args_for(
        tiny_models, demo_dataset, output_dir, "--max_train_epochs", "4", "--save_n_epoch_ratio", "2"))
    files = sorted(path.name for path in output_dir.glob("*.safetensors"))
    assert files == ["last-000002.safetensors", "last.safetensors"]  # 4 epochs // 2 -> every 2 epochs


@pytest.mark.parametrize("skip_until, expected_epochs", [(True, ["2", "2", "2", "3"]), (False, ["2", "2", "2", "2"])])
def test_initial_step_starts_the_count_and_epoch(skip_until, expected_epochs, tiny_models, demo_dataset, tmp_path):
    # 4 images, batch 1: 4 steps per epoch. Starting at step 5 is epoch 2 with one batch done.
    output_dir = tmp_path / "out"
    extra = ["--skip_until_initial_step"] if skip_until else []
    run_trainer("sdxl_train_network", args_for(
        tiny_models, demo_dataset, output_dir, "--max_train_steps", "9", "--initial_step", "5", "--grad_norm_log",
        "--save_every_n_steps", "2", *extra))
    rows = grad_log_rows(output_dir)
    assert [row["Step"] for row in rows] == ["6", "7", "8", "9"]
    # with the skip, epoch 2 has 3 batches left; without, it is trained from its first batch
    assert [row["Epoch"] for row in rows] == expected_epochs
    assert sorted(path.name for path in output_dir.glob("*.safetensors")) == [
        "last-step00000006.safetensors", "last-step00000008.safetensors", "last.safetensors"]
    assert file_metadata((output_dir / "last.safetensors"))["ss_steps"] == "9"


def test_initial_epoch_and_refusals(tiny_models, demo_dataset, tmp_path, capsys):
    output_dir = tmp_path / "out"
    run_trainer("sdxl_train_network", args_for(
        tiny_models, demo_dataset, output_dir, "--max_train_steps", "6", "--initial_epoch", "2", "--grad_norm_log"))
    rows = grad_log_rows(output_dir)
    assert [(row["Epoch"], row["Step"]) for row in rows] == [("2", "5"), ("2", "6")]
    error = train_expecting_user_error(args_for(
        tiny_models, demo_dataset, tmp_path / "a", "--max_train_steps", "4", "--initial_step", "4"), capsys)
    assert "--max_train_steps 4" in error
    # a resumed run continues at its state's step: the same command with --resume auto works
    resumable = args_for(tiny_models, demo_dataset, tmp_path / "b", "--initial_step", "2", "--max_train_steps", "3",
                         "--save_state_on_train_end")
    run_trainer("sdxl_train_network", resumable)
    capsys.readouterr()
    resumable[resumable.index("--max_train_steps") + 1] = "4"
    run_trainer("sdxl_train_network", resumable + ["--resume", "auto"])
    assert "--initial_step/--initial_epoch: ignored" in capsys.readouterr().out
    assert file_metadata(tmp_path / "b" / "last.safetensors")["ss_steps"] == "4"


def test_base_weights_train_on_the_merged_model(tiny_models, demo_dataset, tmp_path, capsys):
    first = tmp_path / "first"
    run_trainer("sdxl_train_network", args_for(
        tiny_models, demo_dataset, first, "--max_train_steps", "3", "--learning_rate", "5e-2"))
    base_lora = first / "last.safetensors"
    merged = tmp_path / "merged.safetensors"
    run_script_as_main([sys.executable, str(REPO_ROOT / "networks" / "merge_lora.py"),
                        "--sd_model", str(tiny_models["sdxl_file"]),
                        "--model_config_dir", str(tiny_models["sdxl_config"]),
                        "--save_to", str(merged), "--models", str(base_lora), "--ratios", "0.5"], REPO_ROOT)

    def first_loss(name: str, model_file: Path, *extra: str) -> float:
        argv = args_for(tiny_models, demo_dataset, tmp_path / name, "--max_train_steps", "1",
                        "--log_jsonl", str(tmp_path / f"{name}.jsonl"), *extra)
        argv[argv.index("--pretrained_model_name_or_path") + 1] = str(model_file)
        run_trainer("sdxl_train_network", argv)
        return jsonl_rows(tmp_path / f"{name}.jsonl")[0]["loss/current"]

    # The new LoRA starts as a no-op (lora_up = 0), so the first loss is the merged model's.
    with_base_weights = first_loss("with", tiny_models["sdxl_file"], "--base_weights", str(base_lora),
                                   "--base_weights_multiplier", "0.5")
    from_merged_file = first_loss("merged", merged)
    plain = first_loss("plain", tiny_models["sdxl_file"])
    assert with_base_weights == pytest.approx(from_merged_file, rel=1e-5, abs=1e-6)
    assert abs(with_base_weights - plain) > 1e-4
    error = train_expecting_user_error(args_for(
        tiny_models, demo_dataset, tmp_path / "c", "--base_weights", str(base_lora), "--base_weights_multiplier",
        "0.5", "0.5"), capsys)
    assert "--base_weights_multiplier" in error


@pytest.mark.parametrize("flag, precision, dtype, optimizer_args", [
    ("--full_fp16", "fp16", torch.float16, ["--optimizer_args", "eps=1e-4"]),  # AdamW's 1e-8 is 0 in fp16
    ("--full_bf16", "bf16", torch.bfloat16, []),
])
def test_full_half_precision_trains_the_lora_in_that_dtype(flag, precision, dtype, optimizer_args, tiny_models,
                                                           demo_dataset, tmp_path, capsys):
    output_dir = tmp_path / "out"
    run_trainer("sdxl_train_network", args_for(
        tiny_models, demo_dataset, output_dir, "--max_train_steps", "3", "--mixed_precision", precision, flag,
        "--learning_rate", "1e-2", "--grad_guard_preset", "stable", "--save_state_on_train_end", *optimizer_args))
    assert len(grad_log_rows(output_dir)) == 3  # the guard and its cosine log read half-precision gradients
    weights = lora.read_lora_file(str(output_dir / "last.safetensors"))
    assert {value.dtype for value in weights.values()} == {dtype}  # saved in the training dtype
    assert all(torch.isfinite(value.float()).all() for value in weights.values())
    ups = [value for key, value in weights.items() if key.endswith("lora_up.weight")]
    assert any(value.abs().max() > 0 for value in ups)  # it did train
    assert file_metadata((output_dir / "last.safetensors"))["ss_full_fp16"] == str(flag == "--full_fp16")
    other = "bf16" if precision == "fp16" else "fp16"
    error = train_expecting_user_error(args_for(
        tiny_models, demo_dataset, tmp_path / "x", "--mixed_precision", other, flag), capsys)
    assert error == f"error: {flag} needs --mixed_precision {precision} (got {other})"


def test_full_fp16_refuses_an_eps_that_is_zero_in_fp16(tiny_models, demo_dataset, tmp_path, capsys):
    output_dir = tmp_path / "out"
    error = train_expecting_user_error(args_for(
        tiny_models, demo_dataset, output_dir, "--max_train_steps", "1", "--mixed_precision", "fp16", "--full_fp16"),
        capsys)
    assert error.startswith("error: --optimizer_type AdamW computes in float16 (--full_fp16), where its eps 1e-08 is 0")
    assert not list(output_dir.glob("*.safetensors"))


def test_scale_weight_norms_caps_every_module(tiny_models, demo_dataset, tmp_path):
    output_dir = tmp_path / "out"
    max_norm = 0.02
    run_trainer("sdxl_train_network", args_for(
        tiny_models, demo_dataset, output_dir, "--max_train_steps", "4", "--learning_rate", "5e-2",
        "--scale_weight_norms", str(max_norm), "--log_jsonl", str(tmp_path / "steps.jsonl")))
    weights = lora.read_lora_file(str(output_dir / "last.safetensors"))
    norms = [float(torch.linalg.matrix_norm(lora.lora_delta(parts).reshape(parts["up"].shape[0], -1)))
             for parts in lora.lora_modules(weights).values()]
    assert max(norms) <= max_norm * (1 + 1e-4)
    rows = jsonl_rows(tmp_path / "steps.jsonl")
    assert rows[-1]["max_norm/keys_scaled"] > 0  # at this learning rate the cap binds
    assert rows[-1]["max_norm/max_key_norm"] <= max_norm * (1 + 1e-4)
    assert file_metadata((output_dir / "last.safetensors"))["ss_scale_weight_norms"] == str(max_norm)


def test_log_config_and_tracker_config(tiny_models, demo_dataset, tmp_path):
    tracker_config = tmp_path / "trackers.toml"
    tracker_config.write_text('[tensorboard]\nfilename_suffix = ".tiny"\n')
    logging_dir = tmp_path / "logs"
    run_trainer("sdxl_train_network", args_for(
        tiny_models, demo_dataset, tmp_path / "out", "--max_train_steps", "1", "--logging_dir", str(logging_dir),
        "--log_config", "--log_tracker_config", str(tracker_config), "--wandb_api_key", "secret-key"))
    # the init option reached the tracker's writer (the hparams writer in a subfolder is torch's own)
    assert [path.name.endswith(".tiny") for path in logging_dir.glob("*/network_train/events.out.tfevents.*")] == [True]
    hparams = "\n".join(path.read_text() for path in logging_dir.rglob("hparams.yml"))
    assert "network_dim: 4" in hparams  # --log_config sent the options
    assert "secret-key" not in hparams and str(tmp_path) not in hparams  # but no secrets or paths


def test_token_warmup_trains_with_workers(tiny_models, demo_dataset, tmp_path):
    output_dir = tmp_path / "out"
    argv = args_for(tiny_models, demo_dataset, output_dir, "--max_train_steps", "3", "--token_warmup_step", "0.5",
                    "--token_warmup_min", "1", "--gradient_accumulation_steps", "2")
    argv[argv.index("--max_data_loader_n_workers") + 1] = "1"  # the step reaches a worker process
    run_trainer("sdxl_train_network", argv)
    assert file_metadata(output_dir / "last.safetensors")["ss_steps"] == "3"


def test_loraplus_multiplies_the_lora_up_learning_rate(tiny_models, demo_dataset, tmp_path):
    # One plain SGD step without clipping: the update is lr * gradient, so LoRA+'s lora_up
    # update is exactly ratio times the plain one (lora_down gets no gradient at step 1).
    def first_step(name: str, *network_args: str) -> dict[str, torch.Tensor]:
        output_dir = tmp_path / name
        run_trainer("sdxl_train_network", args_for(
            tiny_models, demo_dataset, output_dir, "--max_train_steps", "1", "--optimizer_type", "torch.optim.SGD",
            "--learning_rate", "1e-2", "--max_grad_norm", "0", "--save_precision", "float",
            *(["--network_args", *network_args] if network_args else [])))
        return lora.read_lora_file(str(output_dir / "last.safetensors"))

    plain = first_step("plain")
    plus = first_step("plus", "loraplus_lr_ratio=16")
    ups = [key for key in plain if key.endswith("lora_up.weight")]
    assert any(plain[key].abs().max() > 0 for key in ups)
    for key in ups:
        torch.testing.assert_close(plus[key], 16 * plain[key], rtol=1e-5, atol=1e-9)
    for key in plain:
        if not key.endswith("lora_up.weight"):
            assert torch.equal(plus[key], plain[key]), key
    specific = first_step("specific", "loraplus_lr_ratio=2", "loraplus_unet_lr_ratio=4")  # the UNet ratio wins
    for key in ups:
        torch.testing.assert_close(specific[key], 4 * plain[key], rtol=1e-5, atol=1e-9)


def test_a_zero_learning_rate_leaves_that_part_untrained(tiny_models, demo_dataset, tmp_path, capsys):
    output_dir = tmp_path / "out"
    # kohya's --learning_rate 0: only the parts given their own rate train (here the UNet)
    argv = args_for(tiny_models, demo_dataset, output_dir, "--max_train_steps", "2", "--unet_lr", "1e-2",
                    "--learning_rate", "0")
    argv.remove("--network_train_unet_only")
    run_trainer("sdxl_train_network", argv)
    weights = lora.read_lora_file(str(output_dir / "last.safetensors"))
    te_ups = [value for key, value in weights.items() if key.startswith("lora_te") and key.endswith("lora_up.weight")]
    unet_ups = [value for key, value in weights.items() if key.startswith("lora_unet") and key.endswith("up.weight")]
    assert te_ups and all(value.abs().max() == 0 for value in te_ups)  # still at its zero initialisation
    assert any(value.abs().max() > 0 for value in unet_ups)
    # the optimizer's groups depend on the untrained parts: a resume must keep them
    run_trainer("sdxl_train_network", argv + ["--save_state_on_train_end"])
    error = train_expecting_user_error(argv + ["--resume", "auto", "--text_encoder_lr", "1e-4"], capsys)
    assert "untrained_parts=['text_encoders']" in error
    for zero in (["--unet_lr", "0"], ["--learning_rate", "0"]):
        error = train_expecting_user_error(args_for(
            tiny_models, demo_dataset, tmp_path / "none", "--max_train_steps", "1", *zero), capsys)
        assert "nothing would train" in error
    error = train_expecting_user_error(args_for(
        tiny_models, demo_dataset, tmp_path / "blocks", "--network_args", "down_lr_weight=sinus"), capsys)
    assert "--network_args down_lr_weight=sinus: give comma-separated numbers or one of cosine" in error
    error = train_expecting_user_error(args_for(
        tiny_models, demo_dataset, tmp_path / "ratio", "--network_args", "loraplus_unet_lr_ratio=0"), capsys)
    assert error == "error: --network_args loraplus_unet_lr_ratio=0 must be a positive number"


def test_metadata_names_and_hashes_the_base_model(tiny_models, demo_dataset, tmp_path):
    import hashlib

    output_dir = tmp_path / "out"
    thumbnail = tmp_path / "thumb.png"
    thumbnail.write_bytes(b"\x89PNG fake bytes")
    run_trainer("sdxl_train_network", args_for(
        tiny_models, demo_dataset, output_dir, "--max_train_steps", "1", "--metadata_title", "My LoRA",
        "--metadata_author", "me", "--metadata_tags", "a,b", "--metadata_thumbnail", str(thumbnail),
        "--console_log_file", str(tmp_path / "console.log"), "--console_log_level", "DEBUG"))
    metadata = file_metadata(output_dir / "last.safetensors")
    assert (metadata["modelspec.title"], metadata["modelspec.author"], metadata["modelspec.tags"]) == ("My LoRA", "me",
                                                                                                        "a,b")
    assert metadata["modelspec.thumbnail"] == "data:image/png;base64,iVBORyBmYWtlIGJ5dGVz"
    assert (tmp_path / "console.log").stat().st_size > 0  # the library's log messages went to the file
    model = Path(tiny_models["sdxl_file"])
    data = model.read_bytes()
    assert metadata["ss_sd_model_name"] == model.name
    assert metadata["ss_new_sd_model_hash"] == hashlib.sha256(data).hexdigest()
    assert metadata["ss_sd_model_hash"] == hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8]
    assert "ss_vae_name" not in metadata  # no --vae


def test_base_weights_invalidate_a_text_encoder_cache_on_disk(tiny_models, demo_dataset, tmp_path, capsys):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(demo_dataset, data)  # the cache files go beside the images
    lora_with_text_encoder = args_for(tiny_models, data, tmp_path / "first", "--max_train_steps", "2",
                                      "--learning_rate", "5e-2")
    lora_with_text_encoder.remove("--network_train_unet_only")
    run_trainer("sdxl_train_network", lora_with_text_encoder)
    cached = args_for(tiny_models, data, tmp_path / "cached", "--max_train_steps", "1",
                      "--cache_text_encoder_outputs_to_disk")
    run_trainer("sdxl_train_network", cached)
    run_trainer("sdxl_train_network", cached)
    assert "cached text encoder outputs: 0 captions encoded, 4 read from disk" in capsys.readouterr().out
    run_trainer("sdxl_train_network", cached + ["--base_weights", str(tmp_path / "first" / "last.safetensors")])
    assert "cached text encoder outputs: 4 captions encoded, 0 read from disk" in capsys.readouterr().out


def test_a_run_that_fails_before_its_first_step_keeps_the_old_logs(tiny_models, demo_dataset, tmp_path, capsys):
    output_dir = tmp_path / "out"
    argv = args_for(tiny_models, demo_dataset, output_dir, "--max_train_steps", "2", "--grad_norm_log",
                    "--log_jsonl", str(tmp_path / "steps.jsonl"))
    run_trainer("sdxl_train_network", argv)
    before = (output_dir / "gradient_logs+last.txt").read_bytes(), (tmp_path / "steps.jsonl").read_bytes()
    tracker_config = tmp_path / "trackers.toml"
    tracker_config.write_text("[tensorboard]\nno_such_option = 1\n")
    error = train_expecting_user_error(argv + ["--logging_dir", str(tmp_path / "logs"), "--log_tracker_config",
                                               str(tracker_config)], capsys)
    assert error.startswith(f"error: --log_tracker_config {tracker_config}: a tracker refused its options")
    assert ((output_dir / "gradient_logs+last.txt").read_bytes(), (tmp_path / "steps.jsonl").read_bytes()) == before


@pytest.mark.parametrize("script", ["sdxl_train_network", "train_network", "sdxl_train", "train_db", "fine_tune",
                                    "sdxl_train_leco", "train_leco", "sdxl_train_textual_inversion",
                                    "train_textual_inversion"])
def test_every_trainer_prints_its_help(script):
    """``--help`` expands ``%`` in every option's help (a literal percent sign must be ``%%``: two options once
    broke every trainer's --help with a TypeError); each option not hidden (the debug ones) is listed."""
    parser = importlib.import_module(script).setup_parser()
    text = parser.format_help()
    for action in parser._actions:
        if action.help != argparse.SUPPRESS:
            assert all(option in text for option in action.option_strings), action.option_strings
