"""The kohya_ss GUI's LoRA-tool tabs, command by command as the GUI writes them.

Each command below is what the GUI v26's own code (kohya_gui/*_gui.py: Extract LoRA, Merge LoRA,
Merge LoRA (SVD), Resize LoRA, Extract DyLoRA, Verify LoRA) built when its tab was driven headless
with the fields listed (the harness: tab built in gr.Blocks, fields set by label, the click
handler called, the final subprocess launch captured). Only paths are substituted: ``{python}``
is the GUI's interpreter (``sys.executable``), ``{sd_scripts}`` the GUI's ``<scriptdir>/sd-scripts``
(this repository), the rest the tiny models and LoRAs trained on them here. The GUI runs them with
``subprocess.run(argv, env=setup_environment())``: PYTHONPATH=<gui>:<sd-scripts>, no accelerate.

Three tabs' commands get one more flag, ``--model_config_dir`` (the tiny models' architecture is
not one of the shipped full-size configs, and these tabs have no field for extra flags; full-size
models need none): Merge with an SD model and Extract load a checkpoint, and Merge (SVD) builds the
LoRA's modules on an empty model of the files' kind.

Every script file runs as the GUI launches it (a subprocess with the GUI's environment) exactly once, its other
commands run the same file in this process (as ``__main__``, the GUI's argv and working folder): a launch costs ~15 s
of CPU for the imports alone (diffusers imports bitsandbytes, which imports torch's compiler). The tabs whose script
is the same for both kinds launch it on SDXL (Verify's output streams are checked there), SD 1.5's command runs in
this process; the Merge tab runs a different file per kind: its into-a-model command launches each file, its
LoRA-only command runs the same file in this process.

Outputs are checked on real code paths: every module of a LoRA file is built on the tiny model by
``networks.registry.network_from_file`` (what merging and --network_weights use), deltas and ranks
against the inputs, checkpoints loaded back by ``library.model_loading``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, SCRIPT_ENV, TRAIN_SCRIPTS, model_args, run_script_as_main, run_trainer
from safetensors import safe_open

from library import checkpoint_keys, model_loading
from networks import merge_lora, registry
from networks.lora import lora_delta, lora_modules, read_lora_file

# Merge LoRA tab, "SD Model" set (SDXL box as the GUI's own detection sets it: merge_lora.py for SD 1.5,
# sdxl_merge_lora.py for SDXL), A = lora_a at 1.0, B = locon at 0.5, Save precision fp16, Merge precision float.
MERGE_INTO_MODEL = {
    "sd15": ["{python}", "{sd_scripts}/networks/merge_lora.py", "--sd_model", "{file}", "--save_precision", "fp16",
             "--precision", "float", "--save_to", "{out}/merged_sd15.safetensors", "--models", "{lora_a}", "{locon}",
             "--ratios", "1.0", "0.5"],
    "sdxl": ["{python}", "{sd_scripts}/networks/sdxl_merge_lora.py", "--sd_model", "{file}", "--save_precision",
             "fp16", "--precision", "float", "--save_to", "{out}/merged_sdxl.safetensors", "--models", "{lora_a}",
             "{locon}", "--ratios", "1.0", "0.5"],
}
# Merge LoRA tab, no SD model: A = lora_a at 0.7, B = locon at 0.3 (the SDXL box ticked for SDXL LoRAs).
MERGE_LORAS = {
    "sd15": ["{python}", "{sd_scripts}/networks/merge_lora.py", "--save_precision", "fp16", "--precision", "float",
             "--save_to", "{out}/merged_loras_sd15.safetensors", "--models", "{lora_a}", "{locon}",
             "--ratios", "0.7", "0.3"],
    "sdxl": ["{python}", "{sd_scripts}/networks/sdxl_merge_lora.py", "--save_precision", "fp16", "--precision",
             "float", "--save_to", "{out}/merged_loras_sdxl.safetensors", "--models", "{lora_a}", "{locon}",
             "--ratios", "0.7", "0.3"],
}
# Extract LoRA tab: rank 8, conv rank 4, Device cpu, Load precision float, Save precision fp16; the SDXL box
# as the GUI's detection sets it (it adds the two "load ... to" fields).
EXTRACT = {
    "sd15": ["{python}", "{sd_scripts}/networks/extract_lora_from_models.py", "--load_precision", "float",
             "--save_precision", "fp16", "--save_to", "{out}/extracted_sd15.safetensors", "--model_org", "{file}",
             "--model_tuned", "{tuned}", "--dim", "8", "--device", "cpu", "--clamp_quantile", "0.99", "--min_diff",
             "0.01", "--conv_dim", "4"],
    "sdxl": ["{python}", "{sd_scripts}/networks/extract_lora_from_models.py", "--load_precision", "float",
             "--save_precision", "fp16", "--save_to", "{out}/extracted_sdxl.safetensors", "--model_org", "{file}",
             "--model_tuned", "{tuned}", "--dim", "8", "--device", "cpu", "--clamp_quantile", "0.99", "--min_diff",
             "0.01", "--conv_dim", "4", "--sdxl", "--load_original_model_to", "cpu", "--load_tuned_model_to", "cpu"],
}
# Merge LoRA (SVD) tab: A = lora_a at 0.6, B = locon at 0.4, C and D empty at 0 (the GUI divides the ratios
# by their sum, C and D included), New Rank 6, New Conv Rank 4, Device cpu, precisions left at float.
SVD_MERGE = ["{python}", "{sd_scripts}/networks/svd_merge_lora.py", "--save_precision", "float", "--precision",
             "float", "--save_to", "{out}/svd_merged.safetensors", "--models", "{lora_a}", "{locon}", "--ratios",
             "0.6", "0.4", "--device", "cpu", "--new_rank", "6", "--new_conv_rank", "4"]
# Resize LoRA tab: source locon, rank 4, Device cpu; Dynamic method sv_fro / 0.9, SVD lowrank iterations 2,
# verbose and Save precision fp16 left at the GUI's defaults.
RESIZE = ["{python}", "{sd_scripts}/networks/resize_lora.py", "--save_precision", "fp16", "--save_to",
          "{out}/resized.safetensors", "--model", "{locon}", "--new_rank", "4", "--device", "cpu",
          "--dynamic_method", "sv_fro", "--dynamic_param", "0.9", "--svd_lowrank_niter", "2", "--verbose"]
# Extract DyLoRA tab: its "Network Dimension (Rank)" field is written as --unit.
EXTRACT_DYLORA = ["{python}", "{sd_scripts}/networks/extract_lora_from_dylora.py", "--save_to",
                  "{out}/from_dylora.safetensors", "--model", "{dylora}", "--unit", "4"]
# Verify LoRA tab (the GUI shows stdout and stderr in its Output box).
VERIFY = ["{python}", "{sd_scripts}/networks/check_lora_weights.py", "{locon}"]

KINDS = ("sd15", "sdxl")
# The kind whose commands of the same-file tabs run in this process (the other launches the file as the GUI does).
IN_PROCESS_KIND = "sd15"


@pytest.fixture(scope="module")
def inputs(tiny_models, demo_dataset, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per kind: LoRAs trained here (lora_a rank 8, locon rank 8 + conv 4, dylora rank 8 unit 2) and a
    "finetuned" checkpoint (the base with locon and 0.5 lora_a merged in)."""
    root = tmp_path_factory.mktemp("gui_inputs")
    result = {}
    seed = 0
    for kind in KINDS:
        files = {"file": tiny_models[f"{kind}_file"], "config": tiny_models[f"{kind}_config"]}
        for name, extra in {
            "lora_a": ["--network_dim", "8", "--network_alpha", "4"],
            "locon": ["--network_dim", "8", "--network_alpha", "4", "--network_args", "conv_dim=4", "conv_alpha=2"],
            "dylora": ["--network_module", "networks.dylora", "--network_dim", "8", "--network_alpha", "4",
                       "--network_args", "unit=2"],
        }.items():
            seed += 1
            run_trainer(TRAIN_SCRIPTS[kind], model_args(tiny_models, kind) + [
                "--train_data_dir", str(demo_dataset), "--caption_extension", ".txt", "--resolution", "64",
                "--output_dir", str(root / kind), "--output_name", name, "--seed", str(seed),
                "--max_data_loader_n_workers", "0", "--learning_rate", "3e-2", "--max_train_steps", "2", *extra])
            files[name] = root / kind / f"{name}.safetensors"
        files["tuned"] = root / kind / "tuned.safetensors"
        merge_lora.main(["--sd_model", str(files["file"]), "--model_config_dir", str(files["config"]),
                         "--save_to", str(files["tuned"]), "--models", str(files["locon"]), str(files["lora_a"]),
                         "--ratios", "1.0", "0.5"])
        result[kind] = files
    return result


