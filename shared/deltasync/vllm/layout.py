"""Where each HF checkpoint tensor lives in a vLLM worker's model, learned from vLLM's own loader.

vLLM fuses (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, experts into `w13`/`w2`) and shards (tensor
parallel) what the checkpoint holds as separate tensors. Rather than mirror those rules, `Layout.learn` runs
the model's `load_weights` once per HF name on a probe tensor inside a `TorchFunctionMode` (scoped to that
call and thread) that records each `copy_` the loader would make instead of making it. A recorded copy whose
source is a view of the probe is a `Block`: a strided box of the HF tensor and the parameter view it lands in.
Writes then go straight to those views: O(changed elements), and every worker writes only its own part.

Quantized linear layers (`--quantization fp8_per_channel`) are not learned through the loader (it would
quantize again): `quantized_views` finds each HF tensor's rows in vLLM's fused codes and scales
(`deltasync.vllm.compat.fp8_linears`) and holds them as a `deltasync.quant.state.Quantized` of views, written
in place with the quantized deltas (one rank only: the shards of tensor parallelism are not mapped yet).

MoE experts on CPU are the one place where a view is not where its elements live: vLLM's CPU kernel runs them
from a prepacked copy, each expert's elements permuted (`deltasync.vllm.experts`). The loader still writes
its view as if unpacked (its padding included), so such a block keeps that view and a `Packing` that maps
its positions to the packed storage; its writes, read-backs and fingerprints go through that map.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from deltasync.codec import fingerprint
from deltasync.codec.backend import Move, TensorChanges, backend, kind
from deltasync.codec.bf16 import bits
from deltasync.quant import state as quant_state
from deltasync.quant.recipe import Recipe
from deltasync.vllm import compat
from deltasync.vllm.experts import Packing

BUDGET = 1 << 22  # elements of a block read at once, where it is read in batches (bounds temporaries)
LIMB_BITS = 16  # fingerprints are summed across ranks in 16-bit limbs: an int64 all-reduce never overflows


@dataclass
class Block:
    """The HF elements `hf_view(size, stride, offset)` of one tensor, stored in the parameter view `dst`
    (same shape), or where `packing` moves that view's elements. `owned`: which of them this rank counts in
    the fingerprint (None: all)."""

    dst: torch.Tensor
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    owned: torch.Tensor | None = None
    packing: Packing | None = None

    def read(self) -> torch.Tensor:
        """The block's values, in `dst`'s shape."""
        return self.dst if self.packing is None else self.packing.read(self.dst)

    def write(self, values: torch.Tensor) -> None:
        """Overwrite all of the block's values (`values` in `dst`'s shape)."""
        if self.packing is None:
            self.dst.copy_(values)
        else:
            self.packing.write(self.dst, values)

    def positions(self) -> torch.Tensor:
        """HF flat positions of the block's elements, in `dst`'s element order."""
        numel = self.offset + 1 + sum((n - 1) * s for n, s in zip(self.size, self.stride, strict=True))
        return torch.arange(numel).as_strided(self.size, self.stride, self.offset).reshape(-1)

    def runs(self) -> tuple[np.ndarray, int]:
        """Where the block's runs of consecutive HF positions begin (flat, in `dst`'s element order), and
        their length: its trailing dims that step through the HF tensor in order make one run."""
        k, length = len(self.size), 1
        while k and (self.size[k - 1] == 1 or self.stride[k - 1] == length):
            length *= self.size[k - 1]
            k -= 1
        starts = np.array([self.offset], np.int64)
        for size, stride in zip(self.size[:k], self.stride[:k], strict=True):
            starts = (starts[:, None] + np.arange(size, dtype=np.int64) * stride).reshape(-1)
        return starts, length

    def whole(self, shape: tuple[int, ...]) -> bool:
        """Whether the block is the whole HF tensor `shape`, in its order, in a contiguous `dst`."""
        strides = tuple(int(np.prod(shape[h + 1 :])) for h in range(len(shape)))
        return self.offset == 0 and self.size == shape and self.stride == strides and self.dst.is_contiguous()

    def locate(
        self, flat: torch.Tensor, shape: tuple[int, ...]
    ) -> tuple[slice | torch.Tensor, torch.Tensor, tuple]:
        """Which of the sorted HF flat positions `flat` fall in this block (a slice where the block is a run
        of the HF tensor, else a mask), and where they go: the tensor to index (`dst`, or its flat view)
        and the index."""
        if self.run:  # q/k/v, gate/up, embeddings, column-parallel shards: a slice of `flat`, no mask
            bounds = torch.tensor([self.offset, self.offset + self.dst.numel()], device=flat.device)
            where = slice(*torch.searchsorted(flat, bounds).tolist())
            return where, self.dst.view(-1), (flat[where] - self.offset,)
        hf_strides = [int(np.prod(shape[h + 1 :])) for h in range(len(shape))]
        coords = [(flat // hf_strides[h]) % shape[h] for h in range(len(shape))]
        origin = [(self.offset // hf_strides[h]) % shape[h] for h in range(len(shape))]
        mask = torch.ones_like(flat, dtype=torch.bool)
        mapped: dict[int, int] = {}
        for d, (n, s) in enumerate(zip(self.size, self.stride, strict=True)):
            if n > 1:
                mapped[d] = hf_strides.index(s)
        for h in range(len(shape)):
            dims = [d for d, hh in mapped.items() if hh == h]
            local = coords[h] - origin[h]
            mask &= (local >= 0) & (local < (self.size[dims[0]] if dims else 1))
        index = tuple(
            (coords[mapped[d]] - origin[mapped[d]])[mask] if d in mapped else torch.zeros_like(flat[mask])
            for d in range(len(self.size))
        )
        return mask, self.dst, index

    @property
    def run(self) -> bool:
        """Whether the block is one run of consecutive HF elements, in order, in a contiguous `dst`."""
        expected = 1
        for n, s in reversed(list(zip(self.size, self.stride, strict=True))):
            if n > 1 and s != expected:
                return False
            expected *= n
        return self.dst.is_contiguous()


@dataclass
class Segments:
    """Runs of consecutive positions of a tensor's window that blocks hold, none across a chunk boundary nor
    longer than a budget, in each block's element order: where each begins in the window, how long it is,
    its block and where it begins in that block's flat element order. What a rank reads of a tensor it holds
    in parts, batch by batch, without a list of the positions it holds."""

    start: np.ndarray
    length: np.ndarray
    block: np.ndarray
    element: np.ndarray

    @classmethod
    def of(cls, blocks: list[Block], lo: int, n: int, chunk: int, budget: int) -> Segments:
        """The segments of `blocks` in the window [lo, lo + n) of their tensor."""
        parts = []
        for i, b in enumerate(blocks):
            starts, length = b.runs()
            first, end = np.maximum(starts, lo), np.minimum(starts + length, lo + n)
            keep = first < end
            element = (np.arange(starts.size) * length + first - starts)[keep]
            a, e = first[keep] - lo, end[keep] - lo
            a, e, element = _cut(a, e, element, chunk, aligned=True)
            a, e, element = _cut(a, e, element, budget, aligned=False)
            parts.append((a, e - a, np.full(a.size, i), element))
        if not parts:
            return cls(*(np.empty(0, np.int64) for _ in range(4)))
        return cls(*(np.concatenate(p).astype(np.int64) for p in zip(*parts, strict=True)))

    def batches(self, budget: int, chunk: int) -> Iterator[tuple[int, int]]:
        """[first, last) segment ranges of one block and one chunk, adjacent in the block's element order,
        of at most 2 x `budget` elements together."""
        joined = np.zeros(self.start.size, bool)
        joined[1:] = (
            (self.block[1:] == self.block[:-1])
            & (self.element[1:] == self.element[:-1] + self.length[:-1])
            & (self.start[1:] // chunk == self.start[:-1] // chunk)
        )
        group = np.cumsum(~joined)
        before = np.cumsum(self.length) - self.length
        within = before - before[np.flatnonzero(~joined)][group - 1]
        key = group * (1 << 32) + within // budget
        bounds = np.concatenate([[0], np.flatnonzero(np.diff(key)) + 1, [self.start.size]])
        yield from zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True) if self.start.size else ()

    def span(self, first: int, last: int) -> tuple[int, int]:
        """The element range of a batch of segments [first, last) in their block."""
        return int(self.element[first]), int(self.element[last - 1] + self.length[last - 1])

    def positions(self, first: int, last: int) -> np.ndarray:
        """The window positions of a batch of segments [first, last), in element order."""
        length = self.length[first:last]
        shift = self.start[first:last] - (np.cumsum(length) - length)  # position minus place in the batch
        return np.repeat(shift, length) + np.arange(length.sum())


def _cut(a: np.ndarray, e: np.ndarray, element: np.ndarray, step: int, aligned: bool):
    """[a, e) cut at multiples of `step` (`aligned`) or every `step` elements from a; `element` follows."""
    origin = np.zeros_like(a) if aligned else a
    first = (a - origin) // step
    count = (e - 1 - origin) // step - first + 1
    which = np.repeat(np.arange(a.size), count)
    k = np.arange(which.size) - np.repeat(np.cumsum(count) - count, count) + first[which]
    lo = np.maximum(a[which], origin[which] + k * step)
    hi = np.minimum(e[which], origin[which] + (k + 1) * step)
    return lo, hi, element[which] + lo - a[which]


def _is_box(size: tuple[int, ...], stride: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """A view whose dims of size > 1 each step along a distinct dim of the contiguous HF tensor."""
    hf_strides = [int(np.prod(shape[h + 1 :])) for h in range(len(shape))]
    used = [s for n, s in zip(size, stride, strict=True) if n > 1]
    return len(set(used)) == len(used) and all(s in hf_strides for s in used)


class _RecordCopies(TorchFunctionMode):
    """Records `dst.copy_(src)` calls instead of making them (only inside its `with`, only this thread)."""

    def __init__(self):
        super().__init__()
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            self.copies.append((args[0], args[1]))
            return args[0]
        return func(*args, **(kwargs or {}))


class Layout:
    """HF name -> the blocks of it this rank holds; `loader`: names vLLM's loader takes but not as views of
    the input (written through the loader, never read back)."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        blocks: dict[str, list[Block]],
        loader: list[str],
        quantized: dict[str, quant_state.Quantized] | None = None,
    ):
        self.shapes, self.blocks, self.loader = shapes, blocks, loader
        self.quantized = quantized or {}  # HF name -> views of its codes and scales (quantized replicas)
        self.split: set[str] = set()  # tensors the ranks hold in disjoint parts (tensor parallel)
        self.shared: set[str] = set()  # tensors some ranks hold parts of, some of them on several ranks
        self.group = None

    @classmethod
    @torch.no_grad()
    def learn(cls, model: torch.nn.Module, hf_config, group=None, recipe: Recipe | None = None) -> Layout:
        """Run the loader once per HF name of `hf_config`'s architecture; `group`: the process group of the
        ranks that together hold the model (None: this rank holds all of it); `recipe`: the quantization the
        server was started with (its tensors are found by `quantized_views` instead)."""
        device = next(model.parameters()).device
        packings = {
            param.untyped_storage().data_ptr(): Packing.learn(param, isa)
            for param, isa in compat.prepacked_experts(model)
        }
        shapes, blocks, loader = {}, {}, []
        schema = checkpoint_shapes(hf_config)
        quantized = quantized_views(model, schema, recipe, group) if recipe else {}
        for name, shape in schema.items():
            if name in quantized:
                shapes[name] = tuple(shape)
                continue
            probe = torch.empty(shape, dtype=torch.bfloat16, device=device)
            recorder = _RecordCopies()
            try:
                with recorder:
                    model.load_weights([(name, probe)])  # type: ignore[operator]
            except Exception:  # vLLM's loader does not take this name: not servable, not ours
                continue
            if not recorder.copies:  # the loader skips it (a tied lm_head): writing it would change nothing
                continue
            shapes[name] = tuple(shape)
            found: list[Block] | None = []
            ptr = probe.untyped_storage().data_ptr()
            for dst, src in recorder.copies:
                if found is None:
                    break
                if (
                    src.untyped_storage().data_ptr() != ptr
                    or src.shape != dst.shape
                    or dst.dtype != torch.bfloat16
                    or not _is_box(tuple(src.shape), src.stride(), tuple(shape))
                ):
                    found = None
                    break
                offset = int(src.storage_offset() - probe.storage_offset())
                packing = packings.get(dst.untyped_storage().data_ptr())
                found.append(Block(dst, tuple(src.shape), tuple(src.stride()), offset, packing=packing))
            if found is None:
                if any(dst.untyped_storage().data_ptr() in packings for dst, _ in recorder.copies):
                    raise ValueError(f"{name}: the loader writes prepacked MoE experts other than by view")
                loader.append(name)
            else:
                blocks[name] = found
        layout = cls(shapes, blocks, loader, quantized)
        layout._own(group)
        return layout

    def paths(self) -> dict[str, str]:
        """How each tensor is written: "direct" (indexed writes into its views), "packed" (the same, through
        the permutation of prepacked MoE experts) or "loader" (vLLM's `load_weights`, whole tensors only)."""
        paths = {name: "loader" for name in self.loader}
        for name, blocks in self.blocks.items():
            paths[name] = "packed" if any(b.packing is not None for b in blocks) else "direct"
        return paths

    def _own(self, group) -> None:
        """Decide which rank counts each element in fingerprints: the lowest rank holding it."""
        if group is None or torch.distributed.get_world_size(group) == 1:
            return
        rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        self.group = group
        for name, shape in self.shapes.items():
            numel = int(np.prod(shape))
            held = sum(int(np.prod(b.size)) for b in self.blocks.get(name, []))
            counts = torch.tensor([held, int(held == numel)], dtype=torch.int64)
            torch.distributed.all_reduce(counts, group=group)
            if int(counts[0]) == numel:  # disjoint shards: every rank counts its own
                self.split.add(name)
                continue
            if int(counts[1]) == world:  # whole on every rank: rank 0 counts it
                for b in self.blocks.get(name, []):
                    b.owned = (
                        torch.zeros(int(np.prod(b.size)), dtype=torch.bool, device=b.dst.device)
                        if rank
                        else None
                    )
                continue
            self.shared.add(name)
            owner = torch.full((numel,), world, dtype=torch.int32)
            for b in self.blocks.get(name, []):
                owner[b.positions()] = rank
            torch.distributed.all_reduce(owner, op=torch.distributed.ReduceOp.MIN, group=group)
            for b in self.blocks.get(name, []):
                b.owned = (owner[b.positions()] == rank).to(b.dst.device)

    def old_values(self, name: str) -> torch.Tensor:
        """The whole HF tensor `name` (not one of `split`) as this rank's weights hold it: a view of them
        where one block holds it in order, else a copy (tensor by tensor). A `shared` tensor is gathered
        whole on every rank (a collective: every rank calls it for the same names in the same order)."""
        shape, blocks = self.shapes[name], self.blocks.get(name, [])
        alone = name not in self.shared and len(blocks) == 1 and blocks[0].packing is None
        if alone and blocks[0].whole(shape):
            return blocks[0].dst.view(shape)
        device = blocks[0].dst.device if blocks else torch.device("cpu")
        if name not in self.shared:
            whole = torch.empty(shape, dtype=torch.bfloat16, device=device)
            for b in blocks:
                whole.as_strided(b.size, b.stride, b.offset).copy_(b.read())
            return whole
        # Each rank adds the elements it counts (the ranks' `owned` parts tile the tensor) into zeros.
        whole = torch.zeros(shape, dtype=torch.int32)
        for b in blocks:
            values = bits(b.read().cpu()).to(torch.int32)
            if b.owned is not None:
                values = torch.where(b.owned.view(b.size).cpu(), values, 0)
            whole.as_strided(b.size, b.stride, b.offset).copy_(values)
        torch.distributed.all_reduce(whole, group=self.group)
        return whole.to(torch.int16).view(torch.bfloat16).to(device)

    def partial_fingerprint(self, names: list[str] | None = None) -> int:
        """This rank's share of the state fingerprint (`names`, default all held, the quantized tensors' codes
        and scales included): the shares of all ranks sum to the fingerprint of the whole state."""
        total = quant_state.fingerprint(self.quantized) if names is None else 0
        for name in names if names is not None else self.blocks:
            for b in self.blocks.get(name, []):
                if b.owned is None and b.whole(self.shapes[name]):  # in order: the vectorized pass
                    total += fingerprint.tensor_fingerprint(name, b.read())
                    continue
                # a batch of the block's runs at a time: no list of its positions
                numel, values = int(np.prod(self.shapes[name])), bits(b.read())
                segments = Segments.of([b], 0, numel, numel, BUDGET)
                for first, last in segments.batches(BUDGET, numel):
                    e0, e1 = segments.span(first, last)
                    positions, part = segments.positions(first, last), values[e0:e1].cpu().numpy()
                    if b.owned is not None:
                        counted = b.owned.view(-1)[e0:e1].cpu().numpy()
                        positions, part = positions[counted], part[counted]
                    total += fingerprint.delta(name, positions, np.zeros(part.size, np.int16), part)
        return total & fingerprint.MASK64

    def plan_patch(self, changes: dict[str, TensorChanges]) -> tuple[list, int]:
        """The writes a patch makes on this rank (tensor, index, values) and this rank's share of how it moves
        the fingerprint. Reads only; writes nothing. Planned where the weights are, the move by the backend
        of their device (deltasync.codec.backend: on a GPU only its sum comes to the host, once)."""
        writes: list = []
        moves: dict[str, list[Move]] = {}  # by the kind of device that holds the weights
        for name, ch in changes.items():
            blocks = self.blocks.get(name, [])
            if not blocks:
                continue
            device = blocks[0].dst.device
            flat, values = ch.indices.to(device, torch.int64), ch.values.to(device)
            for b in blocks:
                where, dst, index = b.locate(flat, self.shapes[name])
                positions, new = flat[where], values[where]
                if not len(positions):
                    continue
                counted = None if b.owned is None else _owned(b, index)
                if b.packing is not None:  # the element at `index` of `dst` lives elsewhere in the storage
                    dst, index = b.packing.flat, (b.packing.at(dst, index),)
                writes.append((dst, index, new))
                old, new_bits = bits(dst[index]), bits(new)
                if counted is not None:
                    positions, old, new_bits = positions[counted], old[counted], new_bits[counted]
                moves.setdefault(kind(dst), []).append((name, positions, old, new_bits))
        moved = sum(backend(k).moves(m) for k, m in moves.items())
        return writes, moved & fingerprint.MASK64


