"""`deltasync`: bf16 weight patches and sync roots from the command line.

    deltasync diff OLD NEW -o PATCH [--encoding compact|raw] [--step N] [--base-step M]
    deltasync apply BASE PATCH -o OUT
    deltasync inspect PATCH
    deltasync push ROOT CHECKPOINT [--step N] [--anchor-every K]
    deltasync pull ROOT -o OUTDIR [--step N]
    deltasync ls ROOT
    deltasync gc ROOT

OLD, NEW, BASE and CHECKPOINT are safetensors files (CHECKPOINT may be an HF model folder) with HF checkpoint
names, any float dtype, compared as bf16 (integer tensors are refused: bf16 would round them). ROOT is a
sync root: a folder, hf://buckets/<ns>/<name>[/prefix], or an fsspec URL. push and gc write to ROOT as its
only writer (refused while a publisher holds it). Results are JSON on stdout; errors are one line on stderr
(credentials in URLs redacted) and exit status 1. The CLI fails fast: no retries of unreachable storage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from huggingface_hub.utils import logging as hf_logging
from safetensors.torch import load_file, save_file

from deltasync.codec import patch as patches
from deltasync.codec.bf16 import as_bf16
from deltasync.codec.changes import apply_changes
from deltasync.storage import open_regular, open_storage, redact
from deltasync.sync import protocol
from deltasync.sync.claim import WriterClaim
from deltasync.sync.gc import collect_garbage
from deltasync.sync.publisher import Publisher, PublisherConfig, require_floats
from deltasync.sync.subscriber import Subscriber


def load_bf16(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file, or every `*.safetensors` shard of an HF model folder, as bf16 tensors."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    state = {}
    for f in files:
        tensors = load_file(f)
        require_floats(tensors, str(f))
        state |= {name: as_bf16(t).view(t.shape) for name, t in tensors.items()}
    return state


def read_patch(path: Path) -> bytes:
    """A patch file's bytes; a FIFO or a device is refused rather than waited on or read without end."""
    with open_regular(path) as f:
        return f.read()


def cmd_diff(args: argparse.Namespace) -> dict:
    old, new = load_bf16(args.old), load_bf16(args.new)
    patch = patches.make_patch(old, new, step=args.step, base_step=args.base_step)
    data = patches.encode(patch, old, args.encoding)
    args.output.write_bytes(data)
    return {"changed": patch.changed, "numel": patch.numel, "payload_bytes": len(data)}


def cmd_apply(args: argparse.Namespace) -> dict:
    base = load_bf16(args.base)
    patch = patches.decode(read_patch(args.patch), base)
    apply_changes(base, patch.changes)
    save_file(base, args.output, metadata={"format": "pt"})
    return {"step": patch.step, "changed": patch.changed}


def cmd_inspect(args: argparse.Namespace) -> dict:
    info = patches.read_info(read_patch(args.patch))
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


def cmd_push(args: argparse.Namespace) -> dict:
    config = PublisherConfig(anchor_every=args.anchor_every, encoding=args.encoding)
    state = load_bf16(args.checkpoint)  # a bad checkpoint is refused before the root is touched
    with Publisher(args.root, model=str(args.checkpoint), config=config) as publisher:
        step = publisher.publish(state, step=args.step)
    entries = [e for e in publisher.head.entries if e.step == step]
    return {"step": step, "kinds": [e.kind for e in entries], "payload_bytes": entries[0].bytes}


def cmd_pull(args: argparse.Namespace) -> dict:
    subscriber = Subscriber(args.root, retries=0)
    applied = subscriber.sync(args.step)
    args.output.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "step": str(subscriber.step), "fingerprint": f"{subscriber.fingerprint:016x}"}
    save_file(subscriber.state, args.output / "model.safetensors", metadata=meta)
    return {"step": subscriber.step, "path": [f"{a.kind}:{a.step}" for a in applied]}


def cmd_ls(args: argparse.Namespace) -> None:
    head = protocol.read_head(open_storage(args.root))
    for e in head.entries:
        row = {"step": e.step, "kind": e.kind, "bytes": e.bytes, "changed": e.changed}
        print(json.dumps(row | {"published_at": e.published_at}))


def cmd_gc(args: argparse.Namespace) -> dict:
    storage = open_storage(args.root)
    protocol.read_head(storage)  # no run: nothing to claim
    claim = WriterClaim(storage)  # GC deletes: only as the root's one writer
    try:
        return {"head": protocol.read_head(storage).step, "deleted": collect_garbage(storage)}
    finally:
        claim.release()


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

    p = sub.add_parser("push", help="publish CHECKPOINT as the next step of ROOT (anchor or delta)")
    p.add_argument("root")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--step", type=int, help="step number (default: the head step + 1)")
    p.add_argument("--anchor-every", type=int, default=PublisherConfig.anchor_every)
    p.add_argument("--encoding", choices=patches.ENCODINGS, default="compact")
    p.set_defaults(run=cmd_push)

    p = sub.add_parser("pull", help="write the verified state of a step to OUTDIR/model.safetensors")
    p.add_argument("root")
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--step", type=int, help="a retained step (default: the newest)")
    p.set_defaults(run=cmd_pull)

    p = sub.add_parser("ls", help="one JSON line per retained step")
    p.add_argument("root")
    p.set_defaults(run=cmd_ls)

    p = sub.add_parser("gc", help="delete files the head no longer needs")
    p.add_argument("root")
    p.set_defaults(run=cmd_gc)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    hf_logging.set_verbosity_error()  # the Hub client's retry warnings would bury our one line
    try:
        if getattr(args, "root", None) is not None:
            open_storage(args.root).probe()  # unreachable: one line now, not after minutes of retries
        result = args.run(args)
    except Exception as e:  # every failure, bad input or unreachable storage, is one line: no traceback
        message = " ".join(str(e).split()) or type(e).__name__
        if isinstance(e, FileNotFoundError) and e.filename:
            message = f"{e.filename}: {e.strerror}"
        print(f"deltasync {args.command}: error: {redact(message)}", file=sys.stderr)
        return 1
    if result is not None:
        print(json.dumps(result, indent=None if args.command != "inspect" else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