def run_gui_command(template: list[str], files: dict[str, Path], out: Path, *extra: str, in_process: bool = False
                    ) -> subprocess.CompletedProcess:
    """The GUI's argv with paths filled in, run as the GUI runs it (its PYTHONPATH, its working folder); with
    ``in_process``, the same script file as ``__main__`` in this process, with that argv and working folder."""
    values = {"python": sys.executable, "sd_scripts": str(REPO), "out": str(out),
              **{key: str(value) for key, value in files.items()}}
    argv = [part.format(**values) for part in template] + list(extra)
    gui_dir = out / "kohya_ss"
    gui_dir.mkdir(exist_ok=True)
    if in_process:
        return run_script_as_main(argv, gui_dir)
    env = {**SCRIPT_ENV, "PYTHONPATH": os.pathsep.join([str(gui_dir), str(REPO), SCRIPT_ENV.get("PYTHONPATH", "")])}
    result = subprocess.run(argv, cwd=gui_dir, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result


def save_to(result: subprocess.CompletedProcess) -> Path:
    argv = result.args
    return Path(argv[argv.index("--save_to") + 1])


def tiny_base(kind: str, files: dict[str, Path], path: Path | None = None):
    return model_loading.load_models(path or files["file"], sdxl=kind == "sdxl", model_config_dir=files["config"])


def built_on_tiny_model(kind: str, files: dict[str, Path], lora: Path) -> int:
    """Every module of ``lora`` built on the tiny model by our loader (UserError if one matches nothing);
    returns the number of modules."""
    models = tiny_base(kind, files)
    names = checkpoint_keys.unet_module_name_map(models.unet.config) if models.is_sdxl else None
    network = registry.network_from_file(str(lora), models.text_encoders, models.unet, names, "--network_weights")
    return len(list(network.all_loras()))


def dtypes(path: Path) -> set[torch.dtype]:
    with safe_open(str(path), "pt") as file:
        return {file.get_tensor(key).dtype for key in file.keys()}


def ranks(modules) -> dict[str, int]:
    return {name: parts["down"].shape[0] for name, parts in modules.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_merge_tab_into_model(kind, inputs, tmp_path):
    files = inputs[kind]
    result = run_gui_command(MERGE_INTO_MODEL[kind], files, tmp_path, "--model_config_dir", str(files["config"]))
    merged = tiny_base(kind, files, save_to(result))
    base = tiny_base(kind, files)
    merge_lora.merge_into_models(base, [str(files["lora_a"]), str(files["locon"])], [1.0, 0.5])
    merged_weights, expected = dict(merged.unet.named_parameters()), dict(base.unet.named_parameters())
    assert merged_weights.keys() == expected.keys()
    for name, value in expected.items():  # saved as fp16 (Save precision): within fp16 rounding of the weight
        assert (merged_weights[name] - value).abs().max() <= 2 ** -11 * value.abs().max(), name


@pytest.mark.parametrize("kind", KINDS)
def test_merge_tab_loras_into_one(kind, inputs, tmp_path):
    """The GUI cannot pass --concat: kohya's default merge, the scaled factors added per module
    (s_i = sqrt(alpha_i / alpha_first) * ratio_i on down, |s_i| on up, alpha of the first file holding it)."""
    files = inputs[kind]
    out = save_to(run_gui_command(MERGE_LORAS[kind], files, tmp_path, in_process=True))  # launched: into a model
    merged = lora_modules(read_lora_file(str(out)))
    sources = [(0.7, lora_modules(read_lora_file(str(files["lora_a"])))),
               (0.3, lora_modules(read_lora_file(str(files["locon"]))))]
    assert set(merged) == set(sources[0][1]) | set(sources[1][1])
    assert built_on_tiny_model(kind, files, out) == len(merged) and dtypes(out) == {torch.float16}
    for name, parts in merged.items():
        holding = [(ratio, modules[name]) for ratio, modules in sources if name in modules]
        first_alpha = float(holding[0][1]["alpha"])
        expected, magnitude = {"down": 0, "up": 0}, {"down": 0, "up": 0}
        for ratio, source in holding:
            factor = (float(source["alpha"]) / first_alpha) ** 0.5 * ratio
            for key, sign_factor in (("down", factor), ("up", abs(factor))):
                expected[key] = expected[key] + sign_factor * source[key].double()
                magnitude[key] = magnitude[key] + abs(factor) * source[key].double().abs()
        assert float(parts["alpha"]) == first_alpha, name
        for key, value in expected.items():
            # summed in float32 (a few ulps of the terms), stored in fp16 (Save precision: half an ulp,
            # subnormals included)
            bound = 2 ** -11 * value.abs() + 2 ** -25 + 2 ** -22 * magnitude[key]
            assert ((parts[key].double() - value).abs() <= bound).all(), (name, key)


@pytest.mark.parametrize("kind", KINDS)
def test_extract_tab(kind, inputs, tmp_path):
    files = inputs[kind]
    out = save_to(run_gui_command(EXTRACT[kind], files, tmp_path, "--model_config_dir", str(files["config"]),
                                  in_process=kind == IN_PROCESS_KIND))
    modules = lora_modules(read_lora_file(str(out)))
    assert modules and built_on_tiny_model(kind, files, out) == len(modules)
    assert max(ranks(modules).values()) <= 8 and dtypes(out) == {torch.float16}
    conv = {name: parts for name, parts in modules.items() if parts["down"].dim() == 4 and parts["down"].shape[2] == 3}
    assert conv and max(ranks(conv).values()) <= 4  # --conv_dim 4: the 3x3 convolutions of the locon


@pytest.mark.parametrize("kind", KINDS)
def test_svd_merge_tab(kind, inputs, tmp_path):
    files = inputs[kind]
    out = save_to(run_gui_command(SVD_MERGE, files, tmp_path, "--model_config_dir", str(files["config"]),
                                  in_process=kind == IN_PROCESS_KIND))
    modules = lora_modules(read_lora_file(str(out)))
    a, b = lora_modules(read_lora_file(str(files["lora_a"]))), lora_modules(read_lora_file(str(files["locon"])))
    assert set(modules) == set(a) | set(b) and built_on_tiny_model(kind, files, out) == len(modules)
    for name, parts in modules.items():
        is_conv3x3 = parts["down"].dim() == 4 and parts["down"].shape[2] == 3
        assert parts["down"].shape[0] <= (4 if is_conv3x3 else 6), name
    # a module both have (rank 8 + 8) is cut to New Rank
    name = next(name for name in a if name in b)
    assert modules[name]["down"].shape[0] == 6
    # the 3x3 convolutions are only in the locon (rank 4 = New Conv Rank): 0.4 x its delta, exactly up to
    # float32 SVD rounding (eps x the largest dimension)
    conv = [name for name, parts in b.items() if parts["down"].dim() == 4 and parts["down"].shape[2] == 3]
    assert conv and not set(conv) & set(a)
    for name in conv:
        expected = 0.4 * lora_delta(b[name], torch.float64)
        got = lora_delta(modules[name], torch.float64)
        bound = torch.finfo(torch.float32).eps * max(got.shape[0], got[0].numel()) * expected.abs().max()
        assert (got - expected).abs().max() <= bound, name


@pytest.mark.parametrize("kind", KINDS)
def test_resize_tab(kind, inputs, tmp_path):
    files = inputs[kind]
    out = save_to(run_gui_command(RESIZE, files, tmp_path, in_process=kind == IN_PROCESS_KIND))
    modules, source = lora_modules(read_lora_file(str(out))), lora_modules(read_lora_file(str(files["locon"])))
    assert set(modules) == set(source) and built_on_tiny_model(kind, files, out) == len(modules)
    assert max(ranks(modules).values()) <= 4 and dtypes(out) == {torch.float16}


@pytest.mark.parametrize("kind", KINDS)
def test_extract_dylora_tab(kind, inputs, tmp_path):
    files = inputs[kind]
    run_gui_command(EXTRACT_DYLORA, files, tmp_path, in_process=kind == IN_PROCESS_KIND)
    # as kohya's script: one file per multiple of --unit below the rank, named <save_to stem>-<rank:04d>
    assert sorted(path.name for path in tmp_path.glob("from_dylora*")) == ["from_dylora-0004.safetensors"]
    out = tmp_path / "from_dylora-0004.safetensors"
    modules, source = lora_modules(read_lora_file(str(out))), lora_modules(read_lora_file(str(files["dylora"])))
    assert set(modules) == set(source) and built_on_tiny_model(kind, files, out) == len(modules)
    assert set(ranks(modules).values()) == {4}
    for name, parts in modules.items():  # the first 4 rows / columns of each rank-8 DyLoRA module, alpha kept
        torch.testing.assert_close(parts["down"], source[name]["down"][:4], rtol=0, atol=0)
        torch.testing.assert_close(parts["up"], source[name]["up"][:, :4], rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_verify_tab(kind, inputs, tmp_path):
    files = inputs[kind]
    result = run_gui_command(VERIFY, files, tmp_path, in_process=kind == IN_PROCESS_KIND)
    count = len(lora_modules(read_lora_file(str(files["locon"]))))
    assert f"# {count} modules, 0 with NaN/Inf" in result.stdout and result.stderr == ""
