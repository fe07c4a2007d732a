"""A quantized root, both ends: what the publisher adds to each step (the bf16 patch of the tensors the recipe
leaves alone, and the quantized delta), and a quantized replica's state in memory that follows it.

A chain starts at a complete bf16 state (an anchor, or the base model): a replica loading it with the recipe
holds its quantization exactly. Each delta after it is two files, both checked against the replica's state
before anything is written: the codec's patch of the unquantized tensors (its fingerprints over those) and
`deltasync.quant.delta`'s file (its fingerprints over codes and scales). The replica's whole fingerprint, in
the head entry's `quantized`, is their sum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from deltasync.codec import fingerprint
from deltasync.codec.changes import apply_changes
from deltasync.codec.patch import Patch, decode, encode, fingerprint_after
from deltasync.quant import delta as quant_delta
from deltasync.quant import state as quant_state
from deltasync.quant.delta import Quantizer, QuantStep
from deltasync.quant.recipe import Recipe, recipe


@dataclass(frozen=True)
class Held:
    """The quantized state of a published step (or of one being published: `step`, the delta to it)."""

    quantizer: Quantizer
    rest_fingerprint: int  # of the bf16 tensors the recipe leaves alone
    step: QuantStep | None = None

    @property
    def fingerprint(self) -> int:
        """A quantized replica's fingerprint at this step (entry's `quantized`)."""
        quantized = self.step.fingerprint if self.step else self.quantizer.fingerprint
        return (self.rest_fingerprint + quantized) & fingerprint.MASK64


class QuantizedRoot:
    """The publisher's side: the recipe called `name`, over a run of `schema` ({name: shape})."""

    def __init__(self, name: str, schema: Mapping[str, Sequence[int]]) -> None:
        self.recipe = recipe(name)
        self.names = frozenset(self.recipe.quantized_names(schema))
        self.held: Held | None = None  # the published step's

    def split(self, state: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
        """(the tensors the recipe leaves alone, those it quantizes), on the host for the latter."""
        rest = {n: t for n, t in state.items() if n not in self.names}
        return rest, {n: state[n].cpu() for n in state if n in self.names}  # Quantizer works in numpy

    def start(self, state: Mapping[str, torch.Tensor]) -> Held:
        """A chain starting at complete bf16 `state`."""
        rest, quantized = self.split(state)
        return Held(Quantizer(quantized, self.recipe), fingerprint.state_fingerprint(rest))

    def delta(
        self,
        patch: Patch,
        old: Mapping[str, torch.Tensor],
        new: Mapping[str, torch.Tensor],
        encoding: str,
        threads: int | None,
    ) -> tuple[bytes, bytes, Held]:
        """The two files of `patch` (the whole bf16 state's, from `old`, the published state, to `new`): the
        bf16 patch of the tensors left alone and the quantized delta; and the state they lead to, held once
        `commit` is called."""
        assert self.held is not None, "a delta follows a published step"
        old_rest, old_quantized = self.split(old)
        changes = {n: c for n, c in patch.changes.items() if n not in self.names}
        rest_fp = fingerprint_after(self.held.rest_fingerprint, old_rest, changes, threads)
        numel = sum(t.numel() for t in old_rest.values())
        rest = Patch(patch.step, patch.base_step, numel, self.held.rest_fingerprint, rest_fp, changes)
        data = encode(rest, old_rest, encoding, threads)
        positions = {n: c.indices.cpu() for n, c in patch.changes.items() if n in self.names}
        step = self.held.quantizer.delta(old_quantized, self.split(new)[1], positions)
        return data, step.data, Held(self.held.quantizer, rest_fp, step)

    def commit(self, held: Held) -> None:
        """`held` (from `start` or `delta`) is published."""
        if held.step is not None:
            held.quantizer.advance(held.step)
        self.held = Held(held.quantizer, held.rest_fingerprint)


class Replica:
    """A quantized replica's state in memory (`rest`: bf16 tensors the recipe leaves alone; `quantized`:
    codes and scales), loaded from complete bf16 `state` as vLLM quantizes it at load."""

    def __init__(self, state: Mapping[str, torch.Tensor], recipe_: Recipe) -> None:
        self.recipe = recipe_
        self.quantized = quant_state.quantize_state(state, recipe_)
        self.rest = {n: t.clone() for n, t in state.items() if n not in self.quantized}
        self.rest_fingerprint = fingerprint.state_fingerprint(self.rest)
        self.quantized_fingerprint = quant_state.fingerprint(self.quantized)

    @property
    def fingerprint(self) -> int:
        return (self.rest_fingerprint + self.quantized_fingerprint) & fingerprint.MASK64

    def decode(self, bf16: bytes, quantized: bytes) -> tuple[Patch, dict[str, quant_state.Changes], int]:
        """A delta's two files checked against this state, nothing written: PatchError in one line if either
        is corrupt, for another recipe or state, or misses the fingerprint it promises."""
        patch = decode(bf16, self.rest, self.rest_fingerprint)
        changes, reached = quant_delta.decode(
            quantized, self.quantized, self.recipe.name, self.quantized_fingerprint
        )
        return patch, changes, reached

    def apply(self, bf16: bytes, quantized: bytes) -> None:
        """Decode and check both files, then write them."""
        patch, changes, reached = self.decode(bf16, quantized)
        apply_changes(self.rest, patch.changes)
        quant_state.apply(self.quantized, changes)
        self.rest_fingerprint, self.quantized_fingerprint = patch.fingerprint, reached
