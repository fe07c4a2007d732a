"""Quantized deltas against bf16 patches, on the same training steps.

    python -m bench.quant [--layers 28] [--steps 3] [--lrs 1e-6,3e-6]

Qwen3-0.6B shapes (all 28 layers and the tied embedding by default, N(0, 0.02) weights) moved by bench.codec's
Adam-like fp32 master steps. Per step, side by side in one run:

- bf16: the codec's compact patch of the whole model (what a bf16 root publishes) and its trainer time
  (change detection + fingerprint + encode, `make_patch` + `encode`);
- quantized: what a quantized root would publish, the bf16 patch of the tensors the recipe leaves alone
  (embedding, norms) plus the quantized delta of the rest (deltasync.quant.delta); for the quantized (linear)
  tensors alone, their bf16 density and patch, and the share of their rows a bf16 change touches (what a
  replica re-quantizing touched rows would need in bf16), beside their quantized delta; and the trainer's
  extra work (`Quantizer.step`: from the bf16 patch's changed positions, the codes of changed elements and
  of rows whose scale moved, against the quantized state it keeps; the fingerprint; the encode);
- the replica's side of the quantized delta: decode + verify (before the pause) and the write (the pause).

Recipes: `fp8_per_channel` as vLLM applies it to a dense Qwen3 (every linear layer);
`int8_per_channel_weight_only` quantizes experts only, so Qwen3-0.6B has none: its rows apply int8's numerics
to the same linear layers, to show what an expert's share of a MoE would cost.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from bench.codec import qwen3_shapes, qwen3_trajectory, timed
from deltasync.codec import patch as patches
from deltasync.codec.fingerprint import state_fingerprint
from deltasync.quant import delta as deltas
from deltasync.quant.recipe import RECIPES, Recipe
from deltasync.quant.state import Quantized, apply, fingerprint

HEAD = (
    "| recipe | lr | step | bf16 density | bf16 patch | **quantized step** | linears: bf16 density "
    "| bf16 patch | rows touched | **quantized delta** | changed codes | B / changed code | scales changed "
    "| trainer: bf16 diff + encode | quantized changes + fp + encode | **trainer extra / bf16** "
    "| replica decode + verify | replica write (pause) |"
)


def bf16_patch(old: dict, new: dict) -> tuple[bytes, dict[str, torch.Tensor], float]:
    """The codec's compact patch from `old` to `new`, its changed positions and the trainer's time for it (its
    base fingerprint is tracked step to step, so not timed)."""
    base = state_fingerprint(old)
    (data, patch), seconds = timed(
        lambda: (patches.encode(p := patches.make_patch(old, new, 1, 0, base), old), p)
    )
    return data, {n: c.indices for n, c in patch.changes.items()}, seconds


def run(recipe: Recipe, layers: int, lr: float, steps: int) -> None:
    """One trajectory: the trainer's Quantizer follows the bf16 patches, the replica applies its files; the
    last step checks both against quantizing the bf16 state afresh."""
    names = RECIPES["fp8_per_channel"].quantized_names(qwen3_shapes(layers))
    trainer: deltas.Quantizer | None = None
    for step, (old, new) in enumerate(qwen3_trajectory(layers, lr, steps), 1):
        if trainer is None:
            # every linear layer, whatever the recipe's own rule (int8's selects experts: Qwen3-0.6B has none)
            trainer = deltas.Quantizer({n: old[n] for n in names}, dataclasses.replace(recipe, selects=bool))
            replica = {n: Quantized(q.codes.clone(), q.scales.clone()) for n, q in trainer.state.items()}
        base = trainer.fingerprint
        whole, changed, bf16_s = bf16_patch(old, new)
        rest, _, _ = bf16_patch(*({n: s[n] for n in s if n not in names} for s in (old, new)))
        linears, _, _ = bf16_patch(*({n: s[n] for n in names} for s in (old, new)))
        (data, changes), publish_s = timed(trainer.step, old, new, changed)
        (delta, _), decode_s = timed(deltas.decode, data, replica, recipe.name, base)
        _, write_s = timed(apply, replica, delta)
        if step == steps:
            fresh = {n: Quantized(*recipe.quantize(new[n])) for n in names}
            for state in (trainer.state, replica):
                assert all(
                    torch.equal(state[n].codes.view(torch.uint8), fresh[n].codes.view(torch.uint8))
                    for n in names
                )
            assert trainer.fingerprint == fingerprint(fresh) == fingerprint(replica), "not the new state's"
        numel = sum(t.numel() for t in old.values())
        codes = sum(q.codes.numel() for q in replica.values())
        rows = sum(q.scales.numel() for q in replica.values())
        n_changed = sum(c.positions.size for c in changes.values())
        scales = sum(c.rows.size for c in changes.values())
        touched = sum(int((old[n] != new[n]).any(1).sum()) for n in names)  # rows a bf16 change reaches
        cells = [
            recipe.name,
            f"{lr:g}",
            step,
            f"{patches.read_info(whole).changed / numel:.2%}",
            f"{len(whole) / 1e6:.2f} MB",
            f"**{(len(rest) + len(data)) / 1e6:.2f} MB**",
            f"{patches.read_info(linears).changed / codes:.2%}",
            f"{len(linears) / 1e6:.2f} MB",
            f"{touched / rows:.1%}",
            f"**{len(data) / 1e6:.2f} MB**",
            f"{n_changed / codes:.3%}",
            f"{len(data) / max(n_changed, 1):.2f} B",
            f"{scales / rows:.2%}",
            f"{bf16_s:.2f} s",
            f"{publish_s:.2f} s",
            f"**{publish_s / bf16_s:.2f}x**",
            f"{decode_s:.2f} s",
            f"{write_s * 1e3:.0f} ms",
        ]
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lrs", default="1e-6,3e-6")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    args = parser.parse_args()
    shapes = qwen3_shapes(args.layers)
    names = RECIPES["fp8_per_channel"].quantized_names(shapes)
    linear = sum(shapes[n][0] * shapes[n][1] for n in names)
    rows = sum(shapes[n][0] for n in names)
    print(
        f"Qwen3-0.6B shapes, {args.layers} layers: {linear / 1e6:.0f}M of "
        f"{sum(torch.Size(s).numel() for s in shapes.values()) / 1e6:.0f}M elements in {len(names)} linear "
        f"layers ({rows} rows): bf16 {2 * linear / 1e6:.0f} MB, "
        f"codes + fp32 scales {(linear + 4 * rows) / 1e6:.0f} MB\n"
    )
    print(HEAD)
    print("|---" * (HEAD.count("|") - 1) + "|")
    for name in args.recipes.split(","):
        for lr in map(float, args.lrs.split(",")):
            run(RECIPES[name], args.layers, lr, args.steps)


if __name__ == "__main__":
    main()
