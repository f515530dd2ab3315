@echo off
rem SDXL LoRA in fp16 with the gradient guard's "stable" preset, spelled out flag by flag
rem (the same as --grad_guard_preset stable): NaN/Inf norms go into the window and are not
rem skipped by the guard, so the GradScaler sees the overflow and lowers its scale; spikes
rem above mean + 2.5 std of the last 200 norms (at most 20 x their median; before 200 norms:
rem above 20 x the median so far, whatever the network type's gradient scale) are skipped; the gradient log
rem gets the Scale and CosineSim columns. Plot it with tools/plot_grad_log.py.
rem Edit the paths below, then run (double-click or from a prompt): examples\presets\sdxl_lora_stable.bat
setlocal
cd /d "%~dp0..\.."

set MODEL=models\sd_xl_base_1.0.safetensors
set TOKENIZERS=tokenizers
set DATA=data
set OUT=output
set NAME=my_sdxl_lora

.venv\Scripts\python.exe sdxl_train_network.py ^
  --pretrained_model_name_or_path "%MODEL%" ^
  --tokenizer_cache_dir "%TOKENIZERS%" ^
  --train_data_dir "%DATA%" --caption_extension .txt ^
  --resolution 1024 --enable_bucket --min_bucket_reso 512 --max_bucket_reso 2048 ^
  --output_dir "%OUT%" --output_name "%NAME%" --save_model_as safetensors --save_precision fp16 ^
  --network_module networks.lora --network_dim 16 --network_alpha 8 ^
  --optimizer_type AdamW --learning_rate 1e-4 --unet_lr 1e-4 --text_encoder_lr 5e-5 ^
  --lr_scheduler cosine --lr_warmup_steps 100 ^
  --train_batch_size 1 --max_train_steps 2000 --save_every_n_steps 500 ^
  --mixed_precision fp16 --no_half_vae --gradient_checkpointing ^
  --cache_latents --seed 42 ^
  --skip_grad_norm --skip_grad_norm_warmup_factor 20 --skip_grad_norm_max_factor 20 ^
  --nan_to_window --inf_to_window ^
  --no-skip_nan_immediate --no-skip_inf_immediate ^
  --grad_norm_log --grad_cosine_log
endlocal
