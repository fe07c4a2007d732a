"""The codec's passes over every element, one backend per kind of device, chosen in one place (`backend_for`).

A backend finds the changes between two states and how they move the fingerprint, fingerprints a state,
codes the compact streams of a patch, decodes them against old values where those live, and writes changes
in place. Each does it where its tensors are: `HostBackend` (deltasync.codec.host: numba's loops on host
threads), `CudaBackend` (deltasync.codec.gpu: Triton's kernels) and `TorchBackend`
(deltasync.codec.accelerator: torch's own ops, on any other accelerator). Every backend gives the same
changes, fingerprints and patch bytes. The public codec (deltasync.codec.changes, .fingerprint, .patch) sits
on top, and so does deltasync.vllm.

The backends are named here by module, as vLLM's weight-transfer engine factory names its engines, and
imported when first used: the CUDA one loads Triton, the host one numba. They import this module, never the
reverse, so the codec's modules import one another without a circle.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from deltasync.codec import compact

BACKENDS = {  # kind of device -> (module, class)
    "cpu": ("deltasync.codec.host", "HostBackend"),
    "cuda": ("deltasync.codec.gpu", "CudaBackend"),
    "accelerator": ("deltasync.codec.accelerator", "TorchBackend"),
}


@dataclass(frozen=True)
class TensorChanges:
    """The changed elements of one tensor: flat positions (int64, strictly increasing) and new bf16 values."""

    indices: torch.Tensor
    values: torch.Tensor

    def __len__(self) -> int:
        return self.indices.numel()


Pairs = Mapping[str, tuple["torch.Tensor", "torch.Tensor"]]  # name -> (old bits, new bits), int16, flat
Move = tuple[str, "torch.Tensor", "torch.Tensor", "torch.Tensor"]  # name, positions, old and new patterns


class Decoder(ABC):
    """A patch's compact entries, decoded against old values where they live, one tensor when asked."""

    @abstractmethod
    def changes(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensor `name`'s changed positions (int64, ascending, within the entry) and new patterns (int16).
        Raises CompactDecodeError (with the tensor in its `tensor` attribute) or PatchError."""


class Backend(ABC):
    """The codec's passes over tensors on one kind of device."""

    decodes_whole_patches = False  # whether a decoder is best made for every tensor of a patch at once

    @abstractmethod
    def scan(self, pairs: Pairs, threads: int | None) -> tuple[dict[str, TensorChanges], dict[str, int]]:
        """The changed elements of each pair (new bits already on the old bits' device), those with changes
        only, and how they move the fingerprint of the old state (every tensor with changes, or none)."""

    @abstractmethod
    def state_fingerprint(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """The fingerprint of bf16 `tensors` (deltasync.codec.fingerprint), mod 2^64, taken one at a time: a
        tensor is not held after its pass (only what is summed, O(its rows))."""

    @abstractmethod
    def compact_streams(
        self,
        changes: Mapping[str, TensorChanges],
        old: Mapping[str, torch.Tensor],
        chunk: int,
        threads: int | None,
    ) -> tuple[dict[str, bytes], compact.Models]:
        """The compact streams of the changed tensors worth coding (compact.worth_coding) and the models
        pooled over them (deltasync.codec.compact)."""

    @abstractmethod
    def decoder(
        self,
        streams: Mapping[str, list[bytes]],
        windows: Mapping[str, tuple[int, int]],
        chunk: int,
        tables: compact.Tables,
        device: torch.device,
        old_values: Callable[[str], torch.Tensor],
        threads: int | None,
    ) -> Decoder:
        """A decoder of the compact `streams` (chunk streams per tensor, each entry covering elements
        start.. start + length of its tensor, `windows[name]`) against `old_values(name)` (bf16, on
        `device`)."""

    @abstractmethod
    def moves(self, changes: list[Move]) -> int:
        """How `changes` (tensor name, flat positions int64, old and new patterns int16, each on this
        backend's device) move the fingerprint, mod 2^64: one host sync for all of them."""

    @abstractmethod
    def write(
        self, state: Mapping[str, torch.Tensor], changes: Mapping[str, TensorChanges], threads: int | None
    ) -> None:
        """Write `changes` into the bf16 tensors of `state` in place."""


def kind(t: torch.Tensor) -> str:
    """The kind of device whose backend runs the passes over `t`: where bf16.on_gpu says so, CUDA."""
    from deltasync.codec import bf16  # torch: only once tensors are passed

    if bf16.on_gpu(t):
        return "cuda"
    return "cpu" if t.device.type == "cpu" else "accelerator"


def backend(name: str) -> Backend:
    """The backend of a kind of device (a key of BACKENDS), its module imported on first use."""
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()


def backend_for(t: torch.Tensor) -> Backend:
    """The backend for tensors on `t`'s device."""
    return backend(kind(t))


def backend_on(device: torch.device) -> Backend:
    """The backend for tensors on `device` (asked of an empty tensor there: bf16.on_gpu decides on one)."""
    import torch

    return backend_for(torch.empty(0, dtype=torch.bfloat16, device=device))
