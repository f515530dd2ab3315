"""The textual inversion trainable: new token embeddings learned for frozen text encoders.

kohya's ``train_textual_inversion.py`` / ``sdxl_train_textual_inversion.py``: ``--token_string``
adds ``--num_vectors_per_token`` tokens (``tok``, ``tok1``, ``tok2``, ...) to every tokenizer; only
their vectors train. kohya resizes the embedding table and restores its old rows after every step;
here the new vectors are a separate parameter per text encoder, looked up by a wrapper around the
encoder's token embedding, so the encoders' own weights are never written to (bit-identical) and
the optimizer holds nothing else. Files are kohya's: ``emb_params`` (SD 1.x/2.x) or ``clip_l`` /
``clip_g`` (SDXL), ``[num_vectors, width]`` tensors, with kohya's ``modelspec.*`` metadata only.
"""
from __future__ import annotations

import argparse
import os
import random
from typing import Any, Mapping, Optional

import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from library import checkpoint_files, lora_files, lora_metadata
from library.errors import UserError, first_line
from library.model_loading import StableDiffusionModels
from library.trainables import lora
from library.trainables.base import Trainable

# The prompt templates of the textual inversion paper's code (kohya's ``imagenet_templates_small`` /
# ``imagenet_style_templates_small``): with a template option each caption is one of these, drawn anew.
OBJECT_TEMPLATES = (
    "a photo of a {}", "a rendering of a {}", "a cropped photo of the {}", "the photo of a {}",
    "a photo of a clean {}", "a photo of a dirty {}", "a dark photo of the {}", "a photo of my {}",
    "a photo of the cool {}", "a close-up photo of a {}", "a bright photo of the {}", "a cropped photo of a {}",
    "a photo of the {}", "a good photo of the {}", "a photo of one {}", "a close-up photo of the {}",
    "a rendition of the {}", "a photo of the clean {}", "a rendition of a {}", "a photo of a nice {}",
    "a good photo of a {}", "a photo of the nice {}", "a photo of the small {}", "a photo of the weird {}",
    "a photo of the large {}", "a photo of a cool {}", "a photo of a small {}",
)
STYLE_TEMPLATES = (
    "a painting in the style of {}", "a rendering in the style of {}", "a cropped painting in the style of {}",
    "the painting in the style of {}", "a clean painting in the style of {}", "a dirty painting in the style of {}",
    "a dark painting in the style of {}", "a picture in the style of {}", "a cool painting in the style of {}",
    "a close-up painting in the style of {}", "a bright painting in the style of {}",
    "a cropped painting in the style of {}", "a good painting in the style of {}",
    "a close-up painting in the style of {}", "a rendition in the style of {}", "a nice painting in the style of {}",
    "a small painting in the style of {}", "a weird painting in the style of {}",
    "a large painting in the style of {}",
)
SD_FILE_KEYS = ("emb_params",)  # kohya's SD 1.x/2.x embedding file (A1111 and ComfyUI read it)
SDXL_FILE_KEYS = ("clip_l", "clip_g")  # kohya's SDXL embedding file: one tensor per text encoder


def add_embedding_arguments(parser: argparse.ArgumentParser) -> None:
    """kohya's textual inversion options."""
    parser.add_argument("--token_string", type=str, default=None,
                        help="the word captions use for the new embedding (required); it must not be a token the "
                             "tokenizer knows. With --num_vectors_per_token N the tokens token_string, "
                             "token_string1 ... token_string{N-1} are added")
    parser.add_argument("--init_word", type=str, default=None,
                        help="word(s) whose token vectors initialise the new ones (repeated or truncated to "
                             "--num_vectors_per_token, as kohya). Default: the mean of the vocabulary's vectors")
    parser.add_argument("--num_vectors_per_token", type=int, default=1,
                        help="vectors (tokens) the embedding has (default 1)")
    parser.add_argument("--weights", type=str, default=None,
                        help="an embedding file to continue training from (kohya's emb_params / clip_l+clip_g, "
                             "or A1111's string_to_param)")
    parser.add_argument("--use_object_template", action="store_true",
                        help="ignore the captions: train with kohya's object templates ('a photo of a {}')")
    parser.add_argument("--use_style_template", action="store_true",
                        help="ignore the captions: train with kohya's style templates ('a painting in the style of {}')")


def lora_option_defaults() -> dict[str, Any]:
    """The LoRA options' defaults: what the shared checks and the state's protected options read of
    them (a textual inversion run has no LoRA: its command line does not take these options)."""
    parser = argparse.ArgumentParser(add_help=False)
    lora.add_network_arguments(parser)
    return vars(parser.parse_args([]))


