"""Prompt tokenisation and text encoding as kohya-ss sd-scripts does it, including ``--max_token_length``.

CLIP reads 77 tokens (<BOS>, 75 tokens, <EOS>). With ``--max_token_length`` 150 or
225 a caption is tokenised to 152 or 227 tokens and cut into 2 or 3 chunks of
``<BOS> + 75 tokens + <EOS/PAD>``, each encoded separately. kohya's chunk fix for
tokenizers that pad with a token other than <EOS> (SD2, SDXL's second tokenizer):
a chunk whose last real token is cut off ends in <EOS>, and an empty chunk
(<BOS> <PAD> ...) starts <BOS> <EOS>. The hidden states are joined back into
``<BOS> + 75*n tokens + <EOS>`` (first <BOS>, the middles, last <EOS/PAD>).

SDXL: text encoder 1 gives its penultimate hidden states, text encoder 2 its
penultimate hidden states and the pooled output: the final hidden state at the first
<EOS> through ``text_projection`` (kohya's rule, independent of the transformers
version), taken from the first chunk only.

``--weighted_captions`` (kohya's rule): captions use A1111 attention syntax
(:func:`parse_weighted_caption`), each token gets the weight of the piece it came from
(:func:`tokenize_weighted`), and the hidden states above are multiplied per token by
those weights; the pooled output is not weighted.
"""
from __future__ import annotations

import argparse
import re
from typing import Optional

import torch

from library.errors import UserError

CLIP_CHUNK = 77
CLIP_TOKENS_PER_CHUNK = CLIP_CHUNK - 2

# One token of A1111 attention syntax: an escape (a lone backslash escapes nothing and
# vanishes), a bracket, ":<number>)" closing a round bracket with an explicit weight,
# plain text, or a ":" that is just text.
_ATTENTION_TOKEN = re.compile(r"\\[()\[\]\\]?|[()\[\]]|:([+-]?[.\d]+)\)|[^\\()\[\]:]+|:")
ROUND_BRACKET_WEIGHT = 1.1
SQUARE_BRACKET_WEIGHT = 1 / 1.1  # a multiplier, as in A1111/kohya (not a division: the floats differ)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max_token_length", type=int, default=None, choices=[75, 150, 225],
                        help="tokens per caption: 75 (CLIP's own, the default), 150 or 225 (kohya's chunking)")
    parser.add_argument("--weighted_captions", action="store_true",
                        help="read captions in A1111 attention syntax and weight the text encoder outputs per token "
                             "(kohya's rule): (word) x1.1, (word:1.3) x1.3, [word] /1.1, nesting multiplies, "
                             "\\( \\) \\[ \\] \\\\ are literal characters. Keep commas out of brackets when "
                             "shuffling or dropping tags. Default off: brackets are ordinary caption text")


def num_chunks(max_token_length: Optional[int]) -> int:
    """Chunks of 75 tokens per caption: 1 by default, 2 for 150, 3 for 225."""
    return 1 if not max_token_length else max_token_length // CLIP_TOKENS_PER_CHUNK


def tokenize(tokenizer, captions: list[str], max_token_length: Optional[int] = None) -> torch.Tensor:
    """Token ids of shape (batch, chunks, 77) following kohya's chunking rule."""
    length = CLIP_TOKENS_PER_CHUNK * num_chunks(max_token_length) + 2
    ids = tokenizer(captions, padding="max_length", truncation=True, max_length=length, return_tensors="pt").input_ids
    return split_chunks(ids, tokenizer)


def split_chunks(rows: torch.Tensor, tokenizer=None) -> torch.Tensor:
    """(batch, 75*n + 2) -> (batch, n, 77): each chunk is the row's first value, its next 75, the row's last.

    With ``tokenizer`` the rows are token ids and kohya's fix applies for tokenizers that
    pad with a token other than <EOS>; without it (per-token weights) values are only split.
    """
    if rows.shape[1] == CLIP_CHUNK:
        return rows.unsqueeze(1)
    eos, pad = getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "pad_token_id", None)
    fix_ends = tokenizer is not None and pad != eos
    rows_chunks = []
    for row in rows:
        row_chunks = []
        for start in range(1, rows.shape[1] - 1, CLIP_TOKENS_PER_CHUNK):
            chunk = torch.cat([row[:1], row[start : start + CLIP_TOKENS_PER_CHUNK], row[-1:]])
            if fix_ends:
                if chunk[-2] != eos and chunk[-2] != pad:
                    chunk[-1] = eos
                if chunk[1] == pad:
                    chunk[1] = eos
            row_chunks.append(chunk)
        rows_chunks.append(torch.stack(row_chunks))
    return torch.stack(rows_chunks)


