"""The library's CUDA paths on a GPU, each against a floor measured in the same run; the codec on the host.

    python -m bench.cuda [--model 0.6b|8b] [--layers N] [--density 0.01] [--repeat 10]
                         [--only detect,step,write,engine,publish,codec,coder]

Without a GPU it says so and runs the parts that need none (publish, codec, coder).

A Qwen3-0.6B- or Qwen3-8B-shaped bf16 state (bench.codec.qwen3_shapes: real shapes, 0.6B with tied
embeddings, 8B with an lm_head; N(0, 0.02) weights, norms at 1) made on the GPU, and a step that moves
`--density` of its elements, at random positions, by one bf16 ulp up or down (what Adam's small steps do to
bf16 weights). Times are medians of `--repeat` runs, each from a synchronized device to a synchronized
device. Parts:

- detect: change detection and fingerprint updates with both states on the GPU (deltasync.codec.changes
  `diff`, deltasync.codec.patch `fingerprint_after` and `make_patch`, `apply_changes`, and a full
  `state_fingerprint`; on CUDA `diff`, `make_patch` and `state_fingerprint` run deltasync.codec.gpu's Triton
  kernels), against one `ne` pass over the same tensors and one device-to-device copy of the model's bf16
  bytes. "host syncs" counts the synchronizing CUDA calls of one run (torch's sync debug mode, one codec
  thread): per call, not per tensor, is the goal.
- step: the codec's calls in the trainer's step with the previous copy on the GPU, against the same `ne`
  pass: `make_patch` (the changes and the fingerprint's move), the compact `encode` (classes, ranks,
  symbols and the rANS coder on the GPU; the host chooses the classes and pools the models), bytes ready
  (both: what the publisher's background runs after `publish` returns; the publish part measures it
  through the Publisher), rolling a previous copy forward (`apply_changes`);
  the replica's compact bytes to weights written and verified on the GPU (deltasync.codec.gpu
  `PatchSymbols.changes` and `moves`, then `apply_changes`); beside the host path's `encode` of the same
  patch (old weights copied to the host), whose bytes must be the same; every result checked bit for bit
  first. The replica row decodes in this process, against weights on this GPU; the follower handing the
  bytes to vLLM's workers and its peak RSS are measured by the follower's own bench and tests
  (deltasync/vllm), not here.
- write: the writes themselves into live CUDA parameters laid out as vLLM holds them (one `index_put_` per
  HF tensor into its destination view, rows of vLLM's fused qkv_proj and gate_up_proj), and a raw patch
  file read to the device and parsed (`raw_changes`). Floor: one `index_put_` of the same count into one
  flat buffer.
- engine: the weight-transfer engine itself (deltasync/vllm/engine.py `DeltasyncEngine`, its `Layout`
  learned from the model's `load_weights` by layout.py) on a CUDA stand-in model with vLLM's fused
  parameters and tied embeddings, handed compact patch files as the follower hands them: `update_weights`
  of kind "stage" (read, checks, decode against the parameters on the GPU, `Layout.plan_patch`, while
  generation runs) and of kind "delta" (what runs between pause and resume), alternating a step and its
  reverse, each written state checked bit for bit. Floor: as for write.
- publish: the trainer's side of a step through `Publisher` (a local folder), for both places of the previous
  copy (`PublisherConfig.previous_copy`): "device" (bf16 buffers beside the CUDA weights; the GPU codec diffs
  and ranks there) and "host" (pinned host buffers; the host codec diffs), with bf16 params and fp32 master
  weights cast on the way: the caller's blocked time in `publish` ("trainer blocked") against the copy alone,
  the background's diff + encode from the publisher's telemetry (`encode_s`: "trainer bytes ready" after
  `publish` returns), the time to the head read back, and the GPU memory the publisher held (peak allocated
  over the run, per parameter: the two bf16 copies and the codec's scratch). Every call is flushed
  (untimed) before the next, so the background never shares the copy's time. Runs without a GPU too (then
  both settings keep host copies: the CPU trainer's numbers).
- codec: the CPU side of a step on this host's cores: encode (`make_patch` + compact `encode`) and decode
  (`decode` with verification + `apply_changes`), as changed elements/s and MB/s of the bf16 model, on every
  core and on one, against one `ne` pass over the same host tensors (torch, every core). Runs without a GPU
  too (`--only codec`; the states are then made on the host).
- coder: the rANS stage alone: every chunk stream of the step decoded on the host, tensor by tensor and all
  on one pool, and on the GPU where there is one (`gpu.PatchSymbols`: a program per chunk); every chunk's
  symbols encoded (as `encode` does, on the host), on every core and on one. Runs without a GPU too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import struct
import tempfile
import time
import types
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from bench.codec import qwen3_shapes
from deltasync.codec import compact, host
from deltasync.codec import patch as patches
from deltasync.codec.bf16 import bits
from deltasync.codec.changes import TensorChanges, apply_changes, diff
from deltasync.codec.fingerprint import MASK64, state_fingerprint
from deltasync.codec.parallel import default_threads, parallel_map

State = dict[str, torch.Tensor]


def make_states(
    model: str, layers: int, density: float, device: str, seed: int = 0, names: tuple[str, ...] | None = None
) -> tuple[State, State]:
    """A random bf16 state and the state one step later (see the module's docstring); `names`: only those."""
    g = torch.Generator(device).manual_seed(seed)
    old, new = {}, {}
    for name, shape in qwen3_shapes(layers, model).items():
        if names is not None and name not in names:
            continue
        if len(shape) == 1:
            t = torch.ones(shape, device=device, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g, device=device) * 0.02).to(torch.bfloat16)
        u = torch.rand(t.numel(), generator=g, device=device)
        ulps = (u < density / 2).to(torch.int16) - ((u >= density / 2) & (u < density)).to(torch.int16)
        old[name], new[name] = t, (bits(t) + ulps).view(torch.bfloat16).view(shape)
    return old, new


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_s(fn: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None) -> float:
    """Median seconds of `fn()` from a synchronized device to a synchronized device; `setup` untimed."""
    seconds = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def host_syncs(fn: Callable[[], object]) -> int:
    """Synchronizing CUDA calls made by `fn()` in this thread."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note, once, that the mode is a prototype
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


def table(header: list[str], rows: Iterable[list]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|---" * len(header) + "|")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |", flush=True)
    print()


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


# ----------------------------------------------------------------------------------------------- detect


def copy_seconds(flat: torch.Tensor, repeat: int) -> float:
    """One device-to-device copy of `flat`."""
    target = torch.empty_like(flat)
    return median_s(lambda: target.copy_(flat), repeat)


def detect_part(old: State, new: State, repeat: int) -> None:
    numel = sum(t.numel() for t in old.values())
    old_bits, new_bits = [bits(t) for t in old.values()], [bits(t) for t in new.values()]
    ne_s = median_s(lambda: [a != b for a, b in zip(old_bits, new_bits, strict=True)], repeat)
    copy_s = copy_seconds(torch.cat(new_bits), repeat)

    changes = diff(old, new)
    expected = {n: torch.nonzero(bits(new[n]) != bits(t)).squeeze(1) for n, t in old.items()}
    assert changes.keys() == {n for n, e in expected.items() if e.numel()}, "diff: wrong tensors"
    for name, ch in changes.items():
        assert torch.equal(ch.indices, expected[name]), f"diff: wrong positions in {name}"
        assert torch.equal(bits(ch.values), bits(new[name])[expected[name]]), f"diff: wrong values in {name}"
    changed = sum(len(c) for c in changes.values())
    base_fp = state_fingerprint(old)
    host_changes = {n: TensorChanges(c.indices.cpu(), c.values.cpu()) for n, c in changes.items()}
    host_old = {n: t.cpu() for n, t in old.items()}
    fp = patches.fingerprint_after(base_fp, old, changes)
    assert fp == patches.fingerprint_after(base_fp, host_old, host_changes, 1), "fingerprint: CUDA != host"
    assert state_fingerprint(new) == fp == state_fingerprint({n: t.cpu() for n, t in new.items()})
    target = {n: t.clone() for n, t in old.items()}
    apply_changes(target, changes)
    assert all(torch.equal(bits(target[n]), bits(new[n])) for n in new), "apply_changes: wrong state"

    calls = {
        "`diff` (changes.py)": lambda threads=None: diff(old, new, threads),
        "`fingerprint_after` (patch.py)": lambda threads=None: patches.fingerprint_after(
            base_fp, old, changes, threads
        ),
        "`make_patch` (both above)": lambda threads=None: patches.make_patch(
            old, new, 1, 0, base_fp, threads
        ),
        "`apply_changes` (changes.py)": lambda threads=None: apply_changes(target, changes, threads),
        "`state_fingerprint`, full pass (fingerprint.py)": lambda threads=None: state_fingerprint(old),
    }
    print(
        f"### Change detection on CUDA: {len(old)} tensors, {numel / 1e6:.0f}M elements, "
        f"{changed:,} changed ({changed / numel:.2%})\n\n"
        f"Floors: one `ne` pass over the same tensors {ms(ne_s)}; one device-to-device copy of the model's "
        f"bf16 bytes {ms(copy_s)} ({4 * numel / copy_s / 1e9:.0f} GB/s read + written).\n"
    )
    rows = []
    for label, call in calls.items():
        call()  # warm-up
        s = median_s(call, repeat)
        syncs = host_syncs(lambda call=call: call(1))
        rows.append([label, ms(s), f"**{s / ne_s:.1f}x**", f"{s / copy_s:.1f}x", syncs])
    table(["call", "time", "vs `ne` pass", "vs D2D copy", f"host syncs (of {len(old)} tensors)"], rows)


# ----------------------------------------------------------------------------------------------- step


def canonical(data: bytes) -> tuple[dict, bytes]:
    """A patch's parsed header and its payload (safetensors writes `__metadata__` keys in no fixed order)."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def compact_streams(data: bytes) -> tuple[dict[str, list[bytes]], compact.Tables, int]:
    """The chunk streams of each compact tensor of a patch, the patch's rANS tables and its chunk size."""
    from safetensors.torch import load

    meta = canonical(data)[0]["__metadata__"]
    dense = json.loads(meta["dense"])
    streams = {n: compact.split_chunks(t.numpy().tobytes()) for n, t in load(data).items() if n not in dense}
    return streams, compact.Models.from_json(json.loads(meta["models"])).tables(), int(meta["chunk"])


