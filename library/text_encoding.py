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
"""
from __future__ import annotations

import argparse
from typing import Optional

import torch

CLIP_CHUNK = 77
CLIP_TOKENS_PER_CHUNK = CLIP_CHUNK - 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max_token_length", type=int, default=None, choices=[75, 150, 225],
                        help="tokens per caption: 75 (CLIP's own, the default), 150 or 225 (kohya's chunking)")


def num_chunks(max_token_length: Optional[int]) -> int:
    """Chunks of 75 tokens per caption: 1 by default, 2 for 150, 3 for 225."""
    return 1 if not max_token_length else max_token_length // CLIP_TOKENS_PER_CHUNK


def tokenize(tokenizer, captions: list[str], max_token_length: Optional[int] = None) -> torch.Tensor:
    """Token ids of shape (batch, chunks, 77) following kohya's chunking rule."""
    chunks = num_chunks(max_token_length)
    length = CLIP_TOKENS_PER_CHUNK * chunks + 2
    ids = tokenizer(captions, padding="max_length", truncation=True, max_length=length, return_tensors="pt").input_ids
    if chunks == 1:
        return ids.unsqueeze(1)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = []
    for row in ids:
        row_chunks = []
        for start in range(1, length - 1, CLIP_TOKENS_PER_CHUNK):
            chunk = torch.cat([row[:1], row[start : start + CLIP_TOKENS_PER_CHUNK], row[-1:]])
            if pad != eos:
                if chunk[-2] != eos and chunk[-2] != pad:
                    chunk[-1] = eos
                if chunk[1] == pad:
                    chunk[1] = eos
            row_chunks.append(chunk)
        rows.append(torch.stack(row_chunks))
    return torch.stack(rows)


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


def encode_sd(tokenizer, text_encoder, captions: list[str], max_token_length: Optional[int] = None,
              clip_skip: Optional[int] = None) -> torch.Tensor:
    """SD1.x/2.x conditioning: the last (or ``clip_skip``-th last, re-normalised) hidden states."""
    input_ids = tokenize(tokenizer, captions, max_token_length)
    chunks = input_ids.shape[1]
    flat = input_ids.reshape(-1, CLIP_CHUNK).to(text_encoder.device)
    if not clip_skip:
        hidden = text_encoder(flat)[0]
    else:
        output = text_encoder(flat, output_hidden_states=True)
        final_layer_norm = getattr(text_encoder, "text_model", text_encoder).final_layer_norm  # transformers 4 / 5
        hidden = final_layer_norm(output.hidden_states[-clip_skip])
    return merge_chunks(hidden, chunks)


def pooled_at_first_eos(text_encoder, last_hidden_state: torch.Tensor, input_ids: torch.Tensor,
                        eos_token_id: int) -> torch.Tensor:
    """kohya's pooled output: the final hidden state at the first <EOS>, through ``text_projection``."""
    eos_index = (input_ids == eos_token_id).int().argmax(dim=1).to(last_hidden_state.device)
    pooled = last_hidden_state[torch.arange(last_hidden_state.shape[0], device=last_hidden_state.device), eos_index]
    projection = text_encoder.text_projection
    return projection(pooled.to(projection.weight.dtype)).to(last_hidden_state.dtype)


def encode_sdxl_parts(tokenizers, text_encoders, captions: list[str], max_token_length: Optional[int] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SDXL's three outputs: hidden states of encoder 1 and 2 (penultimate layers) and the pooled output."""
    tokenizer1, tokenizer2 = tokenizers
    encoder1, encoder2 = text_encoders
    ids1 = tokenize(tokenizer1, captions, max_token_length)
    ids2 = tokenize(tokenizer2, captions, max_token_length)
    chunks = ids1.shape[1]
    flat1 = ids1.reshape(-1, CLIP_CHUNK).to(encoder1.device)
    flat2 = ids2.reshape(-1, CLIP_CHUNK).to(encoder2.device)
    hidden1 = encoder1(flat1, output_hidden_states=True).hidden_states[-2]
    output2 = encoder2(flat2, output_hidden_states=True)
    hidden2 = output2.hidden_states[-2]
    pooled = pooled_at_first_eos(encoder2, output2.last_hidden_state, flat2, tokenizer2.eos_token_id)
    return merge_chunks(hidden1, chunks), merge_chunks(hidden2, chunks), pooled[::chunks]


def encode_sdxl(tokenizers, text_encoders, captions: list[str], max_token_length: Optional[int] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """SDXL conditioning for the UNet: (both hidden states concatenated, pooled output of encoder 2)."""
    hidden1, hidden2, pooled = encode_sdxl_parts(tokenizers, text_encoders, captions, max_token_length)
    return torch.cat([hidden1, hidden2.to(hidden1.dtype)], dim=-1), pooled
