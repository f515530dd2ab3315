"""A --config_file written the way kohya_ss GUI writes it parses and trains."""
from __future__ import annotations

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
