"""A --config_file written the way kohya_ss GUI writes it parses and trains."""
from __future__ import annotations

import json

import pytest
import toml
import torch
from conftest import run_trainer
from safetensors import safe_open


def test_gui_style_config_trains(tiny_models, demo_dataset, tmp_path, caplog):
    output_dir = tmp_path / "out"
    config = tmp_path / "gui_config.toml"
    config.write_text(f'''
pretrained_model_name_or_path = "{tiny_models["sdxl_file"]}"
model_config_dir = "{tiny_models["sdxl_config"]}"
train_data_dir = "{demo_dataset}"
reg_data_dir = ""
output_dir = "{output_dir}"
output_name = "gui_lora"
logging_dir = ""
vae = ""
caption_extension = ".txt"
resolution = "64,64"
network_module = "networks.lora"
network_dim = 4
network_alpha = 2
learning_rate = 0.001
unet_lr = 0.001
text_encoder_lr = 0.0005
lr_scheduler = "cosine"
lr_warmup_steps = 0
optimizer_type = "AdamW"
max_train_steps = 2
train_batch_size = 1
mixed_precision = "fp16"
save_precision = "fp16"
seed = 1
max_data_loader_n_workers = 0
persistent_data_loader_workers = 0
gradient_checkpointing = false
shuffle_caption = false
enable_bucket = true
min_bucket_reso = 64
max_bucket_reso = 128
bucket_reso_steps = 32
bucket_no_upscale = true
max_token_length = 75
network_train_unet_only = true
epoch = 1
noise_offset_type = "Original"
save_every_n_epochs = 1
''')
    run_trainer("sdxl_train_network", ["--config_file", str(config)])
    warning_lines = [record.getMessage() for record in caplog.records
                     if "epoch" in record.getMessage() and "noise_offset_type" in record.getMessage()]
    assert len(warning_lines) == 1  # unknown keys: one warning line, not fatal, not silent
    with safe_open(str(output_dir / "gui_lora.safetensors"), "pt") as file:
        metadata = file.metadata()
        dtypes = {file.get_tensor(key).dtype for key in file.keys()}
    assert metadata["ss_lr_scheduler"] == "cosine" and metadata["ss_network_dim"] == "4"
    assert dtypes == {__import__("torch").float16}


# What the kohya_ss GUI's own "Print training command" wrote (run headless on its presets, see
# /work/gui_harness/run_presets.py), with only the paths, resolution, batch size and step count
# changed for the tiny model. Keys sorted and lists spelled as the GUI's TOML writer does.
GUI_TOMLS = {
    # "SDXL - LoRA kudou-reira prodigy v4.0": Standard LoRA, Prodigy, logs to wandb
    "standard-prodigy-wandb": '''bucket_no_upscale = true
bucket_reso_steps = 64
cache_latents = true
cache_latents_to_disk = true
caption_extension = ".txt"
clip_skip = 1
dynamo_backend = "no"
enable_bucket = true
epoch = 30
gradient_accumulation_steps = 1
gradient_checkpointing = true
huber_c = 0.1
huber_scale = 1.0
huber_schedule = "snr"
keep_tokens = 2
learning_rate = 1.0
log_with = "wandb"
logging_dir = "{out}/log"
loss_type = "l2"
lr_scheduler = "cosine_with_restarts"
lr_scheduler_args = []
lr_scheduler_num_cycles = 1
lr_scheduler_power = 1.0
max_bucket_reso = 128
max_data_loader_n_workers = 0
max_grad_norm = 1.0
max_timestep = 1000
max_token_length = 225
max_train_steps = 2
min_bucket_reso = 64
min_snr_gamma = 5
mixed_precision = "bf16"
network_alpha = 256
network_args = []
network_dim = 256
network_module = "networks.lora"
no_half_vae = true
noise_offset = 0.0357
noise_offset_type = "Original"
optimizer_args = [ "decouple=True", "weight_decay=0.45", "d_coef=2", "use_bias_correction=True", "safeguard_warmup=True",]
optimizer_type = "Prodigy"
output_dir = "{out}"
output_name = "last"
pretrained_model_name_or_path = "{model}"
prior_loss_weight = 1.0
resolution = "64,64"
sample_prompts = "{out}/sample/prompt.txt"
sample_sampler = "euler_a"
save_every_n_epochs = 1
save_model_as = "safetensors"
save_precision = "bf16"
seed = 1337
shuffle_caption = true
text_encoder_lr = [ 1.0, 1.0,]
train_batch_size = 1
train_data_dir = "{data}"
unet_lr = 1.0
wandb_run_name = "last"
xformers = true
''',
    # "SDXL - LoHA AI_Characters v1.0": LyCORIS LoHa with Python-style network_args, AdamW8bit, fp16
    "lycoris-loha-adamw8bit": '''bucket_no_upscale = true
bucket_reso_steps = 32
cache_latents = true
cache_latents_to_disk = true
caption_extension = ".txt"
clip_skip = 1
dynamo_backend = "no"
enable_bucket = true
epoch = 1
gradient_accumulation_steps = 1
gradient_checkpointing = true
huber_c = 0.1
huber_scale = 1.0
huber_schedule = "snr"
learning_rate = 0.0001
logging_dir = "{out}/log"
loss_type = "l2"
lr_scheduler = "constant"
lr_scheduler_args = []
lr_scheduler_num_cycles = 1
lr_scheduler_power = 1.0
max_bucket_reso = 128
max_data_loader_n_workers = 0
max_grad_norm = 1.0
max_timestep = 1000
max_token_length = 75
max_train_steps = 2
min_bucket_reso = 64
mixed_precision = "fp16"
network_alpha = 32
network_args = [ "preset=full", "conv_dim=16", "conv_alpha=16", "use_tucker=False", "rank_dropout=0", "bypass_mode=False", "dora_wd=False", "module_dropout=0", "use_tucker=False", "use_scalar=False", "rank_dropout_scale=False", "algo=loha", "train_norm=False",]
network_dim = 32
network_module = "lycoris.kohya"
no_half_vae = true
noise_offset_type = "Original"
optimizer_args = []
optimizer_type = "AdamW8bit"
output_dir = "{out}"
output_name = "last"
pretrained_model_name_or_path = "{model}"
prior_loss_weight = 1.0
resolution = "64,64"
sample_prompts = "{out}/sample/prompt.txt"
sample_sampler = "euler_a"
save_every_n_epochs = 100
save_model_as = "safetensors"
save_precision = "fp16"
seed = 12345
text_encoder_lr = [ 0.0001, 0.0001,]
train_batch_size = 1
train_data_dir = "{data}"
training_comment = "trigger: lxndrn woman"
unet_lr = 0.0001
wandb_run_name = "last"
xformers = true
''',
}

