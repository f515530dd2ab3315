"""Textual inversion (``train_textual_inversion.py``, ``sdxl_train_textual_inversion.py``) on the tiny models:
the file is kohya's and diffusers' ``load_textual_inversion`` reads it into encoders that give the trained
run's outputs; everything else of the models is untouched; the loss on fixed draws goes down; kill -9 +
``--resume auto`` gives the uninterrupted bytes; bad input is one line."""
from __future__ import annotations

import importlib
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import send_to_device
from conftest import REPO, SCRIPT_ENV, model_args, run_script_as_main, train_expecting_user_error
from safetensors import safe_open
from safetensors.torch import load_file

import train_network
from library import model_loading, sampling
from library.trainables import embeddings

SCRIPTS = {"sdxl": "sdxl_train_textual_inversion", "sd15": "train_textual_inversion"}
TRAINERS = {"sdxl": "SdxlTextualInversionTrainer", "sd15": "TextualInversionTrainer"}
TOKENS = ["zqx", "zqx1"]  # --token_string zqx --num_vectors_per_token 2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from tools.make_demo_dataset import make_demo_dataset

    root = tmp_path_factory.mktemp("ti_dataset")
    make_demo_dataset(str(root), count=4, size=64, repeats=1)
    return root


def ti_argv(tiny_models, kind: str, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return model_args(tiny_models, kind) + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "emb", "--seed", "1", "--max_data_loader_n_workers", "0",
        "--token_string", "zqx", "--init_word", "red", "--num_vectors_per_token", "2", "--use_object_template",
        "--optimizer_type", "AdamW", "--learning_rate", "0.05", "--max_train_steps", "6",
        "--save_model_as", "safetensors", *extra]


def train_capturing_run(kind: str, argv: list[str]):
    """Train in this process through the entry script's ``main``; the finished run (its models)."""
    module = importlib.import_module(SCRIPTS[kind])
    captured = {}

    class Capturing(getattr(module, TRAINERS[kind])):
        def finish(self, run):
            captured["run"], captured["trainer"] = run, self
            super().finish(run)

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    train_network.main(Capturing, module.setup_parser, argv)
    return captured["trainer"], captured["run"]


@pytest.fixture(scope="module")
def trained(tiny_models, dataset, tmp_path_factory):
    runs = {}

    def get(kind: str):
        if kind not in runs:
            output_dir = tmp_path_factory.mktemp(f"ti_{kind}")
            # 20 steps at 0.01: enough for the loss on fixed draws to go down on the tiny models
            trainer, run = train_capturing_run(kind, ti_argv(tiny_models, kind, dataset, output_dir,
                                                             "--learning_rate", "0.01", "--max_train_steps", "20"))
            runs[kind] = output_dir, trainer, run
        return runs[kind]
    return get


def fresh_models(tiny_models, kind: str):
    return model_loading.load_models(tiny_models[f"{kind}_file"], sdxl=kind == "sdxl",
                                     model_config_dir=tiny_models[f"{kind}_config"])


