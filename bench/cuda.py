"""The library's CUDA paths on a GPU, each against a floor measured in the same run; the codec on the host.

    python -m bench.cuda [--layers 28] [--density 0.01] [--repeat 10] [--only detect,write,publish,codec]

A Qwen3-0.6B-shaped bf16 state (bench.codec.qwen3_shapes: real shapes, tied embeddings; N(0, 0.02) weights,
norms at 1) made on the GPU, and a step that moves `--density` of its elements, at random positions, by one
bf16 ulp up or down (what Adam's small steps do to bf16 weights). Times are medians of `--repeat` runs, each
from a synchronized device to a synchronized device. Parts:

- detect: change detection and fingerprint updates with both states on the GPU (deltasync.codec.changes
  `diff`, deltasync.codec.patch `fingerprint_after` and `make_patch`, `apply_changes`, and a full
  `state_fingerprint`), against one `ne` pass over the same tensors and one device-to-device copy of the
  model's bf16 bytes. "host syncs" counts the synchronizing CUDA calls of one run (torch's sync debug mode,
  one codec thread): per call, not per tensor, is the goal.
- write: applying the step to live CUDA parameters the way the vLLM worker does (deltasync/vllm/worker.py,
  `PatchWorkerExtension.deltasync_commit`: one `index_put_` per HF tensor into its destination view, rows
  of vLLM's fused qkv_proj and gate_up_proj), which is all the engine pauses for; and the worker's staging
  (a raw patch file read to the device, then `raw_changes`), outside the pause. Floor: one `index_put_` of
  the same count into one flat buffer.
- publish: the caller's blocked time in `Publisher.publish` with CUDA parameters (bf16, and fp32 master
  weights cast to bf16 on the way), against one plain `.to("cpu", bfloat16, non_blocking=True)` of every
  tensor and one `copy_` into already pinned host buffers. The publisher writes a local folder; every call is
  flushed (untimed) before the next, so the background encoder never shares the copy's time.
- codec: the CPU side of a step on this host's cores: encode (`make_patch` + compact `encode`) and decode
  (`decode` with verification + `apply_changes`), as changed elements/s and MB/s of the bf16 model, on every
  core and on one, against one `ne` pass over the same host tensors (torch, every core). Runs without a GPU
  too (`--only codec`; the states are then made on the host).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch

from bench.codec import qwen3_shapes
from deltasync.codec import patch as patches
from deltasync.codec.bf16 import bits
from deltasync.codec.changes import TensorChanges, apply_changes, diff
from deltasync.codec.fingerprint import state_fingerprint
from deltasync.codec.parallel import default_threads

State = dict[str, torch.Tensor]


def make_states(layers: int, density: float, device: str, seed: int = 0) -> tuple[State, State]:
    """A random bf16 state and the state one step later (see the module's docstring)."""
    g = torch.Generator(device).manual_seed(seed)
    old, new = {}, {}
    for name, shape in qwen3_shapes(layers).items():
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


def table(header: list[str], rows: list[list]) -> None:
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


def write_part(old: State, new: State, repeat: int) -> None:
    from safetensors.torch import load_file, save_file

    changes = diff(old, new)
    changed = sum(len(c) for c in changes.values())
    shapes = {n: tuple(t.shape) for n, t in old.items()}
    with tempfile.TemporaryDirectory(prefix="bench-cuda-") as tmp:
        path = os.path.join(tmp, "patch.safetensors")
        save_file(patches.raw_entries(changes), path)
        device = str(next(iter(old.values())).device)

        def stage() -> dict[str, TensorChanges]:  # the worker's deltasync_stage, vLLM's layout aside
            return patches.raw_changes(load_file(path, device=device), shapes)

        staged = stage()
        stage_s = median_s(stage, repeat)
        stage_syncs = host_syncs(stage)
        payload = os.path.getsize(path)

    views = vllm_views(old)
    direct = [(views[n], ch.indices, ch.values.to(views[n].dtype)) for n, ch in staged.items()]

    def commit() -> None:  # worker.py's deltasync_commit, the direct path
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

    offsets, at = {}, 0
    for name, t in old.items():
        offsets[name], at = at, at + t.numel()
    buffer = torch.cat([bits(t) for t in old.values()]).view(torch.bfloat16)
    positions = torch.cat([ch.indices + offsets[n] for n, ch in staged.items()])
    values = torch.cat([ch.values for ch in staged.values()])
    put_s = median_s(lambda: buffer.index_put_((positions,), values), repeat)
    copy_s = median_s(lambda: buffer.index_copy_(0, positions, values), repeat)

    print(
        f"### In-place write into live CUDA parameters: {changed:,} changed elements in {len(staged)} "
        f"tensors (raw patch {payload / 1e6:.1f} MB)\n"
    )
    table(
        ["step", "time", "vs floor", "host syncs", "goal"],
        [
            ["**write** (worker's commit: one `index_put_` per tensor)", f"**{ms(commit_s)}**",
             f"**{commit_s / put_s:.1f}x**", commit_syncs, "<= 20 ms pause"],
            ["the same, (row, column) indices per 2-D view", ms(boxed_s), f"{boxed_s / put_s:.1f}x", "", ""],
            ["floor: one `index_put_` of all into one flat buffer", ms(put_s), "1.0x", "", ""],
            ["one `index_copy_` of all into one flat buffer", ms(copy_s), f"{copy_s / put_s:.1f}x", "", ""],
            ["stage (outside the pause): `load_file` to the GPU + `raw_changes`", ms(stage_s),
             f"{stage_s / put_s:.1f}x", stage_syncs, ""],
        ],
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------- publish


def publish_part(old: State, new: State, repeat: int) -> None:
    from deltasync.sync.publisher import Publisher

    rows = []
    for label, cast in (("bf16", torch.bfloat16), ("fp32 (cast to bf16 in the copy)", torch.float32)):
        states = [{n: t.to(cast) for n, t in s.items()} for s in (old, new)]
        params = states[0]
        pin = torch.cuda.is_available()
        pinned = {n: torch.empty(t.shape, dtype=torch.bfloat16, pin_memory=pin) for n, t in params.items()}

        def plain_copy(params=params) -> None:
            for t in params.values():
                t.to("cpu", torch.bfloat16, non_blocking=True)

        def pinned_copy(params=params, pinned=pinned) -> None:
            for name, t in params.items():
                pinned[name].copy_(t, non_blocking=True)

        plain_s, pinned_s = median_s(plain_copy, repeat), median_s(pinned_copy, repeat)
        blocked = []
        with (
            tempfile.TemporaryDirectory(prefix="bench-cuda-root-") as root,
            Publisher(root, model="qwen3-0.6b-shapes") as publisher,
        ):
            for step in range(3 + repeat):  # steps 0-2: the anchor and the buffers' first use
                start = time.perf_counter()
                publisher.publish(states[step % 2], step=step)
                blocked.append(time.perf_counter() - start)
                publisher.flush()
        s = statistics.median(blocked[3:])
        nbytes = sum(2 * t.numel() for t in params.values())
        rows.append(
            [label, f"**{ms(s)}**", ms(plain_s), f"**{s / plain_s:.2f}x**", ms(pinned_s),
             f"{s / pinned_s:.2f}x", f"{nbytes / s / 1e9:.1f} GB/s", ms(blocked[0])]
        )  # fmt: skip
        del states, params, pinned
    print(f"### Publisher copy from CUDA into pinned host memory ({nbytes / 1e9:.2f} GB of bf16)\n")
    table(
        ["params", "`publish` blocked", 'plain `.to("cpu", bf16, non_blocking)`', "vs plain",
         "`copy_` into pinned", "vs pinned", "blocked, bf16 GB/s", "first publish (allocates)"],
        rows,
    )  # fmt: skip


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
    for threads in sorted({default_threads(), 1}, reverse=True):
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


PARTS = {"detect": detect_part, "write": write_part, "publish": publish_part, "codec": codec_part}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=28, help="decoder layers (Qwen3-0.6B has 28)")
    ap.add_argument("--density", type=float, default=0.01, help="share of elements one step changes")
    ap.add_argument("--repeat", type=int, default=10, help="runs per measurement (codec: best of 3)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    a = ap.parse_args()
    parts = a.only.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    cuda = torch.cuda.is_available()
    if not cuda:
        skipped = [p for p in parts if p != "codec"]
        if skipped:
            print(f"bench.cuda: no CUDA device here: skipping {', '.join(skipped)}")
        parts = [p for p in parts if p == "codec"]
        if not parts:
            return
    device = torch.cuda.get_device_name() if cuda else "no GPU"
    print(
        f"bench.cuda, {datetime.date.today()}: {device}, {default_threads()} CPU cores, "
        f"torch {torch.__version__}; "
        f"Qwen3-0.6B shapes, {a.layers} layers, density {a.density:g}\n"
    )
    old, new = make_states(a.layers, a.density, "cuda" if cuda else "cpu")
    for part in parts:
        PARTS[part](old, new, 3 if part == "codec" else a.repeat)


if __name__ == "__main__":
    main()