def quantized_views(
    model: torch.nn.Module, schema: dict[str, tuple[int, ...]], recipe: Recipe, group
) -> dict[str, quant_state.Quantized]:
    """Each HF tensor `recipe` quantizes, as views of the rows of vLLM's fused fp8 codes ([N, K], the
    transpose of its `weight`) and fp32 scales that hold it; ValueError in one line where the server's
    layers are not those the recipe makes."""
    if group is not None and torch.distributed.get_world_size(group) > 1:
        raise ValueError("quantized replicas run on one rank: tensor parallel shards are not mapped yet")
    wanted = set(recipe.quantized_names(schema))
    packed = getattr(model, "packed_modules_mapping", {})
    views = {}
    for module_name, module in compat.fp8_linears(model):
        prefix, _, last = module_name.rpartition(".")
        shards = packed.get(last, [last])
        weight, weight_scale = module.get_parameter("weight"), module.get_parameter("weight_scale")
        codes = weight.detach().t()  # [N, K], contiguous: vLLM's layout
        scales = weight_scale.detach().view(-1)
        sizes = getattr(module, "output_sizes", None) or [codes.shape[0]]
        if not codes.is_contiguous() or len(sizes) != len(shards) or sum(sizes) != codes.shape[0]:
            raise ValueError(f"{module_name}: fp8 codes {tuple(codes.shape)} are not {shards} rows in order")
        row = 0
        for shard, rows in zip(shards, sizes, strict=True):
            name = f"{prefix}.{shard}.weight" if prefix else f"{shard}.weight"
            if name not in wanted or tuple(schema[name]) != (rows, codes.shape[1]):
                raise ValueError(f"{module_name}: holds {name} quantized, which {recipe.name} does not make")
            views[name] = quant_state.Quantized(codes[row : row + rows], scales[row : row + rows])
            row += rows
    missing = sorted(wanted - set(views))
    if missing:
        raise ValueError(f"{recipe.name} quantizes {missing[0]}, which this server holds unquantized")
    return views


def _owned(b: Block, index: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Which of the elements at `index` (into `b.dst`, or its flat view) this rank counts in fingerprints."""
    assert b.owned is not None
    return b.owned.view(-1)[index[0]] if len(index) == 1 else b.owned.view(b.size)[index]


def checkpoint_shapes(hf_config) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes for this architecture (tied weights once), from a meta
    model, as `save_pretrained` names them (MoE experts one tensor per expert and projection, as vLLM's
    loader takes them, not fused as transformers holds them)."""
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    held = dict(hf_model.named_parameters())
    return {name: tuple(p.shape) for name, p in revert_weight_conversion(hf_model, held).items()}


def sum_across(value: int, group) -> int:
    """Sum of `value` (mod 2^64) over the ranks of `group` (None: this rank alone)."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        return value & fingerprint.MASK64
    limbs = torch.tensor([(value >> s) & 0xFFFF for s in range(0, 64, LIMB_BITS)], dtype=torch.int64)
    torch.distributed.all_reduce(limbs, group=group)
    return sum(int(x) << s for x, s in zip(limbs, range(0, 64, LIMB_BITS), strict=True)) & fingerprint.MASK64
