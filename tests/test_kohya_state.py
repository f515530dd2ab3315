"""--resume <kohya-ss state folder>: a run continued from kohya's state is the run continued from ours.

The fixture is a state folder in kohya's format (accelerate's save_state + kohya's train_state.json, as
kohya's own train_network.py writes it; learned in a harness with kohya's code on the tiny SD 1.x model),
built here from one of this trainer's states: the LoRA as model.safetensors, the optimizer's state
renumbered into kohya's parameter order as optimizer.bin, the LR schedule as scheduler.bin.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import model_args, run_trainer, train_expecting_user_error
from safetensors.torch import load_file, save_file

from library import kohya_state
from networks import lora

ARGS = ["--network_module", "networks.lora", "--network_dim", "4", "--network_args", "conv_dim=2", "conv_alpha=1",
        "--optimizer_type", "AdamW", "--learning_rate", "2e-3", "--lr_scheduler", "cosine", "--lr_warmup_steps", "1",
        "--max_train_steps", "4", "--seed", "5"]


def train_args(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return model_args(tiny_models, "sd15") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--max_data_loader_n_workers", "0", *ARGS, *extra]


def kohya_order(names: list[str]) -> list[str]:
    """kohya's creation order of SD 1.x modules, as its own optimizer states show it: ours, except that in each
    transformer block the feed-forward modules come before the cross-attention (attn2) ones."""
    ordered: list[str] = []
    attn2_waiting: list[str] = []
    for name in names:
        if "_attn2_" in name:
            attn2_waiting.append(name)
            continue
        if attn2_waiting and "_ff_" not in name:
            ordered += attn2_waiting
            attn2_waiting = []
        ordered.append(name)
    return ordered + attn2_waiting


def write_kohya_state(ours: Path, kohya: Path, step: int, epoch: int) -> None:
    """One of our state folders in kohya's format (the files kohya's resume reads)."""
    kohya.mkdir(parents=True)
    save_file(load_file(ours / "lora.safetensors"), kohya / "model.safetensors")
    components = torch.load(ours / "components.pt", weights_only=False)
    optimizer = components["optimizer"]
    # our parameter numbers -> kohya's: module by module in kohya's order (lora_down, then lora_up)
    ours_index, kohya_groups = {}, []
    for group, module_names in zip(optimizer["param_groups"], GROUP_MODULES):
        ours_index.update(zip(parameter_names(module_names), group["params"]))
        kohya_groups.append((parameter_names(kohya_order(module_names)), group))
    save_kohya_optimizer(optimizer, ours_index, kohya_groups, kohya / "optimizer.bin")
    torch.save(components["lr_scheduler"], kohya / "scheduler.bin")
    (kohya / "train_state.json").write_text(json.dumps({"current_epoch": epoch, "current_step": step}))


def parameter_names(modules: list[str]) -> list[str]:
    """The parameters of LoRA modules in registration order (down, then up)."""
    return [f"{module}.{part}" for module in modules for part in ("lora_down", "lora_up")]


def save_kohya_optimizer(optimizer: dict, ours_index: dict[str, int], kohya_groups: list[tuple[list[str], dict]],
                         path: Path) -> None:
    """Our optimizer state numbered as kohya numbers it: ``kohya_groups`` in order, each its parameter names
    in kohya's order with the settings of its group (``ours_index``: name -> our parameter number)."""
    renumbered, groups, first = {}, [], 0
    for names, group in kohya_groups:
        for offset, name in enumerate(names):
            if ours_index[name] in optimizer["state"]:
                renumbered[first + offset] = optimizer["state"][ours_index[name]]
        groups.append({**group, "params": list(range(first, first + len(names)))})
        first += len(names)
    torch.save({"state": renumbered, "param_groups": groups}, path)


GROUP_MODULES: list[list[str]] = []  # per optimizer group, its modules in our order (filled by the fixture)


@pytest.fixture(scope="module")
def runs(tiny_models, demo_dataset, tmp_path_factory):
    """An uninterrupted 4-step run with a state at step 2, and that state in kohya's format."""
    from library import model_loading
    from networks import registry

    root = tmp_path_factory.mktemp("kohya_state")
    run_trainer("train_network", train_args(tiny_models, demo_dataset, root / "ours", "--save_state",
                                            "--save_every_n_steps", "2"))
    models = model_loading.load_models(tiny_models["sd15_file"], sdxl=False, model_config_dir=tiny_models["sd15_config"])
    network = registry.network_type("networks.lora").create_network(
        1.0, 4, 1.0, None, models.text_encoders, models.unet, conv_dim="2", conv_alpha="1")
    network.apply_to()
    GROUP_MODULES[:] = [[module.lora_name for module in part] for part in
                        (network.text_encoder_loras, network.unet_loras)]
    write_kohya_state(root / "ours" / "last-step00000002-state", root / "kohya" / "k-step00000002-state",
                      step=2, epoch=1)
    return root