def step_part(old: State, new: State, repeat: int) -> None:
    numel = sum(t.numel() for t in old.values())
    old_bits, new_bits = [bits(t) for t in old.values()], [bits(t) for t in new.values()]
    ne_s = median_s(lambda: [a != b for a, b in zip(old_bits, new_bits, strict=True)], repeat)
    base_fp = state_fingerprint(old)
    patch = patches.make_patch(old, new, 1, 0, base_fp)
    assert patch.fingerprint == state_fingerprint({n: t.cpu() for n, t in new.items()}), (
        "make_patch: fingerprint"
    )
    data = patches.encode(patch, old, "compact")
    on_host = patches.encode(patch, old, "compact", make_streams=host.host_streams)
    assert canonical(data) == canonical(on_host), "encode: the GPU's bytes differ from the host path's"
    target = {n: t.to("cpu", copy=True) for n, t in old.items()}
    apply_changes(target, patches.decode(data, target, base_fp).changes)
    assert all(torch.equal(bits(target[n]), bits(new[n]).cpu()) for n in new), "host decode: wrong state"
    del target
    previous = {n: t.clone() for n, t in old.items()}
    streams, tables, chunk = compact_streams(data)
    assert len(streams) == len(patch.changes), "the replica row decodes compact tensors only"
    written = {n: t.clone() for n, t in old.items()}

    def replica(threads: int | None = None) -> None:
        """Compact bytes in host memory to weights written and verified, decoded where the weights are."""
        from deltasync.codec import gpu

        changes, moves = {}, []
        numels = {name: old[name].numel() for name in streams}
        device = next(iter(old.values())).device
        symbols = gpu.PatchSymbols(streams, numels, chunk, tables, device, old.__getitem__)
        for name in streams:
            positions, after = symbols.changes(name)
            changes[name] = TensorChanges(positions, after.view(torch.bfloat16))
            moves.append(gpu.moves(name, positions, bits(old[name]).view(-1)[positions], after))
        moved = base_fp + gpu.total_move(moves)
        assert moved & MASK64 == patch.fingerprint, "replica: fingerprint mismatch"
        apply_changes(written, changes, threads)

    replica()
    assert all(torch.equal(bits(written[n]), bits(new[n])) for n in new), "replica: wrong weights"

    def bytes_ready(threads: int | None = None) -> bytes:
        return patches.encode(patches.make_patch(old, new, 1, 0, base_fp, threads), old, "compact", threads)

    calls = {
        "`make_patch` (changes and fingerprint move)": (
            lambda threads=None: patches.make_patch(old, new, 1, 0, base_fp, threads),
            "<= 20x `ne`",
        ),
        "compact `encode` (`gpu.compact_streams`: classes, ranks, symbols, rANS on the GPU)": (
            lambda threads=None: patches.encode(patch, old, "compact", threads),
            "",
        ),
        "**bytes ready**: `make_patch` + `encode`": (bytes_ready, "<= 300 ms at 8B"),
        "roll the previous copy forward: `apply_changes`": (
            lambda threads=None: apply_changes(previous, patch.changes, threads),
            "",
        ),
        "**replica**: compact bytes in host memory to written and verified (`gpu.PatchSymbols`: the rANS "
        "coder, a program per chunk, then ranks, classes, positions, values, a run of tensors at a time; "
        "`gpu.moves`: the fingerprint; `apply_changes`)": (
            replica,
            "<= 150 ms at 8B",
        ),
        "host path's `encode` of the same patch (old weights to the host)": (
            lambda threads=None: patches.encode(
                patch, old, "compact", threads, make_streams=host.host_streams
            ),
            "the same bytes",
        ),
    }

    def row(label: str, call: Callable[..., object], goal: str) -> list:
        call()  # warm-up (Triton compiles each kernel once per process)
        host = "host path" in label  # its host syncs are not the point, and one thread takes long at 8B
        s = median_s(call, min(repeat, 3) if host else repeat)
        syncs = "-" if host else host_syncs(lambda: call(1))
        return [label, ms(s), f"{s / ne_s:.1f}x", syncs, goal]

    changed = patch.changed
    print(
        f"### The trainer's step on the GPU, previous copy on the GPU ({2 * numel / 1e9:.1f} GB: 2 B per "
        f"parameter): {changed:,} changed elements ({changed / numel:.2%}), compact patch "
        f"{len(data) / 1e6:.1f} MB, the same bytes as the host path's\n\n"
        f"Floor: one `ne` pass over the same tensors {ms(ne_s)}. Median of {repeat}. The replica's decode "
        f"runs here in one process, against the old weights on this GPU; the follower handing the bytes to "
        f"vLLM's workers, and its peak RSS, are not measured here (the follower's own bench and tests).\n"
    )
    rows = (row(label, call, goal) for label, (call, goal) in calls.items())  # each printed when measured
    table(["call", "time", "vs `ne` pass", "host syncs", "goal"], rows)


