#!/usr/bin/env bash
# SDXL LoRA in fp16 with the gradient guard's "stable" preset, spelled out flag by flag
# (the same as --grad_guard_preset stable): NaN/Inf norms go into the window and are not
# skipped by the guard, so the GradScaler sees the overflow and lowers its scale; spikes
# above mean + 2.5 std of the last 200 norms (at most 20 x their median; before 200 norms:
# above 20 x the median so far, whatever the network type's gradient scale) are skipped; the gradient log
# gets the Scale and CosineSim columns. Plot it with tools/plot_grad_log.py.
# Edit the paths below, then run from anywhere: bash examples/presets/sdxl_lora_stable.sh
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL="models/sd_xl_base_1.0.safetensors"
TOKENIZERS="tokenizers"
DATA="data"
OUT="output"
NAME="my_sdxl_lora"

.venv/bin/python sdxl_train_network.py \
  --pretrained_model_name_or_path "$MODEL" \
  --tokenizer_cache_dir "$TOKENIZERS" \
  --train_data_dir "$DATA" --caption_extension .txt \
  --resolution 1024 --enable_bucket --min_bucket_reso 512 --max_bucket_reso 2048 \
  --output_dir "$OUT" --output_name "$NAME" --save_model_as safetensors --save_precision fp16 \
  --network_module networks.lora --network_dim 16 --network_alpha 8 \
  --optimizer_type AdamW --learning_rate 1e-4 --unet_lr 1e-4 --text_encoder_lr 5e-5 \
  --lr_scheduler cosine --lr_warmup_steps 100 \
  --train_batch_size 1 --max_train_steps 2000 --save_every_n_steps 500 \
  --mixed_precision fp16 --no_half_vae --gradient_checkpointing \
  --cache_latents --seed 42 \
  --skip_grad_norm --skip_grad_norm_warmup_factor 20 --skip_grad_norm_max_factor 20 \
  --nan_to_window --inf_to_window \
  --no-skip_nan_immediate --no-skip_inf_immediate \
  --grad_norm_log --grad_cosine_log