def test_kohya_module_order_matches_kohyas_optimizer_states():
    block = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_"
    ours = ["lora_unet_down_blocks_1_attentions_0_proj_in"] + [block + child for child in (
        "attn1_to_q", "attn1_to_k", "attn1_to_v", "attn1_to_out_0", "attn2_to_q", "attn2_to_k", "attn2_to_v",
        "attn2_to_out_0", "ff_net_0_proj", "ff_net_2")] + ["lora_unet_down_blocks_1_attentions_0_proj_out"]
    # seen in kohya's optimizer.bin (its CrossAttention/FeedForward registration order)
    assert kohya_state.kohya_module_order(ours) == kohya_order(ours) == [ours[0]] + [block + child for child in (
        "attn1_to_q", "attn1_to_k", "attn1_to_v", "attn1_to_out_0", "ff_net_0_proj", "ff_net_2", "attn2_to_q",
        "attn2_to_k", "attn2_to_v", "attn2_to_out_0")] + [ours[-1]]
    # SDXL (diffusers order: a block's attentions, then its resnets) in kohya's original-layout order
    sdxl = ["lora_unet_input_blocks_4_1_proj_in", "lora_unet_input_blocks_5_1_proj_in",
            "lora_unet_input_blocks_4_0_in_layers_2", "lora_unet_input_blocks_4_0_emb_layers_1",
            "lora_unet_input_blocks_5_0_in_layers_2", "lora_unet_input_blocks_6_0_op",
            "lora_unet_middle_block_1_proj_in", "lora_unet_middle_block_0_in_layers_2",
            "lora_unet_middle_block_2_in_layers_2"]
    assert kohya_state.kohya_module_order(sdxl) == [
        "lora_unet_input_blocks_4_0_in_layers_2", "lora_unet_input_blocks_4_0_emb_layers_1",
        "lora_unet_input_blocks_4_1_proj_in", "lora_unet_input_blocks_5_0_in_layers_2",
        "lora_unet_input_blocks_5_1_proj_in", "lora_unet_input_blocks_6_0_op", "lora_unet_middle_block_0_in_layers_2",
        "lora_unet_middle_block_1_proj_in", "lora_unet_middle_block_2_in_layers_2"]
    # kohya's OFT (prefix oft_unet_) the same way: diffusers registers the up blocks before the middle block
    oft = ["oft_unet_input_blocks_8_1_transformer_blocks_9_attn2_to_out_0",
           "oft_unet_output_blocks_0_1_transformer_blocks_0_attn1_to_q",
           "oft_unet_middle_block_1_transformer_blocks_0_attn1_to_q"]
    assert kohya_state.kohya_module_order(oft) == [oft[0], oft[2], oft[1]]


def test_continuing_a_kohya_state_is_continuing_our_own(runs, tiny_models, demo_dataset, capsys):
    kohya = runs / "kohya" / "k-step00000002-state"
    # kohya starts at the beginning of the epoch holding the step; --skip_until_initial_step skips its
    # batches already trained, so the resumed run sees the uninterrupted run's data
    log = runs / "resumed" / "log.jsonl"
    run_trainer("train_network", train_args(tiny_models, demo_dataset, runs / "resumed", "--resume", str(kohya),
                                            "--skip_until_initial_step", "--log_jsonl", str(log)))
    printed = capsys.readouterr().out
    assert (f"--resume {kohya}: kohya-ss state at step 2: restored LoRA weights, AdamW state, LR schedule; not "
            f"restored: kohya's data order and random states") in printed
    uninterrupted = lora.read_lora_file(str(runs / "ours" / "last.safetensors"))
    resumed = lora.read_lora_file(str(runs / "resumed" / "last.safetensors"))
    assert uninterrupted.keys() == resumed.keys()
    assert all(torch.equal(uninterrupted[key], resumed[key]) for key in uninterrupted)
    # the step counts on from kohya's: two more steps up to --max_train_steps
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [3, 4]


