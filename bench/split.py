"""A tensor-parallel rank's decode of its parts of a step (deltasync.vllm.split), against floors.

    python -m bench.split [--model 0.6b|8b] [--tp 2] [--density 0.01] [--repeat 3]

The two kinds of split tensor at Qwen3 shapes: the vocab-parallel embedding (each rank holds a run of rows;
the largest shard of the model) and a layer's row-parallel `down_proj` (each rank holds a slice of every
row: one segment per row and rank). A step moves `--density` of their elements by one bf16 ulp (as
bench.cuda's steps do) and is encoded compact; `decode_held` then decodes it against TP blocks, one per rank,
all held by this process (a process group of one: every rank's segments, counted and gathered as at TP), on
the GPU where there is one. Per tensor: the time against one `ne` pass over the same elements, and the
transient memory beyond the weights and the patch (peak allocated on a GPU, peak resident on a host) per
held element and against the held bf16 bytes. Every decode is checked against the step's changes.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from bench.cuda import make_states, median_s, ms, table
from bench.sync import peak_rss
from deltasync.codec import patch as patches
from deltasync.codec.bf16 import bits
from deltasync.codec.parallel import default_threads
from deltasync.vllm.layout import Block
from deltasync.vllm.split import decode_held


def tp_blocks(t: torch.Tensor, tp: int, by_rows: bool) -> list[Block]:
    """`t` as `tp` ranks hold it, each part contiguous as in vLLM: runs of rows (`by_rows`, column-parallel)
    or slices of every row."""
    rows, cols = t.shape
    if by_rows:
        step = rows // tp
        parts = [(t[r * step : (r + 1) * step], (step, cols), r * step * cols) for r in range(tp)]
    else:
        step = cols // tp
        parts = [(t[:, r * step : (r + 1) * step].contiguous(), (rows, step), r * step) for r in range(tp)]
    return [Block(part, size, (cols, 1), offset) for part, size, offset in parts]


def transient_bytes(fn) -> int:
    """Peak memory `fn()` took beyond what was held before it: allocated on the GPU, resident on a host."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    Path("/proc/self/clear_refs").write_text("5")  # the kernel's peak-RSS reset: the peak is now
    before = peak_rss()
    fn()
    return peak_rss() - before


def tensor_row(
    name: str, by_rows: bool, a: argparse.Namespace, device: str, model: str | None = None
) -> list:
    """One split tensor's row: a step of it decoded against `a.tp` blocks, checked, timed, measured."""
    old, new = make_states(model or f"qwen3-{a.model}", 1, a.density, device, names=(name,))
    data = patches.encode(patches.make_patch(old, new, 1, 0), old, "compact")
    info, entries = patches.read_info(data), patches.read_entries(data)
    tables = patches.read_tables(info)
    held, n = old[name], old[name].numel()
    blocks = tp_blocks(held, a.tp, by_rows)
    moved = torch.nonzero(bits(held) != bits(new[name]))[:, 0]

    def decode():
        return decode_held(info, entries, name, n, tables, blocks, dist.group.WORLD)

    first: dict = {}
    transient = transient_bytes(lambda: first.update(out=decode()))  # the first run: nothing cached yet
    changes, problem, gathered = first.pop("out")
    assert problem is None and torch.equal(changes.indices, moved), f"{name}: decoded wrongly"
    assert torch.equal(bits(changes.values), bits(new[name])[moved]), f"{name}: wrong values"
    decode_s = median_s(decode, a.repeat)
    ne_s = median_s(lambda: bits(held) != bits(new[name]), a.repeat)
    return [f"`{name}` {tuple(held.shape)}", f"{n / a.tp / 1e6:.0f}M", f"{len(moved):,}", ms(decode_s),
            f"{decode_s / ne_s:.1f}x", f"{transient / 1e6:,.0f} MB", f"{transient / n:.2f} B",
            f"{transient / (2 * n):.2f}x", f"{gathered / 1e3:,.0f} kB"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("0.6b", "8b"), default="0.6b", help="Qwen3-0.6B or Qwen3-8B shapes")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (default 2)")
    ap.add_argument("--density", type=float, default=0.01, help="share of elements one step changes")
    ap.add_argument("--repeat", type=int, default=3, help="runs per time (median)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    print(
        f"bench.split, {datetime.date.today()}: {torch.cuda.get_device_name() if cuda else 'no GPU'}, "
        f"{default_threads()} CPU cores, torch {torch.__version__}; Qwen3-{a.model.upper()} shapes, "
        f"TP={a.tp}, density {a.density:g}\n"
    )
    # the small one first: memory freed after a row stays resident and would hide the next row's peak
    tensors = {"model.layers.0.mlp.down_proj.weight": False, "model.embed_tokens.weight": True}
    with tempfile.TemporaryDirectory() as store:
        url = f"file://{os.path.join(store, 'group')}"
        dist.init_process_group("gloo", init_method=url, rank=0, world_size=1)
        # a small tensor first compiles the kernels, so that no row counts the JIT's memory
        tensor_row("model.layers.0.self_attn.k_proj.weight", False, a, device, "qwen3-0.6b")
        rows = [tensor_row(name, by_rows, a, device) for name, by_rows in tensors.items()]
        dist.destroy_process_group()
    print(
        f"Floor: one `ne` pass over the tensor ({device}). Time: median of {a.repeat}; one call decodes all "
        f"{a.tp} ranks' parts (this process holds them all).\n"
    )
    table(
        ["tensor", "held per rank", "changes", "decode, all ranks", "vs `ne` pass", "transient memory",
         "per element", "vs bf16 held", "class counts gathered"],
        rows,
    )  # fmt: skip


if __name__ == "__main__":
    main()