def validate_arguments(args: argparse.Namespace, sdxl: bool) -> None:
    """The embedding's options, then the run's shared checks (``lora.validate_arguments`` with no LoRA
    options given); before anything is loaded."""
    if not args.token_string or not args.token_string.strip():
        raise UserError("--token_string is required: the new word the captions use for the embedding, e.g. "
                        "--token_string mychar (a word the tokenizer does not know)")
    if any(character.isspace() for character in args.token_string):
        raise UserError(f"--token_string {args.token_string!r}: give one word without spaces (it becomes tokens "
                        f"of the tokenizer)")
    if args.num_vectors_per_token < 1:
        raise UserError(f"--num_vectors_per_token {args.num_vectors_per_token} must be a positive integer")
    if args.use_object_template and args.use_style_template:
        raise UserError("--use_object_template and --use_style_template exclude each other: choose one template set")
    if args.init_word is not None and not args.init_word.strip():
        raise UserError("--init_word is empty: give a word (e.g. --init_word woman) or leave the option out")
    if getattr(args, "cache_text_encoder_outputs", False):
        raise UserError("--cache_text_encoder_outputs: textual inversion trains the text encoders' input (the new "
                        "tokens), their outputs cannot be cached; remove the option")
    if args.debiased_loss:
        raise UserError("--debiased_loss needs a LoRA (it turns the network off for its reference pass); "
                        "textual inversion has none: remove the option")
    if args.find_lr or args.find_lr_only:
        raise UserError("--find_lr: the learning-rate range test measures against the LoRA turned off; textual "
                        "inversion has no LoRA: remove the option")
    if args.weights and not os.path.isfile(args.weights):
        raise UserError(f"--weights {args.weights}: no such file (an embedding file to continue training from)")
    if args.output_name is None:
        args.output_name = args.token_string  # kohya's default file name
    lora.validate_arguments(args, sdxl)


def token_strings(token_string: str, count: int) -> list[str]:
    """kohya's new tokens: ``tok``, ``tok1``, ``tok2``, ..."""
    return [token_string] + [f"{token_string}{index}" for index in range(1, count)]


