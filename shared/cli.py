"""`deltasync`: make, apply and inspect bf16 weight patches from the command line.

    deltasync diff OLD NEW -o PATCH [--encoding compact|raw] [--step N] [--base-step M]
    deltasync apply BASE PATCH -o OUT
    deltasync inspect PATCH

OLD, NEW and BASE are safetensors files with HF checkpoint names (any float dtype; compared as bf16).
Errors are one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from shared import patch as patches
from shared.bf16 import as_bf16
from shared.changes import SchemaError, apply_changes


def load_bf16(path: Path) -> dict[str, torch.Tensor]:
    return {name: as_bf16(t).view(t.shape) for name, t in load_file(path).items()}


def cmd_diff(args: argparse.Namespace) -> dict:
    old, new = load_bf16(args.old), load_bf16(args.new)
    patch = patches.make_patch(old, new, step=args.step, base_step=args.base_step)
    data = patches.encode(patch, old, args.encoding)
    args.output.write_bytes(data)
    return {"changed": patch.changed, "numel": patch.numel, "payload_bytes": len(data)}


def cmd_apply(args: argparse.Namespace) -> dict:
    base = load_bf16(args.base)
    patch = patches.decode(args.patch.read_bytes(), base)
    apply_changes(base, patch.changes)
    save_file(base, args.output, metadata={"format": "pt"})
    return {"step": patch.step, "changed": patch.changed}


def cmd_inspect(args: argparse.Namespace) -> dict:
    info = patches.read_info(args.patch.read_bytes())
    return {
        "step": info.step,
        "base_step": info.base_step,
        "encoding": info.encoding,
        "numel": info.numel,
        "changed": info.changed,
        "density": info.changed / info.numel if info.numel else 0.0,
        "payload_bytes": info.payload_bytes,
        "bytes_per_changed": info.payload_bytes / info.changed if info.changed else None,
        "fingerprint": f"{info.fingerprint:016x}",
        "base_fingerprint": f"{info.base_fingerprint:016x}",
        "tensors": {
            name: {"mode": t["mode"], "changed": t["changed"]} for name, t in sorted(info.tensors.items())
        },
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltasync", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("diff", help="write the patch that turns OLD into NEW")
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--encoding", choices=patches.ENCODINGS, default="compact")
    p.add_argument("--step", type=int, default=1, help="step number NEW gets (default 1)")
    p.add_argument("--base-step", type=int, default=0, help="step number of OLD (default 0)")
    p.set_defaults(run=cmd_diff)

    p = sub.add_parser("apply", help="apply PATCH to BASE, verified, and write the result as bf16")
    p.add_argument("base", type=Path)
    p.add_argument("patch", type=Path)
    p.add_argument("-o", "--output", type=Path, required=True)
    p.set_defaults(run=cmd_apply)

    p = sub.add_parser("inspect", help="describe PATCH as JSON")
    p.add_argument("patch", type=Path)
    p.set_defaults(run=cmd_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.run(args)
    except (patches.PatchError, SchemaError, SafetensorError, OSError, ValueError) as e:
        print(f"deltasync {args.command}: error: {str(e).replace(chr(10), ' ')}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=None if args.command != "inspect" else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