# ----------------------------------------------------------------------------------------------- write


def vllm_views(old: State) -> dict[str, torch.Tensor]:
    """Live parameters laid out as vLLM holds a Qwen3 (q|k|v rows in one qkv_proj, gate|up rows in one
    gate_up_proj), and, per HF tensor, the contiguous view the worker writes (its `_deltasync_views`)."""
    views, fused = {}, {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu"}
    groups: dict[str, list[str]] = {}
    for name in old:
        kind = name.split(".")[-2]
        if kind in fused:
            groups.setdefault(name.rsplit(".", 3)[0] + "." + fused[kind], []).append(name)
        else:
            views[name] = old[name].clone()
    for names in groups.values():
        param = torch.cat([old[n] for n in names])  # one fused parameter, members in row order
        rows = 0
        for n in names:
            views[n] = param[rows : rows + old[n].shape[0]]
            rows += old[n].shape[0]
    assert all(v.is_contiguous() for v in views.values())
    return views


def flat_writes(old: State, changes: dict[str, TensorChanges]) -> tuple[torch.Tensor, ...]:
    """For the floor: one flat buffer of `old`, and all of `changes` as positions and values in it."""
    offsets, at = {}, 0
    for name, t in old.items():
        offsets[name], at = at, at + t.numel()
    buffer = torch.cat([bits(t) for t in old.values()]).view(torch.bfloat16)
    positions = torch.cat([ch.indices.to(torch.int64) + offsets[n] for n, ch in changes.items()])
    return buffer, positions, torch.cat([ch.values for ch in changes.values()])


def write_part(old: State, new: State, repeat: int) -> None:
    from safetensors.torch import load_file, save_file

    changes = diff(old, new)
    changed = sum(len(c) for c in changes.values())
    shapes = {n: tuple(t.shape) for n, t in old.items()}
    with tempfile.TemporaryDirectory(prefix="bench-cuda-") as tmp:
        path = os.path.join(tmp, "patch.safetensors")
        save_file(patches.raw_entries(changes), path)
        device = str(next(iter(old.values())).device)

        def stage() -> dict[str, TensorChanges]:
            return patches.raw_changes(load_file(path, device=device), shapes)

        staged = stage()
        stage_s = median_s(stage, repeat)
        stage_syncs = host_syncs(stage)
        payload = os.path.getsize(path)

    views = vllm_views(old)
    direct = [(views[n], ch.indices, ch.values.to(views[n].dtype)) for n, ch in staged.items()]

    def commit() -> None:  # the writes of the engine's direct path, flat positions per view
        for view, positions, values in direct:
            view.view(-1).index_put_((positions,), values)

    commit()
    assert all(torch.equal(bits(views[n]), bits(new[n])) for n in new), "worker write: wrong weights"
    commit_s = median_s(commit, repeat)
    commit_syncs = host_syncs(commit)
    boxed = [(v, (p,) if v.dim() == 1 else (p // v.shape[1], p % v.shape[1]), x) for v, p, x in direct]

    def commit_boxed() -> None:  # the same writes, as (row, column) indices into each 2-D view
        for view, index, values in boxed:
            view.index_put_(index, values)

    boxed_s = median_s(commit_boxed, repeat)

    buffer, positions, values = flat_writes(old, staged)
    put_s = median_s(lambda: buffer.index_put_((positions,), values), repeat)
    copy_s = median_s(lambda: buffer.index_copy_(0, positions, values), repeat)

    print(
        f"### In-place write into live CUDA parameters: {changed:,} changed elements in {len(staged)} "
        f"tensors (raw patch {payload / 1e6:.1f} MB)\n"
    )
    table(
        ["step", "time", "vs floor", "host syncs", "goal"],
        [
            ["**write** (one `index_put_` per tensor, flat positions)", f"**{ms(commit_s)}**",
             f"**{commit_s / put_s:.1f}x**", commit_syncs, "<= 20 ms pause"],
            ["the same, (row, column) indices per 2-D view", ms(boxed_s), f"{boxed_s / put_s:.1f}x", "", ""],
            ["floor: one `index_put_` of all into one flat buffer", ms(put_s), "1.0x", "", ""],
            ["one `index_copy_` of all into one flat buffer", ms(copy_s), f"{copy_s / put_s:.1f}x", "", ""],
            ["stage (outside the pause): `load_file` to the GPU + `raw_changes`", ms(stage_s),
             f"{stage_s / put_s:.1f}x", stage_syncs, ""],
        ],
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------- engine


def vllm_stand_ins() -> None:
    """Where vLLM is not installed (a GPU host that runs only this bench), stand-ins for the few vLLM names
    engine.py imports, each doing what vLLM's does for a single-rank CUDA worker."""
    import logging
    import sys
    from typing import Generic, TypeVar

    try:
        import vllm.distributed.weight_transfer.base  # noqa: F401
    except ImportError:
        pass
    else:
        return

    class WeightTransferEngine(Generic[TypeVar("I"), TypeVar("U")]):
        """vllm.distributed.weight_transfer.base's: holds the model; `update_weights` parses the dict,
        receives it, then synchronizes the device (vLLM's `torch.accelerator.synchronize()`)."""

        def __init__(self, config, vllm_config, device, model) -> None:
            self.config, self.vllm_config, self.device, self.model = config, vllm_config, device, model
            self.model_config = vllm_config.model_config

        def parse_update_info(self, update_dict):
            return self.update_info_cls(**update_dict)  # type: ignore[attr-defined]

        def update_weights(self, update_info: dict) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # type: ignore[attr-defined]
            torch.cuda.synchronize()

    def unused(*args, **kwargs):  # vLLM's loader path (write="vllm"), which this bench does not take
        raise NotImplementedError

    group = types.SimpleNamespace(world_size=1, cpu_group=None)  # one rank holds the whole model
    names = {
        "vllm": {},
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.distributed": {},
        "vllm.distributed.parallel_state": {"get_world_group": lambda: group},
        "vllm.distributed.weight_transfer": {},
        "vllm.distributed.weight_transfer.base": {
            "WeightTransferEngine": WeightTransferEngine,
            "WeightTransferInitInfo": type("WeightTransferInitInfo", (), {}),
            "WeightTransferUpdateInfo": type("WeightTransferUpdateInfo", (), {}),
        },
        "vllm.model_executor": {},
        "vllm.model_executor.model_loader": {},
        "vllm.model_executor.model_loader.checkpoint_weight_patch": {
            "CheckpointWeightPatch": unused,
            "load_checkpoint_weight_patches": unused,
        },
        "vllm.platforms": {"current_platform": types.SimpleNamespace(is_cpu=lambda: False)},
    }
    for name, attrs in names.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module


class FusedQwen3(torch.nn.Module):
    """A stand-in for vLLM's Qwen3 on CUDA: its parameters (vllm_views' fused qkv_proj and gate_up_proj),
    and a `load_weights` that copies each HF tensor into its view as vLLM's stacked-parameter loader does
    and skips a tied lm_head."""

    def __init__(self, old: State) -> None:
        super().__init__()
        self.views = vllm_views(old)
        views = self.views.values()
        bases = {v.untyped_storage().data_ptr(): v if v._base is None else v._base for v in views}
        self.params = torch.nn.ParameterList(torch.nn.Parameter(t, False) for t in bases.values())

    def load_weights(self, weights) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and name not in self.views:  # tied to the embeddings
                continue
            self.views[name].copy_(tensor)  # KeyError for a name this model has not: vLLM raises too
            loaded.add(name)
        return loaded


def engine_part(old: State, new: State, repeat: int) -> None:
    from transformers import Qwen3Config

    vllm_stand_ins()
    from deltasync.codec.fingerprint import format_fingerprint
    from deltasync.vllm.engine import DeltasyncEngine
    from deltasync.vllm.layout import Layout

    layers = sum(n.endswith("input_layernorm.weight") for n in old)
    hidden, inter = old["model.norm.weight"].shape[0], old["model.layers.0.mlp.up_proj.weight"].shape[0]
    heads = old["model.layers.0.self_attn.q_proj.weight"].shape[0] // 128
    hf_config = Qwen3Config(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=8, head_dim=128, vocab_size=old["model.embed_tokens.weight"].shape[0],
        tie_word_embeddings="lm_head.weight" not in old,
    )  # fmt: skip
    model = FusedQwen3(old)
    model_config = types.SimpleNamespace(hf_config=hf_config)
    vllm_config = types.SimpleNamespace(model_config=model_config, parallel_config=None)
    engine = DeltasyncEngine(None, vllm_config, old["model.norm.weight"].device, model)
    start = time.perf_counter()
    engine.init_transfer_engine(engine.init_info_cls(root="bench"))
    learn_s = time.perf_counter() - start
    layout: Layout = engine.layout  # type: ignore[assignment]
    fps = [format_fingerprint(state_fingerprint(s)) for s in (old, new)]
    assert format_fingerprint(engine.fingerprint) == fps[0], "engine: weights read at start != old state"

    forward = diff(old, new)
    changed = sum(len(c) for c in forward.values())
    with tempfile.TemporaryDirectory(prefix="bench-cuda-engine-") as tmp:
        steps = []  # (update info, the state it leads to): a step and its reverse, alternating
        for step in range(2 + repeat):
            before, after = (old, new) if step % 2 == 0 else (new, old)
            patch = patches.make_patch(before, after, step, step - 1, int(fps[step % 2], 16))
            path = Path(tmp, f"{step}.safetensors")  # what the follower hands the workers: compact bytes
            path.write_bytes(patches.encode(patch, before, "compact"))
            info = {"paths": [str(path)], "base": fps[step % 2], "fingerprint": fps[1 - step % 2]}
            steps.append((info, after))
        payload = os.path.getsize(steps[0][0]["paths"][0])
        stage_s, pause_s, stage_syncs, pause_syncs = [], [], [], []
        for step in range(1 + repeat):  # step 0: warm-up
            info, target = steps[step]
            staged = {**info, "step": step, "kind": "stage"}
            delta = {**info, "step": step, "kind": "delta"}
            if step in (1, 2):  # one of each direction, counted separately from the timed runs
                # planned again below, untouched by the sync debug mode
                stage_syncs.append(host_syncs(lambda s=staged: engine.update_weights(s)))
            sync()
            start = time.perf_counter()
            engine.update_weights(staged)
            stage_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            # What runs between pause and resume: vLLM's start_weight_update, update_weights, finish.
            engine.start_weight_update()
            engine.update_weights(delta)
            engine.finish_weight_update()
            pause_s.append(time.perf_counter() - start)
            assert engine.step == step and format_fingerprint(engine.fingerprint) == fps[(step + 1) % 2]
            assert all(torch.equal(bits(model.views[n]), bits(target[n])) for n in target), (
                f"engine: step {step}: written weights != expected state"
            )
        info, target = steps[1 + repeat]
        engine.update_weights({**info, "step": repeat + 1, "kind": "stage"})
        pause_syncs.append(host_syncs(lambda: engine.update_weights({**info, "step": repeat + 1})))
        assert all(torch.equal(bits(model.views[n]), bits(target[n])) for n in target)

    buffer, positions, values = flat_writes(old, forward)
    put_s = median_s(lambda: buffer.index_put_((positions,), values), repeat)
    stage, pause = statistics.median(stage_s[1:]), statistics.median(pause_s[1:])
    blocks = sum(len(b) for b in layout.blocks.values())
    print(
        f"### The engine (deltasync/vllm/engine.py) on a CUDA stand-in of vLLM's Qwen3: {changed:,} changed "
        f"elements (compact patch {payload / 1e6:.1f} MB), {blocks} blocks learned in {learn_s:.1f} s\n\n"
        f"Each step and its reverse alternate; after every write the parameters equal the expected state bit "
        f"for bit and the engine's fingerprint the promised one. Median of {repeat}.\n"
    )
    table(
        ["part", "time", "vs floor", "host syncs", "goal"],
        [
            ["**pause**: `update_weights` kind delta (start/finish included), staged", f"**{ms(pause)}**",
             f"**{pause / put_s:.1f}x**", pause_syncs[0], "<= 20 ms"],
            ["stage, outside the pause: `update_weights` kind stage (read, checks, decode, plan)", ms(stage),
             f"{stage / put_s:.1f}x", " / ".join(map(str, stage_syncs)), ""],
            ["floor: one `index_put_` of all into one flat buffer", ms(put_s), "1.0x", "", ""],
        ],
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------- publish


def publish_part(old: State, new: State, repeat: int) -> None:
    from deltasync import telemetry
    from deltasync.sync.publisher import Publisher, PublisherConfig

    cuda = torch.cuda.is_available()
    numel = sum(t.numel() for t in old.values())
    old_bits, new_bits = [bits(t) for t in old.values()], [bits(t) for t in new.values()]
    ne_s = median_s(lambda: [a != b for a, b in zip(old_bits, new_bits, strict=True)], repeat)
    rows, density = [], 0.0
    for label, cast in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for setting in ("device", "host"):
            held = 4 * numel if setting == "device" else 0  # the publisher's two bf16 copies
            needed = 2 * numel * cast.itemsize * (cast != torch.bfloat16) + held
            if cuda and torch.cuda.mem_get_info()[0] < 1.1 * needed:
                print(f"publish, {label}, {setting}: skipped, needs {needed / 1e9:.0f} GB more GPU memory\n")
                continue
            states = [{n: t.to(cast) for n, t in s.items()} for s in (old, new)]  # (bf16: the same tensors)
            floors = publish_floors(states[0], setting, repeat)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            blocked, published = [], []
            with tempfile.TemporaryDirectory(prefix="bench-cuda-root-") as root:
                config = PublisherConfig(previous_copy=setting)
                with Publisher(root, model="qwen3-shapes", config=config) as publisher:
                    for step in range(3 + repeat):  # steps 0-2: the anchor and the buffers' first use
                        start = time.perf_counter()
                        publisher.publish(states[step % 2], step=step)
                        blocked.append(time.perf_counter() - start)
                        publisher.flush()  # the background never shares the next copy's time
                        published.append(time.perf_counter() - start - blocked[-1])
                records = [
                    telemetry.from_json(telemetry.TrainerRecord, p.read_bytes())
                    for p in sorted(Path(root, telemetry.TRAINER_DIR).glob("step-*.json"))
                ]
            held_b = (torch.cuda.max_memory_allocated() - base) / numel if cuda else 0.0
            deltas = [r for r in records[3:] if r.kind == "delta"]
            ready, density = statistics.median(r.encode_s for r in deltas), deltas[0].density
            s = statistics.median(blocked[3:])
            rows.append(
                [f"{label}, **{setting}**", f"**{ms(s)}**", f"{s / ne_s:.1f}x", floors, f"**{ms(ready)}**",
                 ms(statistics.median(published[3:])), f"{held_b:.1f} B" if cuda else "-", ms(blocked[0])]
            )  # fmt: skip
            # Each row as soon as it is measured: kept if a later setting fails.
            print(f"publish, {label}, {setting}: " + " | ".join(rows[-1]), flush=True)
            del states
    print(
        f"### `Publisher.publish`, weights on {'CUDA' if cuda else 'the host'}: the previous copy on the "
        f"device or in host memory (`PublisherConfig.previous_copy`), {2 * numel / 1e9:.2f} GB of bf16\n\n"
        f"Each step is flushed (untimed) before the next, so the background never shares the copy's time; "
        f"steps alternate between two states a {density:.2%} "
        f"step apart. Floor: one `ne` pass {ms(ne_s)}. Median of {repeat}.\n"
    )
    table(
        ["params, previous copy", "**trainer blocked**: `publish`", "vs `ne` pass", "the copy alone",
         "**trainer bytes ready** after `publish` returns (`encode_s`: diff + encode)",
         "published: bytes to head read back (local folder)", "GPU bytes per parameter held",
         "first publish"],
        rows,
    )  # fmt: skip


def publish_floors(params: State, setting: str, repeat: int) -> str:
    """What the copy alone costs: into bf16 buffers beside the weights (device), or into pinned host buffers
    and with a plain `.to("cpu", bf16, non_blocking=True)` (host)."""
    if setting == "device":
        buffers = {n: torch.empty(t.shape, dtype=torch.bfloat16, device=t.device) for n, t in params.items()}
    else:
        pin = torch.cuda.is_available()
        buffers = {n: torch.empty(t.shape, dtype=torch.bfloat16, pin_memory=pin) for n, t in params.items()}

    def copy() -> None:
        for name, t in params.items():
            buffers[name].copy_(t, non_blocking=True)

    copy_s = median_s(copy, repeat)
    if setting == "device":
        return f"{ms(copy_s)} (`copy_` on the device)"
    plain_s = median_s(
        lambda: [t.to("cpu", torch.bfloat16, non_blocking=True) for t in params.values()], repeat
    )
    return f"{ms(copy_s)} (`copy_` into pinned), {ms(plain_s)} (plain `.to`)"


# ----------------------------------------------------------------------------------------------- codec


def codec_part(old: State, new: State, repeat: int) -> None:
    old = {n: t.cpu() for n, t in old.items()}
    new = {n: t.cpu() for n, t in new.items()}
    numel = sum(t.numel() for t in old.values())
    old_bits, new_bits = [bits(t) for t in old.values()], [bits(t) for t in new.values()]

    def ne_pass() -> list[torch.Tensor]:
        return [a != b for a, b in zip(old_bits, new_bits, strict=True)]

    ne_s = min(median_s(ne_pass, 1) for _ in range(5))
    base_fp = state_fingerprint(old)
    rows = []
    for threads in sorted({default_threads(), 1 if numel < 2e9 else default_threads()}, reverse=True):
        encode_s, decode_s = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            patch = patches.make_patch(old, new, 1, 0, base_fp, threads)
            data = patches.encode(patch, old, "compact", threads)
            encode_s.append(time.perf_counter() - start)
            target = {n: t.clone() for n, t in old.items()}
            start = time.perf_counter()
            apply_changes(target, patches.decode(data, target, base_fp, threads).changes, threads)
            decode_s.append(time.perf_counter() - start)
            assert all(torch.equal(bits(target[n]), bits(new[n])) for n in new), "round trip not exact"
        changed = patch.changed
        for part, s in (("encode", min(encode_s)), ("decode + verify + apply", min(decode_s))):
            rows.append(
                [threads, part, ms(s), f"{changed / s / 1e6:.0f} M/s", f"{2 * numel / s / 1e6:,.0f} MB/s",
                 f"{s / ne_s:.1f}x"]
            )  # fmt: skip
    print(
        f"### Codec on the host's CPU ({default_threads()} cores): a step of {changed:,} changed elements "
        f"({changed / numel:.2%}) of {numel / 1e6:.0f}M, compact patch {len(data) / 1e6:.1f} MB\n\n"
        f"Floor: one `ne` pass over the same host tensors (torch, {torch.get_num_threads()} threads): "
        f"{ms(ne_s)}. Best of {repeat}.\n"
    )
    table(["threads", "part", "time", "changed elements/s", "model MB/s (bf16)", "vs `ne` pass"], rows)


def coder_part(old: State, new: State, repeat: int) -> None:
    """The rANS stage alone: decoding every chunk stream of a step on the host tensor by tensor (a tensor's
    chunks on the pool, then the next tensor) and all chunks of all tensors on the pool at once, and on the
    GPU (a program per chunk, every chunk at once); encoding every chunk's symbols (as `encode` does)."""
    old = {n: t.cpu() for n, t in old.items()}
    new = {n: t.cpu() for n, t in new.items()}
    numel = sum(t.numel() for t in old.values())
    patch = patches.make_patch(old, new, 1, 0)
    data = patches.encode(patch, old, "compact")
    streams, tables, chunk = compact_streams(data)
    sizes = {n: [min(chunk, old[n].numel() - lo) for lo in range(0, old[n].numel(), chunk)] for n in streams}
    work = {n: list(zip(parts, sizes[n], strict=True)) for n, parts in streams.items()}
    symbols = host.host_symbols({n: patch.changes[n] for n in streams}, old, chunk)

    def decode(pairs: list, threads: int) -> None:
        parallel_map(lambda w: compact.ranked_changes(*w, tables), pairs, threads)

    calls = {
        "rANS decode, tensor by tensor": lambda t: [decode(w, t) for w in work.values()],
        "rANS decode, every chunk of the step on one pool": lambda t: decode(
            [w for pairs in work.values() for w in pairs], t
        ),
        "rANS encode, every chunk on one pool (`encode`)": lambda t: parallel_map(
            lambda c: compact.encode_chunk(c, tables), [c for parts in symbols.values() for c in parts], t
        ),
    }
    chunks = sum(len(w) for w in work.values())
    print(
        f"### The rANS stage on the host's CPU ({default_threads()} cores): {patch.changed:,} changed "
        f"elements of {numel / 1e6:.0f}M in {chunks} chunks of {len(work)} tensors, compact patch "
        f"{len(data) / 1e6:.1f} MB. Best of {repeat}.\n"
    )
    rows = []
    for label, call in calls.items():
        for threads in sorted({default_threads(), 1}, reverse=True):
            call(threads)  # warm-up (numba compiles once per process)
            s = min(median_s(lambda c=call, t=threads: c(t), 1) for _ in range(repeat))
            rows.append([label, threads, ms(s), f"{patch.changed / s / 1e6:.0f} M/s"])
    if torch.cuda.is_available():
        from deltasync.codec import gpu

        numels = {n: old[n].numel() for n in streams}

        def on_gpu(rank: bool) -> None:
            symbols = gpu.PatchSymbols(streams, numels, chunk, tables, torch.device("cuda"), old.__getitem__)
            for name in streams if rank else ():
                symbols.changes(name)

        for label, rank in {
            "rANS decode on the GPU, a program per chunk, every chunk at once (`gpu.PatchSymbols`)": False,
            "the same, then every tensor's positions and new patterns (`PatchSymbols.changes`)": True,
        }.items():
            on_gpu(rank)  # warm-up (Triton compiles once per process)
            s = min(median_s(lambda r=rank: on_gpu(r), 1) for _ in range(repeat))
            rows.append([label, "GPU", ms(s), f"{patch.changed / s / 1e6:.0f} M/s"])
    table(["stage", "threads", "time", "changed elements/s"], rows)


# Parts that also run without a GPU (publish: both settings are the host).
ON_THE_HOST = ("publish", "codec", "coder")
PARTS = {
    "detect": detect_part,
    "step": step_part,
    "write": write_part,
    "engine": engine_part,
    "publish": publish_part,
    "codec": codec_part,
    "coder": coder_part,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("0.6b", "8b"), default="0.6b", help="Qwen3-0.6B or Qwen3-8B shapes")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the model's, 28 or 36)")
    ap.add_argument("--density", type=float, default=0.01, help="share of elements one step changes")
    ap.add_argument("--repeat", type=int, default=10, help="runs per measurement (codec: best of 3)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    a = ap.parse_args()
    parts = a.only.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    cuda = torch.cuda.is_available()
    model = f"qwen3-{a.model}"
    layers = a.layers if a.layers is not None else 36 if a.model == "8b" else 28
    device = torch.cuda.get_device_name() if cuda else "no GPU"
    print(
        f"bench.cuda, {datetime.date.today()}: {device}, {default_threads()} CPU cores, "
        f"torch {torch.__version__}; "
        f"Qwen3-{a.model.upper()} shapes, {layers} layers, density {a.density:g}\n"
    )
    if not cuda:
        skipped = [p for p in parts if p not in ON_THE_HOST]
        if skipped:
            print(f"No CUDA device here: skipping {', '.join(skipped)}\n")
        parts = [p for p in parts if p in ON_THE_HOST]
        if not parts:
            return
    old, new = make_states(model, layers, a.density, "cuda" if cuda else "cpu")
    for part in parts:
        PARTS[part](old, new, 3 if part in ("codec", "coder") else a.repeat)


if __name__ == "__main__":
    main()