def parse_weighted_caption(caption: str) -> list[tuple[str, float]]:
    """A caption in A1111 attention syntax as (text, weight) pieces, with the results of kohya's parser.

    ``(a)`` multiplies a's weight by 1.1, ``(a:1.3)`` by 1.3, ``[a]`` by 1/1.1; nesting
    multiplies. ``\\(``, ``\\)``, ``\\[``, ``\\]``, ``\\\\`` are literal characters. A bracket
    left open weighs everything after it, an unmatched closing bracket (or ``:1.3)``) is
    text. Neighbouring pieces of equal weight are joined; an empty caption is ``[("", 1.0)]``.
    Raises UserError for an explicit weight that is not a number (``(a:1.2.3)``).
    """
    pieces: list[list] = []  # [text, weight]; weights are multiplied in kohya's order, so the floats match
    open_round: list[int] = []  # index of the first piece inside each open bracket
    open_square: list[int] = []

    def scale_from(start: int, factor: float) -> None:
        for piece in pieces[start:]:
            piece[1] *= factor

    for match in _ATTENTION_TOKEN.finditer(caption):
        token, explicit_weight = match.group(0), match.group(1)
        if token.startswith("\\"):
            pieces.append([token[1:], 1.0])
        elif token == "(":
            open_round.append(len(pieces))
        elif token == "[":
            open_square.append(len(pieces))
        elif explicit_weight is not None and open_round:
            try:
                factor = float(explicit_weight)
            except ValueError:
                raise UserError(f"--weighted_captions: weight {explicit_weight!r} in caption {caption!r} is not "
                                f"a number") from None
            scale_from(open_round.pop(), factor)
        elif token == ")" and open_round:
            scale_from(open_round.pop(), ROUND_BRACKET_WEIGHT)
        elif token == "]" and open_square:
            scale_from(open_square.pop(), SQUARE_BRACKET_WEIGHT)
        else:
            pieces.append([token, 1.0])
    for start in open_round:
        scale_from(start, ROUND_BRACKET_WEIGHT)
    for start in open_square:
        scale_from(start, SQUARE_BRACKET_WEIGHT)
    joined: list[tuple[str, float]] = []
    for text, weight in pieces:
        if joined and joined[-1][1] == weight:
            joined[-1] = (joined[-1][0] + text, weight)
        else:
            joined.append((text, weight))
    return joined or [("", 1.0)]


def weighted_tokens(tokenizer, caption: str) -> tuple[list[int], list[float]]:
    """The token ids of a caption in attention syntax (no <BOS>/<EOS>, not cut) and each token's weight."""
    pieces = parse_weighted_caption(caption)
    # verbose=False: a long caption is cut by the callers, so the tokenizer's "too long" warning would mislead
    piece_ids = tokenizer([text for text, _ in pieces], add_special_tokens=False, verbose=False).input_ids
    ids = [token for tokens in piece_ids for token in tokens]
    weights = [weight for (_, weight), tokens in zip(pieces, piece_ids) for _ in tokens]
    return ids, weights