def hidden_states(tokenizer, encoder, prompt: str) -> torch.Tensor:
    ids = tokenizer([prompt], padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                    return_tensors="pt").input_ids
    with torch.no_grad():
        return encoder(ids, output_hidden_states=True).hidden_states[-2]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_the_file_is_kohyas_and_diffusers_loads_it_as_trained(kind, trained, tiny_models):
    output_dir, _, run = trained(kind)
    path = output_dir / "emb.safetensors"
    keys = embeddings.SDXL_FILE_KEYS if kind == "sdxl" else embeddings.SD_FILE_KEYS
    with safe_open(str(path), "pt") as file:
        metadata = file.metadata()
        assert tuple(file.keys()) == tuple(sorted(keys))
        saved = {key: file.get_tensor(key) for key in keys}
    assert all(key.startswith("modelspec.") for key in metadata), metadata  # kohya writes only the model spec
    assert metadata["modelspec.architecture"].endswith("/textual-inversion")
    for key, encoder in zip(keys, run.models.text_encoders):
        assert saved[key].shape == (2, encoder.config.hidden_size)

    models = fresh_models(tiny_models, kind)
    pipeline = sampling.build_pipeline(models, sampling.make_scheduler("ddim", models.scheduler_config))
    if kind == "sdxl":  # one call per encoder, as diffusers documents for SDXL embeddings
        state = load_file(path)
        pipeline.load_textual_inversion(state["clip_l"], token="zqx", text_encoder=pipeline.text_encoder,
                                        tokenizer=pipeline.tokenizer)
        pipeline.load_textual_inversion(state["clip_g"], token="zqx", text_encoder=pipeline.text_encoder_2,
                                        tokenizer=pipeline.tokenizer_2)
    else:
        pipeline.load_textual_inversion(str(path), token="zqx")
    pipelines_encoders = [pipeline.text_encoder] + ([pipeline.text_encoder_2] if kind == "sdxl" else [])
    pipelines_tokenizers = [pipeline.tokenizer] + ([pipeline.tokenizer_2] if kind == "sdxl" else [])
    for key, tokenizer, encoder, run_tokenizer, run_encoder in zip(
            keys, pipelines_tokenizers, pipelines_encoders, run.models.tokenizers, run.models.text_encoders):
        prompt = pipeline.maybe_convert_prompt("a photo of zqx", tokenizer)  # diffusers' names: zqx zqx_1
        assert prompt == "a photo of zqx zqx_1"
        ids = tokenizer.convert_tokens_to_ids(["zqx", "zqx_1"])
        assert torch.equal(encoder.get_input_embeddings().weight[ids], saved[key])  # the file's vectors
        # the run's encoders (its tokens, its trained vectors) and diffusers' give the same hidden states
        assert torch.equal(hidden_states(tokenizer, encoder, prompt),
                           hidden_states(run_tokenizer, run_encoder, "a photo of zqx zqx1"))
        # and training moved the vectors: they are not the --init_word's any more
        table = embeddings.token_embedding_module(run_encoder).token_embedding.original.weight
        initial = embeddings.initial_vectors(run_tokenizer, table, 2, "red", 1)
        assert (saved[key] - initial).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_everything_else_of_the_models_is_bit_identical(kind, trained, tiny_models):
    _, _, run = trained(kind)
    models = fresh_models(tiny_models, kind)
    for fresh, used in [*zip(models.text_encoders, run.models.text_encoders), (models.unet, run.models.unet)]:
        used_state = {key.replace("token_embedding.original.", "token_embedding."): value
                      for key, value in used.state_dict().items()}
        fresh_state = fresh.state_dict()
        assert used_state.keys() == fresh_state.keys()
        for key, value in fresh_state.items():
            assert torch.equal(used_state[key].cpu(), value), key


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_the_loss_on_fixed_draws_goes_down(kind, trained):
    """The training images' loss at fixed timesteps and noise, with the trained vectors and with the initial
    (--init_word) ones: training lowered it."""
    _, trainer, run = trained(kind)
    module = run.trainable.module
    trained_vectors = {key: value.clone() for key, value in module.training_state_dict().items()}
    initial = {key: embeddings.initial_vectors(
        tokenizer, embeddings.token_embedding_module(encoder).token_embedding.original.weight, 2, "red", 1)
        for key, tokenizer, encoder in zip(module.keys, run.models.tokenizers, run.models.text_encoders)}

    def fixed_loss() -> float:
        random.seed(0)  # the template drawn for each caption
        total = []
        with torch.no_grad():
            for batch in run.data.loader:
                batch = send_to_device(batch, run.device)
                for timestep in (200, 500, 800):
                    timesteps = torch.full((len(batch["sample_indices"]),), timestep, dtype=torch.long)
                    total.append(trainer.validation_loss(run.loss, batch, timesteps, 1, 0)[0].item())
        return sum(total) / len(total)

    after = fixed_loss()
    module.load_training_state_dict(initial)
    before = fixed_loss()
    module.load_training_state_dict(trained_vectors)
    assert after < before, (before, after)


