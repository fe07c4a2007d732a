"""A quantized state: per tensor, codes and one fp32 scale per row; its changes and its fingerprint.

The fingerprint is the codec's (deltasync.codec.fingerprint, imported here only), taken over 16-bit words
that hold the quantized values exactly: each code byte widened to one word, each fp32 scale as its two
halves (under the tensor's name + SCALE). Like the bf16 one it is linear, so changes move it by the change
of their words alone, and a replica's whole state (the bf16 tensors the recipe leaves alone, plus these) is
the sum of the two fingerprints.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from deltasync.codec.fingerprint import MASK64, format_fingerprint, state_fingerprint
from deltasync.codec.fingerprint import delta as words_move
from deltasync.quant.recipe import Recipe

SCALE = ":scale"  # the scales' name in fingerprints and delta files: never a checkpoint tensor's name
__all__ = [
    "SCALE",
    "Changes",
    "Quantized",
    "apply",
    "fingerprint",
    "fingerprint_after",
    "format_fingerprint",
    "quantize_state",
]


@dataclass(frozen=True)
class Quantized:
    """One tensor quantized per output row: codes [N, K] (fp8 or int8) and scales [N] (fp32), contiguous."""

    codes: torch.Tensor
    scales: torch.Tensor

    def code_bytes(self) -> np.ndarray:
        """The codes' bytes, flat, sharing their memory."""
        return self.codes.view(-1).view(torch.uint8).numpy()

    def scale_words(self) -> np.ndarray:
        """The scales' fp32 bits as int16 halves, flat (2 per row), sharing their memory."""
        return self.scales.numpy().view(np.int16)


@dataclass(frozen=True)
class Changes:
    """One quantized tensor's changes: new code bytes (uint8) at flat `positions`, new fp32 `scales` at
    `rows`."""

    positions: np.ndarray
    codes: np.ndarray
    rows: np.ndarray
    scales: np.ndarray


def quantize_state(state: Mapping[str, torch.Tensor], recipe: Recipe) -> dict[str, Quantized]:
    """The tensors of bf16 `state` that `recipe` quantizes, quantized."""
    shapes = {n: t.shape for n, t in state.items()}
    return {n: Quantized(*recipe.quantize(state[n])) for n in recipe.quantized_names(shapes)}


def fingerprint(state: Mapping[str, Quantized]) -> int:
    """The fingerprint of a quantized state (a full pass over its codes and scales)."""
    total = 0
    for name, q in state.items():  # one tensor's words at a time
        codes = torch.from_numpy(q.code_bytes()).to(torch.int16).view(torch.bfloat16)
        scales = torch.from_numpy(q.scale_words()).view(torch.bfloat16)
        total += state_fingerprint([(name, codes), (name + SCALE, scales)])
    return total & MASK64


def fingerprint_after(base_fp: int, state: Mapping[str, Quantized], changes: Mapping[str, Changes]) -> int:
    """The fingerprint `state` (fingerprint `base_fp`) reaches with `changes` applied; reads only what
    changes."""
    move = base_fp
    for name, c in changes.items():
        q = state[name]
        old_codes = q.code_bytes()[c.positions].astype(np.int16)
        move += words_move(name, c.positions, old_codes, c.codes.astype(np.int16))
        words = np.stack([2 * c.rows, 2 * c.rows + 1], 1).reshape(-1)
        move += words_move(name + SCALE, words, q.scale_words()[words], c.scales.view(np.int16))
    return move & MASK64


def apply(state: Mapping[str, Quantized], changes: Mapping[str, Changes]) -> None:
    """Write `changes` into `state` in place."""
    for name, c in changes.items():
        state[name].code_bytes()[c.positions] = c.codes
        state[name].scales.numpy()[c.rows] = c.scales