class EmbeddingConfig:
    """The embedding options, resolved once."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.token_string: str = args.token_string
        self.tokens: list[str] = token_strings(args.token_string, args.num_vectors_per_token)
        self.init_word: Optional[str] = args.init_word
        self.weights: Optional[str] = args.weights
        self.templates: Optional[tuple[str, ...]] = (
            OBJECT_TEMPLATES if args.use_object_template else STYLE_TEMPLATES if args.use_style_template else None)
        self.full_precision = bool(args.full_fp16 or args.full_bf16)
        self.learning_rate: float = args.learning_rate


class NewTokenEmbeddings(torch.nn.Module):
    """The trained vectors: one ``[num_vectors, width]`` parameter per text encoder, under the file's key."""

    def __init__(self, vectors: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.keys = list(vectors)
        self.vectors = torch.nn.ParameterList([torch.nn.Parameter(value.detach().clone().float())
                                               for value in vectors.values()])

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """The file's tensors (the name ``library.lora_files.LoraWriter`` asks for)."""
        return {key: vector.detach() for key, vector in zip(self.keys, self.vectors)}

    def training_state_dict(self) -> dict[str, torch.Tensor]:
        return self.lora_state_dict()

    def load_training_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        shapes = {key: tuple(value.shape) for key, value in state.items()}
        ours = {key: tuple(vector.shape) for key, vector in zip(self.keys, self.vectors)}
        if shapes != ours:  # e.g. resumed with another --num_vectors_per_token
            raise UserError(f"the state's embedding holds {shapes}, this run trains {ours} (--num_vectors_per_token "
                            f"and the model must be the state's)")
        with torch.no_grad():
            for key, vector in zip(self.keys, self.vectors):
                vector.copy_(state[key])


class TokenEmbeddingWithNewTokens(torch.nn.Module):
    """A text encoder's token embedding extended by the new tokens (ids from ``first_id`` on): their
    vectors come from the trained parameter, every other id from the frozen table as it is. The
    parameter is held outside the module tree, so moving or freezing the text encoder leaves it be."""

    def __init__(self, original: torch.nn.Embedding, first_id: int, vectors: torch.nn.Parameter) -> None:
        super().__init__()
        self.original = original
        self.first_id = first_id
        self.new_vectors = (vectors,)  # a tuple: not registered as the text encoder's parameter

    @property
    def weight(self) -> torch.Tensor:  # what callers of ``get_input_embeddings().weight`` read (dtype, device)
        return self.original.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        vectors = self.new_vectors[0]
        is_new = input_ids >= self.first_id
        known = self.original(torch.where(is_new, torch.zeros_like(input_ids), input_ids))
        new = vectors[(input_ids - self.first_id).clamp(0, vectors.shape[0] - 1)].to(known.dtype)
        return torch.where(is_new.unsqueeze(-1), new, known)


def token_embedding_module(text_encoder: torch.nn.Module) -> torch.nn.Module:
    """The ``CLIPTextEmbeddings`` holding ``token_embedding`` (transformers 4 and 5)."""
    return getattr(text_encoder, "text_model", text_encoder).embeddings


def add_tokens(tokenizer, tokens: list[str], encoder_number: int) -> list[int]:
    """Add ``tokens`` to ``tokenizer``; their ids (consecutive, after the vocabulary). A token the
    tokenizer knows is refused, as kohya does."""
    vocabulary = tokenizer.get_vocab()
    known = [token for token in tokens if token in vocabulary]
    if known:
        raise UserError(f"--token_string {tokens[0]}: tokenizer {encoder_number} already knows {', '.join(known)}; "
                        f"choose a word it does not know (e.g. a made-up one)")
    first_id = len(tokenizer)
    tokenizer.add_tokens(tokens)
    ids = tokenizer.convert_tokens_to_ids(tokens)
    if ids != list(range(first_id, first_id + len(tokens))):
        raise UserError(f"--token_string {tokens[0]}: tokenizer {encoder_number} gave the new tokens ids {ids}, "
                        f"not the next ones after its {first_id} tokens; choose another word")
    return ids


def initial_vectors(tokenizer, table: torch.Tensor, count: int, init_word: Optional[str],
                    encoder_number: int) -> torch.Tensor:
    """``init_word``'s token vectors repeated or truncated to ``count`` (kohya's rule, said in one line
    when the lengths differ); without it the vocabulary's mean vector (what transformers' mean-resizing
    gives kohya's new rows)."""
    if init_word is None:
        return table.float().mean(dim=0, keepdim=True).repeat(count, 1)
    ids = tokenizer.encode(init_word, add_special_tokens=False)
    if not ids:
        raise UserError(f"--init_word {init_word!r}: tokenizer {encoder_number} makes no tokens of it; give a word")
    if len(ids) > 1 and len(ids) != count:
        print(f"--init_word {init_word!r} is {len(ids)} tokens for tokenizer {encoder_number}, "
              f"--num_vectors_per_token {count}: its vectors are repeated or truncated (as kohya)")
    return torch.stack([table[ids[index % len(ids)]].float() for index in range(count)])


def read_embedding_file(path: str, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """An embedding file's vectors by file key (kohya's ``load_weights``): SDXL ``clip_l`` / ``clip_g``;
    SD the file's first tensor (``emb_params``, or A1111's ``string_to_param``)."""
    try:
        if checkpoint_files.is_safetensors(path):
            data = load_file(path)
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # damaged or foreign files raise several types
        raise UserError(f"--weights {path}: not an embedding file ({first_line(error)})") from None
    if isinstance(data, dict) and "string_to_param" in data:
        data = data["string_to_param"]
    if not isinstance(data, dict) or not data:
        raise UserError(f"--weights {path}: not an embedding file (no tensors)")
    if len(keys) == 1:
        vectors = {keys[0]: next(iter(data.values()))}
    else:
        missing = [key for key in keys if key not in data]
        if missing:
            raise UserError(f"--weights {path}: an SDXL embedding file holds {' and '.join(keys)}; this one lacks "
                            f"{', '.join(missing)} (it holds {', '.join(sorted(map(str, data)))})")
        vectors = {key: data[key] for key in keys}
    for key, value in vectors.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise UserError(f"--weights {path}: {key} is not a tensor of vectors")
        vectors[key] = value.unsqueeze(0) if value.dim() == 1 else value
    return vectors


class EmbeddingTrainable(Trainable):
    """New token embeddings trained on the family's text encoders (``library.trainables.base.Trainable``)."""

    kind = "embedding"
    writes_models = False

    def __init__(self) -> None:
        self.config: Optional[EmbeddingConfig] = None
        self.module: Optional[NewTokenEmbeddings] = None
        self.token_ids: list[list[int]] = []  # per tokenizer

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_embedding_arguments(parser)

    def validate_arguments(self, args: argparse.Namespace, sdxl: bool) -> None:
        validate_arguments(args, sdxl)

    def configure(self, args: argparse.Namespace) -> None:
        self.config = EmbeddingConfig(args)

    def parts(self) -> tuple[bool, bool]:
        return False, True  # the text encoders' forward records gradients (for the new vectors)

    # -- building ----------------------------------------------------------------------------
    def attach(self, models: StableDiffusionModels, unet_module_names: Optional[dict[str, str]]) -> None:
        """The tokens added to every tokenizer, their vectors initialised (``--init_word``) or read
        (``--weights``), and every text encoder's token embedding wrapped to look them up."""
        config = self.config
        keys = SDXL_FILE_KEYS if models.is_sdxl else SD_FILE_KEYS
        vectors = {}
        for number, (key, tokenizer, encoder) in enumerate(zip(keys, models.tokenizers, models.text_encoders), 1):
            table = token_embedding_module(encoder).token_embedding.weight.detach()
            self.token_ids.append(add_tokens(tokenizer, config.tokens, number))
            vectors[key] = initial_vectors(tokenizer, table, len(config.tokens), config.init_word, number)
        if config.weights:
            loaded = read_embedding_file(config.weights, keys)
            for key, value in loaded.items():
                if value.shape != vectors[key].shape:
                    raise UserError(f"--weights {config.weights}: {key} holds {value.shape[0]} vectors of width "
                                    f"{value.shape[1]}; this run trains {vectors[key].shape[0]} "
                                    f"(--num_vectors_per_token) of width {vectors[key].shape[1]}")
            vectors = loaded
            print(f"embedding weights loaded from {config.weights}")
        self.module = NewTokenEmbeddings(vectors)
        for encoder, ids, vector in zip(models.text_encoders, self.token_ids, self.module.vectors):
            embeddings = token_embedding_module(encoder)
            embeddings.token_embedding = TokenEmbeddingWithNewTokens(embeddings.token_embedding, ids[0], vector)
        print(f"textual inversion: {len(config.tokens)} new token(s) {' '.join(config.tokens)} "
              f"(ids {', '.join(str(ids) for ids in self.token_ids)})")

    def place(self, device: torch.device, autocast_dtype: torch.dtype) -> None:
        self.module.to(device, dtype=autocast_dtype if self.config.full_precision else None)
        self.module.requires_grad_(True)

    def records_text_encoder_gradients(self) -> bool:
        return True

    def param_groups(self) -> list[dict[str, Any]]:
        if not self.config.learning_rate > 0:
            raise UserError(f"--learning_rate {self.config.learning_rate}: the embedding trains with it; give a "
                            f"positive value")
        return [{"params": list(self.module.parameters()), "lr": self.config.learning_rate}]

    def captions(self, captions: list[str]) -> list[str]:
        """kohya's caption rewrite: a random template each (``--use_*_template``), or the token string
        expanded to all its tokens (``tok`` -> ``tok tok1 tok2``)."""
        tokens = " ".join(self.config.tokens)
        if self.config.templates:
            return [random.choice(self.config.templates).format(tokens) for _ in captions]
        replacement = self.prompt_replacement()
        if replacement is None:
            return captions
        return [caption.replace(*replacement) for caption in captions]

    def prompt_replacement(self) -> Optional[tuple[str, str]]:
        """(token string, all its tokens) with ``--num_vectors_per_token`` > 1, else None: what kohya
        replaces in captions without a template and in sample prompts."""
        if len(self.config.tokens) == 1:
            return None
        return self.config.token_string, " ".join(self.config.tokens)

    def metadata(self, args: argparse.Namespace, accelerator: Accelerator, models: StableDiffusionModels,
                 data: Any, optimization: Any, progress: Any) -> dict[str, str]:
        """kohya's embedding files carry its model spec only (architecture ``.../textual-inversion``)."""
        return lora_metadata.modelspec_metadata(args, models.kind, data.dataset.resolution_hw,
                                                progress.training_started_at, adapter="textual-inversion")

    def writer(self, args: argparse.Namespace, metadata: dict[str, str], ema_average: Any, current_metadata: Any,
               resumed: bool) -> lora_files.LoraWriter:
        writer = lora_files.LoraWriter(args, metadata, ema_average, current_metadata=current_metadata,
                                       modelspec_only=True)
        writer.trained = resumed or bool(self.config.weights)
        return writer

    # -- during the run ------------------------------------------------------------------------
    def weights_finite(self) -> bool:
        return bool(torch.stack([torch.isfinite(vector).all() for vector in self.module.vectors]).all())

    def check_written(self, path: str, save_dtype: Optional[torch.dtype]) -> None:
        """The file re-read holds the trained vectors (in the saved dtype)."""
        written = read_embedding_file(path, tuple(self.module.keys))
        for key, vector in self.module.lora_state_dict().items():
            expected = vector.cpu().to(save_dtype or vector.dtype)
            if not torch.equal(written[key].to(expected.dtype), expected):
                print(f"warning: {path}: {key} differs from the trained vectors", flush=True)

    def weights_for_report(self) -> dict[str, torch.Tensor]:
        return self.module.lora_state_dict()
