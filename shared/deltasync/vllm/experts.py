"""MoE expert weights that vLLM's CPU kernel runs from a prepacked copy, written in place all the same.

After loading, vLLM's CPU MoE kernel replaces each layer's `w13_weight` / `w2_weight` ([experts, rows, cols],
the intermediate dim zero-padded to its alignment) by a prepacked copy of the same shape
(`compat.prepack_experts`). That copy moves bits and nothing else: each expert's elements are permuted within
the expert, the same way for every expert of a shape. `Packing.learn` finds the permutation by prepacking
tensors whose bit patterns encode their element positions (one byte per pass), checks it is a bijection, and
checks that prepacking random bit patterns of the whole parameter equals gathering them through it, bit for
bit. The loader still writes its views of the parameter as if unpacked (padding included), so an element at
position q of those views lives at `(q // n) * n + inverse[q % n]` of the packed storage (n: one expert's
elements).
"""

from __future__ import annotations

import torch

from deltasync.errors import PackingError
from deltasync.vllm import compat

DIGIT_BITS = 8
DIGIT_BASE = 0x3F00  # bf16 bit patterns 0x3F00-0x3FFF: normal numbers (0.5 to 2), one per digit
_LEARNED: dict[tuple[tuple[int, ...], torch.dtype, str], torch.Tensor] = {}  # (expert shape, dtype, isa)
_VERIFIED: set[tuple[tuple[int, ...], torch.dtype, str]] = set()  # (parameter shape, dtype, isa)


class Packing:
    """Where the elements of one prepacked expert parameter live: `flat` is its storage, one dim."""

    def __init__(self, param: torch.Tensor, inverse: torch.Tensor):
        self.flat = param.view(-1)
        self.inverse = inverse.to(param.device)  # unpacked position within an expert -> packed position
        self.expert_numel = inverse.numel()

    @classmethod
    def learn(cls, param: torch.Tensor, isa: str) -> Packing:
        """The permutation vLLM's prepack applies to `param` ([experts, rows, cols]), learned once per
        expert shape and verified on the whole parameter; PackingError if it is not one."""
        key = (tuple(param.shape[1:]), param.dtype, isa)
        if key not in _LEARNED:
            _LEARNED[key] = _learn_inverse(tuple(param.shape[1:]), param.dtype, isa)
        packing = cls(param, _LEARNED[key])
        if (tuple(param.shape), param.dtype, isa) not in _VERIFIED:
            packing._verify(tuple(param.shape), param.dtype, isa)
            _VERIFIED.add((tuple(param.shape), param.dtype, isa))
        return packing

    def positions(self, unpacked: torch.Tensor) -> torch.Tensor:
        """Packed storage positions of the elements at `unpacked` positions of the loader's layout."""
        unpacked = unpacked.to(self.inverse.device)
        n = self.expert_numel
        return unpacked - unpacked % n + self.inverse[unpacked % n]

    def at(self, view: torch.Tensor, index: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Packed storage positions of the elements at `index` of `view` (a view of the parameter, addressed
        as the loader writes it)."""
        unpacked = torch.full_like(index[0], int(view.storage_offset() - self.flat.storage_offset()))
        for i, stride in zip(index, view.stride(), strict=True):
            unpacked += i * stride
        return self.positions(unpacked)

    def _all(self, view: torch.Tensor) -> torch.Tensor:
        """Packed storage positions of all of `view`'s elements, in its element order."""
        unpacked = torch.tensor(view.storage_offset() - self.flat.storage_offset())
        for d, (n, stride) in enumerate(zip(view.shape, view.stride(), strict=True)):
            along = [n if e == d else 1 for e in range(view.dim())]
            unpacked = unpacked + (torch.arange(n) * stride).view(along)
        return self.positions(unpacked.reshape(-1))

    def read(self, view: torch.Tensor) -> torch.Tensor:
        """The values of `view`'s elements, in its shape."""
        return self.flat[self._all(view)].view(view.shape)

    def write(self, view: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite `view`'s elements with `values` (in its shape)."""
        self.flat.index_put_((self._all(view),), values.reshape(-1).to(self.flat.device))

    def _verify(self, shape: tuple[int, ...], dtype: torch.dtype, isa: str) -> None:
        g = torch.Generator().manual_seed(0)
        # All 65536 bit patterns are fair game (NaNs too): the prepack must move bits, never convert values.
        raw = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, generator=g)
        packed = compat.prepack_experts(raw.view(dtype), isa).view(torch.int16)
        inverse = self.inverse.cpu()
        for expert in range(shape[0]):  # one expert at a time: no index the size of the parameter
            if not torch.equal(packed[expert].reshape(-1)[inverse], raw[expert].reshape(-1)):
                what = f"vLLM's CPU prepack ({isa}) of {list(shape)}"
                raise PackingError(f"{what}: not one permutation per expert")


def _learn_inverse(expert: tuple[int, ...], dtype: torch.dtype, isa: str) -> torch.Tensor:
    if dtype != torch.bfloat16:
        raise PackingError(f"prepacked {dtype} experts: only bf16 experts are written in place")
    n = 1
    for size in expert:
        n *= size
    index = torch.arange(n, dtype=torch.int64)
    source = torch.zeros(n, dtype=torch.int64)  # packed position -> the unpacked position it holds
    for shift in range(0, max(n - 1, 1).bit_length(), DIGIT_BITS):
        digits = (DIGIT_BASE | ((index >> shift) & 0xFF)).to(torch.int16).view(torch.bfloat16)
        packed = compat.prepack_experts(digits.view(1, *expert), isa).view(torch.int16).reshape(-1).long()
        if bool(((packed & ~0xFF) != DIGIT_BASE).any()):
            raise PackingError(f"vLLM's CPU prepack ({isa}) of {list(expert)} changes the values it moves")
        source |= (packed & 0xFF) << shift
    if not torch.equal(torch.sort(source).values, index):
        raise PackingError(f"vLLM's CPU prepack ({isa}) of {list(expert)} is not a permutation")
    inverse = torch.empty_like(source)
    inverse[source] = index
    return inverse