# TOML value -> the ss_* metadata kohya records for it (how it is written there).
METADATA_OF_TOML = {
    "learning_rate": "ss_learning_rate", "unet_lr": "ss_unet_lr", "network_dim": "ss_network_dim",
    "network_alpha": "ss_network_alpha", "network_module": "ss_network_module", "lr_scheduler": "ss_lr_scheduler",
    "max_train_steps": "ss_max_train_steps", "mixed_precision": "ss_mixed_precision", "seed": "ss_seed",
    "noise_offset": "ss_noise_offset", "max_token_length": "ss_max_token_length", "keep_tokens": "ss_keep_tokens",
    "min_snr_gamma": "ss_min_snr_gamma", "max_grad_norm": "ss_max_grad_norm", "clip_skip": "ss_clip_skip",
    "training_comment": "ss_training_comment", "output_name": "ss_output_name",
    "gradient_checkpointing": "ss_gradient_checkpointing", "shuffle_caption": "ss_shuffle_caption",
    "train_batch_size": "ss_batch_size_per_device", "min_bucket_reso": "ss_min_bucket_reso",
    "max_bucket_reso": "ss_max_bucket_reso", "bucket_no_upscale": "ss_bucket_no_upscale",
    "cache_latents": "ss_cache_latents", "prior_loss_weight": "ss_prior_loss_weight", "loss_type": "ss_loss_type",
}


@pytest.mark.parametrize("shape", GUI_TOMLS)
def test_toml_as_the_gui_writes_it_trains(shape, tiny_models, demo_dataset, tmp_path, offline_wandb, caplog):
    """Empty prompt file, GUI-only keys (epoch, noise_offset_type, dynamo_backend), empty lists,
    Python-style "key=value" strings, text_encoder_lr as a list, wandb offline: it trains, and
    the LoRA's ss_* metadata records what the TOML says."""
    output_dir = tmp_path / "out"
    (output_dir / "sample").mkdir(parents=True)
    (output_dir / "sample" / "prompt.txt").write_text("")  # the GUI's empty Samples box
    text = GUI_TOMLS[shape].format(out=output_dir, model=tiny_models["sdxl"], data=demo_dataset)
    config = output_dir / "config_lora-20260101-000000.toml"
    config.write_text(text)

    run_trainer("sdxl_train_network", ["--config_file", str(config)])

    ignored = [record.getMessage() for record in caplog.records if "ignoring" in record.getMessage()]
    assert len(ignored) == 1 and all(key in ignored[0] for key in ("epoch", "noise_offset_type"))
    written = toml.loads(text)
    with safe_open(str(output_dir / "last.safetensors"), "pt") as file:
        metadata = file.metadata()
        weights = {key: file.get_tensor(key) for key in file.keys()}
    for key, ss_key in METADATA_OF_TOML.items():
        if key in written:
            assert recorded_as(written[key], metadata[ss_key]), (key, metadata[ss_key])
    assert json.loads(metadata["ss_text_encoder_lr"]) == written["text_encoder_lr"]
    assert metadata["ss_resolution"] == "(64, 64)"
    assert metadata["ss_optimizer"].split("(")[0].endswith("." + written["optimizer_type"])
    recorded_args = json.loads(metadata.get("ss_network_args", "{}"))
    assert recorded_args == dict(item.split("=", 1) for item in written["network_args"])  # kohya keeps the strings
    assert all(torch.isfinite(tensor.float()).all() for tensor in weights.values())
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16 if written["save_precision"] == "bf16"
                                                             else torch.float16}
    if written.get("log_with") == "wandb":
        assert list(offline_wandb.glob("offline-run-*")), "wandb logged nothing offline"


def recorded_as(value, text: str) -> bool:
    """Whether metadata ``text`` records TOML ``value`` (kohya writes str() of the option's value)."""
    if isinstance(value, (bool, str)):
        return text == str(value)
    return float(text) == float(value)
