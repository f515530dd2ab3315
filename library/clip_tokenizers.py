"""The CLIP tokenizers of SD1.x, SD2.x and SDXL, found where kohya finds them (offline first).

Looked up in the model folder, then ``--tokenizer_cache_dir/<repo with "/" -> "_">``,
then the hub (only when online). ``tools/build_clip_tokenizers.py`` builds the cache
folders offline.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from library.checkpoint_keys import ModelKind
from library.errors import UserError, first_line

if TYPE_CHECKING:
    from transformers import CLIPTokenizer

# Where kohya takes each tokenizer from: (hub repo, subfolder in the repo, pad token).
# With --tokenizer_cache_dir kohya keeps them in DIR/<repo with "/" -> "_">.
TOKENIZER_SOURCES: dict[str, list[tuple[str, str | None, str | None]]] = {
    "sd1": [("openai/clip-vit-large-patch14", None, None)],
    "sd2": [("stabilityai/stable-diffusion-2", "tokenizer", "!")],
    "sdxl": [("openai/clip-vit-large-patch14", None, None),
             ("laion/CLIP-ViT-bigG-14-laion2B-39B-b160k", None, "!")],
}
CLIP_MAX_LENGTH = 77


def _hub_offline() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def load_tokenizers(kind: ModelKind, *, model_dir: str | os.PathLike | None = None,
                    tokenizer_cache_dir: str | os.PathLike | None = None) -> list[CLIPTokenizer]:
    """The CLIP tokenizer(s) of ``kind``, max length 77.

    Looked up in order: ``model_dir/tokenizer`` (``tokenizer_2``), then
    ``tokenizer_cache_dir/<kohya name>``, then the hub repo kohya uses (only
    when online; the result is then saved into ``tokenizer_cache_dir`` like
    kohya does). SDXL tokenizer 2 and SD2's tokenizer pad with ``"!"``.
    """
    from transformers import CLIPTokenizer

    tokenizers = []
    for index, (repo, hub_subfolder, pad_token) in enumerate(TOKENIZER_SOURCES[kind]):
        local_name = "tokenizer" if index == 0 else f"tokenizer_{index + 1}"
        cache_name = repo.replace("/", "_")
        candidates = []
        if model_dir is not None:
            candidates.append((Path(model_dir) / local_name, "--pretrained_model_name_or_path/--model_config_dir"))
        if tokenizer_cache_dir is not None:
            candidates.append((Path(tokenizer_cache_dir) / cache_name, "--tokenizer_cache_dir"))
        tokenizer = None
        for folder, flag in candidates:
            if folder.is_dir():
                try:
                    tokenizer = CLIPTokenizer.from_pretrained(folder, local_files_only=True)
                except (OSError, ValueError) as error:
                    raise UserError(f"{flag}: cannot load a CLIP tokenizer from {folder}: "
                                    f"{first_line(error)}") from error
                break
        if tokenizer is None:
            tokenizer = _tokenizer_from_hub(repo, hub_subfolder, cache_name, tokenizer_cache_dir)
        if tokenizer.model_max_length > 1_000_000:  # a bare vocab.json/merges.txt folder has no limit set
            tokenizer.model_max_length = CLIP_MAX_LENGTH
        if pad_token is not None:
            tokenizer = set_pad_token(tokenizer, pad_token)
        tokenizers.append(tokenizer)
    return tokenizers


def set_pad_token(tokenizer: CLIPTokenizer, pad_token: str) -> CLIPTokenizer:
    """``tokenizer`` padding with ``pad_token`` while still tokenizing that character in prompts as text.

    open_clip pads SDXL's second prompt (and SD2's) with id 0, ``"!"``, yet reads
    ``"!!"`` in a prompt as ordinary BPE. transformers 5 registers a configured
    pad token as a special token and cuts it out of the text, so
    ``"masterpiece!!"`` would lose its tokens. A tokenizer in that state is
    rebuilt from its own vocab and merges; the pad token is then set through
    the attribute, which does not register it. Returns the (possibly new) tokenizer.
    """
    from transformers import CLIPTokenizer

    own_specials = {tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token}
    if pad_token in tokenizer.get_added_vocab() and pad_token not in own_specials:
        model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
        tokenizer = CLIPTokenizer(vocab=model["vocab"], merges=merges, model_max_length=tokenizer.model_max_length)
    tokenizer.pad_token = pad_token
    return tokenizer


def _tokenizer_from_hub(repo: str, subfolder: str | None, cache_name: str,
                        tokenizer_cache_dir: str | os.PathLike | None):
    from transformers import CLIPTokenizer

    build_hint = ("build the tokenizers offline with `python tools/build_clip_tokenizers.py --out DIR` "
                  "and pass --tokenizer_cache_dir DIR")
    if tokenizer_cache_dir is None:
        where = "no --tokenizer_cache_dir was given"
    else:
        where = f"--tokenizer_cache_dir {tokenizer_cache_dir} has no {cache_name}/ folder"
    if _hub_offline():
        raise UserError(f"--tokenizer_cache_dir: no tokenizer for {repo} ({where}, hub is offline); {build_hint}")
    try:
        tokenizer = CLIPTokenizer.from_pretrained(repo, subfolder=subfolder)
    except (OSError, ValueError) as error:
        raise UserError(f"--tokenizer_cache_dir: no tokenizer for {repo} ({where}) and the hub failed: "
                        f"{first_line(error)}; {build_hint}") from error
    if tokenizer_cache_dir is not None:
        tokenizer.save_pretrained(Path(tokenizer_cache_dir) / cache_name)
    return tokenizer