def test_a_kohya_state_of_another_network_is_refused(runs, tiny_models, demo_dataset, capsys):
    kohya = runs / "kohya" / "k-step00000002-state"
    argv = train_args(tiny_models, demo_dataset, runs / "other", "--resume", str(kohya))
    argv[argv.index("--network_dim") + 1] = "8"
    error = train_expecting_user_error(argv, capsys, script="train_network")
    assert error.startswith(f"error: --resume {kohya} (model.safetensors): ") and "--network_dim" in error


SDXL_ARGS = ["--network_module", "networks.lora", "--network_dim", "4", "--optimizer_type", "AdamW",
             "--learning_rate", "2e-3", "--unet_lr", "2e-3", "--text_encoder_lr", "1e-3", "--lr_scheduler", "cosine",
             "--lr_warmup_steps", "1", "--max_train_steps", "4", "--seed", "5"]


def sdxl_train_args(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--max_data_loader_n_workers", "0", *SDXL_ARGS, *extra]


def write_kohya_sdxl_state(ours: Path, kohya: Path, encoder_modules: list[list[str]], unet_modules: list[str]) -> None:
    """One of our SDXL states (groups: text encoder 1, text encoder 2, UNet) in kohya's format, as kohya's
    own SDXL trainer writes it (seen in its optimizer.bin and scheduler.bin at full size): both text
    encoders' modules in one group, then the UNet's in kohya's module order; the schedule's per-group
    lists with one entry per kohya group."""
    kohya.mkdir(parents=True)
    save_file(load_file(ours / "lora.safetensors"), kohya / "model.safetensors")
    components = torch.load(ours / "components.pt", weights_only=False)
    optimizer = components["optimizer"]
    assert len(optimizer["param_groups"]) == 3

    ours_index = {}
    for group, modules in zip(optimizer["param_groups"], [*encoder_modules, unet_modules]):
        ours_index.update(zip(parameter_names(modules), group["params"]))
    kohya_groups = [(parameter_names(encoder_modules[0] + encoder_modules[1]), optimizer["param_groups"][0]),
                    (parameter_names(kohya_state.kohya_module_order(unet_modules)), optimizer["param_groups"][2])]
    save_kohya_optimizer(optimizer, ours_index, kohya_groups, kohya / "optimizer.bin")
    scheduler = {key: [value[0], value[2]] if isinstance(value, list) and len(value) == 3 else value
                 for key, value in components["lr_scheduler"].items()}
    torch.save(scheduler, kohya / "scheduler.bin")
    (kohya / "train_state.json").write_text(json.dumps({"current_epoch": 1, "current_step": 2}))


def test_an_sdxl_kohya_state_with_both_text_encoders_in_one_group_continues_as_our_own(
        tiny_models, demo_dataset, tmp_path, capsys):
    """kohya's SDXL LoRA puts both text encoders into one optimizer group (learned from its own state at
    full size); this trainer has one per encoder. The groups and the schedule map onto ours: the continued
    run ends with the uninterrupted run's bytes (text encoders and UNet at different learning rates)."""
    import sdxl_train_network
    from library import model_loading
    from networks import registry

    run_trainer("sdxl_train_network", sdxl_train_args(tiny_models, demo_dataset, tmp_path / "ours", "--save_state",
                                                      "--save_every_n_steps", "2"))
    models = model_loading.load_models(tiny_models["sdxl_file"], sdxl=True, model_config_dir=tiny_models["sdxl_config"])
    network = registry.network_type("networks.lora").create_network(
        1.0, 4, 1.0, None, models.text_encoders, models.unet,
        unet_module_names=sdxl_train_network.SdxlNetworkTrainer().unet_module_names(models))
    network.apply_to()
    encoders = [[module.lora_name for module in modules] for modules in network.text_encoder_groups()]
    kohya = tmp_path / "kohya" / "k-step00000002-state"
    write_kohya_sdxl_state(tmp_path / "ours" / "last-step00000002-state", kohya, encoders,
                           [module.lora_name for module in network.unet_loras])
    capsys.readouterr()
    run_trainer("sdxl_train_network", sdxl_train_args(tiny_models, demo_dataset, tmp_path / "resumed", "--resume",
                                                      str(kohya), "--skip_until_initial_step"))
    assert "kohya-ss state at step 2: restored LoRA weights, AdamW state, LR schedule;" in capsys.readouterr().out
    uninterrupted = lora.read_lora_file(str(tmp_path / "ours" / "last.safetensors"))
    resumed = lora.read_lora_file(str(tmp_path / "resumed" / "last.safetensors"))
    assert uninterrupted.keys() == resumed.keys() and any(key.startswith("lora_te2_") for key in resumed)
    assert all(torch.equal(uninterrupted[key], resumed[key]) for key in uninterrupted)