def tokenize_weighted(tokenizer, captions: list[str], max_token_length: Optional[int] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and float32 per-token weights, both (batch, chunks, 77), for captions in attention syntax.

    As kohya: each piece of :func:`parse_weighted_caption` is tokenised alone (so the syntax
    never reaches the tokenizer, and a word split by a bracket is two words), its tokens
    carry its weight; tokens beyond 75*chunks are cut; rows are ``<BOS> tokens <EOS> <PAD>...``
    with weight 1 for <BOS>, <EOS> and padding, chunked like :func:`tokenize`.
    """
    body_length = CLIP_TOKENS_PER_CHUNK * num_chunks(max_token_length)
    id_rows, weight_rows = [], []
    for caption in captions:
        ids, weights = weighted_tokens(tokenizer, caption)
        ids, weights = ids[:body_length], weights[:body_length]
        padding = body_length - len(ids)
        id_rows.append([tokenizer.bos_token_id, *ids, tokenizer.eos_token_id] + [tokenizer.pad_token_id] * padding)
        weight_rows.append([1.0, *weights, 1.0] + [1.0] * padding)
    return split_chunks(torch.tensor(id_rows), tokenizer), split_chunks(torch.tensor(weight_rows))


def _token_ids(tokenizer, captions: list[str], max_token_length: Optional[int], weighted: bool
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(ids, weights) from :func:`tokenize_weighted` when ``weighted``, else (ids from :func:`tokenize`, None)."""
    if weighted:
        return tokenize_weighted(tokenizer, captions, max_token_length)
    return tokenize(tokenizer, captions, max_token_length), None


def merge_chunks(hidden: torch.Tensor, chunks: int) -> torch.Tensor:
    """(batch*chunks, 77, D) -> (batch, 75*chunks + 2, D): first <BOS>, chunk middles, last <EOS/PAD>."""
    hidden = hidden.reshape(-1, chunks * CLIP_CHUNK, hidden.shape[-1])
    if chunks == 1:
        return hidden
    parts = [hidden[:, :1]]
    for start in range(1, chunks * CLIP_CHUNK, CLIP_CHUNK):
        parts.append(hidden[:, start : start + CLIP_TOKENS_PER_CHUNK])
    parts.append(hidden[:, -1:])
    return torch.cat(parts, dim=1)


def apply_token_weights(hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Joined hidden states (batch, 75n + 2, D) times per-token ``weights`` (batch, n, 77) joined the same way.

    The chunks' <BOS>/<EOS> weigh 1, as in kohya. The product is taken in float32 (kohya's
    weights are float32) and returned in ``hidden``'s dtype, so weighting never changes the
    dtype the UNet receives.
    """
    joined = merge_chunks(weights.reshape(-1, CLIP_CHUNK, 1), weights.shape[1]).to(hidden.device)
    return (hidden.float() * joined).to(hidden.dtype)


def encode_sd(tokenizer, text_encoder, captions: list[str], max_token_length: Optional[int] = None,
              clip_skip: Optional[int] = None, weighted: bool = False) -> torch.Tensor:
    """SD1.x/2.x conditioning: the last (or ``clip_skip``-th last, re-normalised) hidden states,
    weighted per token when ``weighted`` (captions in attention syntax)."""
    input_ids, weights = _token_ids(tokenizer, captions, max_token_length, weighted)
    chunks = input_ids.shape[1]
    flat = input_ids.reshape(-1, CLIP_CHUNK).to(text_encoder.device)
    if not clip_skip:
        hidden = text_encoder(flat)[0]
    else:
        output = text_encoder(flat, output_hidden_states=True)
        final_layer_norm = getattr(text_encoder, "text_model", text_encoder).final_layer_norm  # transformers 4 / 5
        hidden = final_layer_norm(output.hidden_states[-clip_skip])
    hidden = merge_chunks(hidden, chunks)
    return hidden if weights is None else apply_token_weights(hidden, weights)


def pooled_at_first_eos(text_encoder, last_hidden_state: torch.Tensor, input_ids: torch.Tensor,
                        eos_token_id: int) -> torch.Tensor:
    """kohya's pooled output: the final hidden state at the first <EOS>, through ``text_projection``."""
    eos_index = (input_ids == eos_token_id).int().argmax(dim=1).to(last_hidden_state.device)
    pooled = last_hidden_state[torch.arange(last_hidden_state.shape[0], device=last_hidden_state.device), eos_index]
    projection = text_encoder.text_projection
    return projection(pooled.to(projection.weight.dtype)).to(last_hidden_state.dtype)


def encode_sdxl_parts(tokenizers, text_encoders, captions: list[str], max_token_length: Optional[int] = None,
                      weighted: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SDXL's three outputs: hidden states of encoder 1 and 2 (penultimate layers) and the pooled output.
    With ``weighted`` both hidden states are weighted per token, the pooled output is not."""
    tokenizer1, tokenizer2 = tokenizers
    encoder1, encoder2 = text_encoders
    ids1, weights1 = _token_ids(tokenizer1, captions, max_token_length, weighted)
    ids2, weights2 = _token_ids(tokenizer2, captions, max_token_length, weighted)
    chunks = ids1.shape[1]
    flat1 = ids1.reshape(-1, CLIP_CHUNK).to(encoder1.device)
    flat2 = ids2.reshape(-1, CLIP_CHUNK).to(encoder2.device)
    hidden1 = encoder1(flat1, output_hidden_states=True).hidden_states[-2]
    output2 = encoder2(flat2, output_hidden_states=True)
    hidden2 = output2.hidden_states[-2]
    pooled = pooled_at_first_eos(encoder2, output2.last_hidden_state, flat2, tokenizer2.eos_token_id)
    hidden1, hidden2 = merge_chunks(hidden1, chunks), merge_chunks(hidden2, chunks)
    if weighted:
        hidden1, hidden2 = apply_token_weights(hidden1, weights1), apply_token_weights(hidden2, weights2)
    return hidden1, hidden2, pooled[::chunks]


def encode_sdxl(tokenizers, text_encoders, captions: list[str], max_token_length: Optional[int] = None,
                weighted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """SDXL conditioning for the UNet: (both hidden states concatenated, pooled output of encoder 2);
    ``weighted``: see :func:`encode_sdxl_parts`."""
    hidden1, hidden2, pooled = encode_sdxl_parts(tokenizers, text_encoders, captions, max_token_length, weighted)
    return torch.cat([hidden1, hidden2.to(hidden1.dtype)], dim=-1), pooled