@pytest.mark.slow
def test_killed_then_resumed_gives_the_uninterrupted_bytes(tiny_models, dataset, tmp_path):
    """The killed run is a process of its own (kill -9); the reference and the resumed run are the same script
    run as ``__main__`` in this process, with the subprocess's SOURCE_DATE_EPOCH (the files' dates)."""
    def argv(output_dir: Path, *extra: str) -> list[str]:
        return [sys.executable, str(REPO / "train_textual_inversion.py"), *ti_argv(
            tiny_models, "sd15", dataset, output_dir, "--save_state", "--save_every_n_steps", "1", *extra)]

    def run_here(command: list[str]) -> subprocess.CompletedProcess:
        return run_script_as_main(command, REPO, env={"SOURCE_DATE_EPOCH": SCRIPT_ENV["SOURCE_DATE_EPOCH"]})

    run_here(argv(tmp_path / "reference"))
    killed = subprocess.run(argv(tmp_path / "resumed", "--debug_kill_in_state_write", "4"), cwd=REPO, env=SCRIPT_ENV,
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, (killed.stdout + killed.stderr)[-3000:]
    resumed = run_here(argv(tmp_path / "resumed", "--resume", "auto"))
    assert "resumed at step 3 " in resumed.stdout
    assert resumed.stdout.strip().splitlines()[-1].startswith("done: 6 steps")
    for name in ("emb.safetensors", "emb-step00000005.safetensors"):
        assert (tmp_path / "resumed" / name).read_bytes() == (tmp_path / "reference" / name).read_bytes(), name


@pytest.mark.parametrize("extra, message", [
    ((), "--token_string is required"),
    (("--token_string", "zqx", "--num_vectors_per_token", "0"), "--num_vectors_per_token 0 must be"),
    (("--token_string", "zqx", "--use_object_template", "--use_style_template"), "exclude each other"),
    (("--token_string", "zqx", "--weights", "missing.safetensors"), "--weights missing.safetensors: no such file"),
])
def test_bad_options_are_one_line_before_loading(extra, message, tiny_models, dataset, tmp_path, capsys):
    argv = model_args(tiny_models, "sd15") + ["--train_data_dir", str(dataset), "--output_dir", str(tmp_path), *extra]
    assert message in train_expecting_user_error(argv, capsys, "train_textual_inversion")


def test_a_token_the_tokenizer_knows_is_refused(tiny_models, dataset, tmp_path, capsys):
    known = "a"  # a token of every CLIP vocabulary
    assert known in fresh_models(tiny_models, "sdxl").tokenizers[0].get_vocab()
    argv = ti_argv(tiny_models, "sdxl", dataset, tmp_path)
    argv[argv.index("zqx")] = known
    error = train_expecting_user_error(argv, capsys, "sdxl_train_textual_inversion")
    assert f"--token_string {known}: tokenizer 1 already knows" in error


def test_weights_of_another_vector_count_are_refused(tiny_models, dataset, tmp_path, capsys):
    from safetensors.torch import save_file

    weights = tmp_path / "three.safetensors"
    save_file({"emb_params": torch.zeros(3, 32)}, str(weights))
    argv = ti_argv(tiny_models, "sd15", dataset, tmp_path, "--weights", str(weights))
    error = train_expecting_user_error(argv, capsys, "train_textual_inversion")
    assert "emb_params holds 3 vectors of width 32; this run trains 2 (--num_vectors_per_token)" in error


def test_lora_options_are_not_textual_inversion_options():
    import train_textual_inversion
    from library.errors import UserError

    with pytest.raises(UserError, match="--network_dim"):
        train_textual_inversion.setup_parser().parse_args(["--network_dim", "4"])
    assert train_textual_inversion.setup_parser().parse_args([]).save_model_as == "pt"  # kohya's default


@pytest.mark.slow
def test_kohyas_default_pt_file_is_a_plain_tensor_dict(tiny_models, dataset, tmp_path):
    """``--save_model_as pt`` (kohya's default): ``{"emb_params": [vectors, width]}`` that
    ``torch.load(weights_only=True)`` reads (as ComfyUI's embedding loader and A1111 do)."""
    from conftest import run_trainer

    argv = ti_argv(tiny_models, "sd15", dataset, tmp_path, "--max_train_steps", "2")
    argv.remove("--save_model_as"), argv.remove("safetensors")
    run_trainer("train_textual_inversion", argv)
    state = torch.load(tmp_path / "emb.pt", weights_only=True)
    assert list(state) == ["emb_params"] and state["emb_params"].shape == (2, 32)
    assert state["emb_params"].dtype == torch.float32


def test_the_trainable_has_every_hook_the_core_calls():
    import sdxl_train_textual_inversion
    from library.trainables.base import Trainable
    from library.training.trainer import Trainer

    hooks = {name for name, value in vars(Trainable).items() if callable(value) and not name.startswith("_")}
    trainer = sdxl_train_textual_inversion.SdxlTextualInversionTrainer()
    assert isinstance(trainer, Trainer) and type(trainer).train is Trainer.train and trainer.is_sdxl
    missing = {name for name in hooks if not callable(getattr(trainer.trainable, name, None))}
    assert not missing, sorted(missing)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_sample_prompts_get_the_token_string_expanded(kind, tiny_models, dataset, tmp_path):
    """kohya's prompt_replacement: with --num_vectors_per_token 2 the token string in a sample prompt (and
    its negative prompt) becomes ``zqx zqx1``, so every text encoder receives both new token ids."""
    module = importlib.import_module(SCRIPTS[kind])
    received, new_ids = [], []

    class Recording(getattr(module, TRAINERS[kind])):
        def after_start(self, run):  # the --sample_at_first images: the only encoder calls in it
            def record(encoder, args, kwargs):
                received.append((encoder, (args[0] if args else kwargs["input_ids"]).tolist()))
            handles = [encoder.register_forward_pre_hook(record, with_kwargs=True)
                       for encoder in run.models.text_encoders]
            new_ids.extend(tokenizer.convert_tokens_to_ids(TOKENS) for tokenizer in run.models.tokenizers)
            try:
                super().after_start(run)
            finally:
                for handle in handles:
                    handle.remove()

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of zqx on a table --n zqx, blurry --w 64 --h 64 --s 1 --d 3\n")
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    train_network.main(Recording, module.setup_parser, ti_argv(
        tiny_models, kind, dataset, tmp_path, "--max_train_steps", "1", "--sample_at_first",
        "--sample_prompts", str(prompts)))
    assert len(received) == (2 if kind == "sdxl" else 1)  # one call per encoder: the prompt and its negative
    for (encoder, rows), ids in zip(received, new_ids):
        assert len(rows) == 2
        for row in rows:  # "zqx" -> "zqx zqx1": the two new ids side by side, once each
            assert row.count(ids[0]) == 1 and row.count(ids[1]) == 1
            assert row[row.index(ids[0]) + 1] == ids[1]
    assert len(list((tmp_path / "sample").glob("*.png"))) == 1


def test_no_prompt_replacement_for_one_vector():
    trainable = embeddings.EmbeddingTrainable()
    trainable.config = type("Config", (), {"tokens": ["zqx"], "token_string": "zqx"})()
    assert trainable.prompt_replacement() is None
    trainable.config.tokens = ["zqx", "zqx1", "zqx2"]
    assert trainable.prompt_replacement() == ("zqx", "zqx zqx1 zqx2")
    prompt = sampling.SamplePrompt(index=0, prompt="zqx at night", negative_prompt="zqx, blurry")
    assert sampling.replaced_in_prompt(prompt, trainable.prompt_replacement()) == sampling.SamplePrompt(
        index=0, prompt="zqx zqx1 zqx2 at night", negative_prompt="zqx zqx1 zqx2, blurry")
