"""deltasync: exact bf16 weight patches and sync roots from the command line.

Patches: `diff` writes the changes from one checkpoint to the next, `apply` replays them (verified bit for
bit), `inspect` describes a patch. Sync roots: `push` publishes a checkpoint as the next step, `pull` writes
a retained step to a folder, `ls` lists the steps, `gc` deletes what the head no longer needs, `follow`
keeps a running vLLM server on the newest step. Signed roots: `keygen` writes a key pair; push signs with
--signing-key, and pull and follow given --trusted-key refuse whatever that key did not sign.

Checkpoints are safetensors files or HF model folders (every *.safetensors shard), any float dtype, compared
as bf16 (integer tensors are refused: bf16 would round them). push and gc write to ROOT as its only writer
(refused while a publisher holds it). Results are JSON on stdout; errors are one line on stderr (credentials
in URLs redacted) and exit status 1. Unreachable storage fails at once, without retries.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from deltasync import __version__
from deltasync.codec.header import ENCODINGS
from deltasync.errors import EXPECTED, PatchError
from deltasync.sync.config import ANCHOR_ENCODINGS, PublisherConfig

if TYPE_CHECKING:
    import torch

    from deltasync.storage import Storage
    from deltasync.sync.protocol import Head

# The commands import what they use when they run: `--version` and `--help` import no torch.


def load_bf16(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file, or every `*.safetensors` shard of an HF model folder, as bf16 tensors."""
    from safetensors.torch import load_file

    from deltasync.codec.bf16 import as_bf16
    from deltasync.sync.publisher import require_floats

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    found_in: dict[str, Path] = {}
    for f in files:
        if not f.is_file():  # absent, or a FIFO or device that load_file would wait on or read without end
            if f.exists():
                raise ValueError(f"{f} is not a regular file")
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(f))
        try:
            tensors = load_file(f)
        except Exception as e:  # safetensors' own error types name neither the file nor what it expected
            raise ValueError(f"{f}: not a readable safetensors file ({e})") from None
        require_floats(tensors, str(f))
        twice = next((name for name in tensors if name in found_in), None)
        if twice is not None:  # e.g. a stale model.safetensors beside the shards: neither may silently win
            raise ValueError(f"tensor {twice!r} is in both {found_in[twice]} and {f}")
        found_in |= dict.fromkeys(tensors, f)
        state |= {name: as_bf16(t).view(t.shape) for name, t in tensors.items()}
    return state


def read_patch(path: Path) -> bytes:
    """A patch file's bytes; a FIFO or a device is refused rather than waited on or read without end."""
    from deltasync.storage import open_regular

    with open_regular(path) as f:
        return f.read()


@contextmanager
def naming(path: Path) -> Iterator[None]:
    """A patch refused inside this block is refused naming its file."""
    try:
        yield
    except PatchError as e:
        raise PatchError(f"{path}: {e}") from None


@contextmanager
def compile_notice() -> Iterator[None]:
    """Inside this block, say so on stderr, once, when numba starts compiling: its cache lacks the kernels
    this command runs (each command's first run after an install), and it would otherwise sit silent for
    seconds. A cached kernel compiles nothing, so says nothing."""
    from numba.core import event  # numba only for the commands that run the codec

    class Notice(event.Listener):
        said = False

        def on_start(self, ev: event.Event) -> None:
            if not self.said:  # one line, however many kernels follow
                self.said = True
                print(
                    "deltasync: compiling the codec's kernels for this command (then cached, ~10 s)...",
                    file=sys.stderr,
                )

        def on_end(self, ev: event.Event) -> None:
            pass

    with event.install_listener("numba:compile", Notice()):
        yield


def cmd_diff(args: argparse.Namespace) -> dict:
    from deltasync.codec import patch as patches
    from deltasync.codec.changes import SchemaError

    old, new = load_bf16(args.old), load_bf16(args.new)
    try:
        patch = patches.make_patch(old, new, step=args.step, base_step=args.base_step)
    except SchemaError as e:
        raise SchemaError(f"{args.new} against {args.old}: {e}") from None
    data = patches.encode(patch, old, args.encoding)
    args.output.write_bytes(data)
    return {"changed": patch.changed, "numel": patch.numel, "payload_bytes": len(data)}


def cmd_apply(args: argparse.Namespace) -> dict:
    from safetensors.torch import save_file

    from deltasync.codec import patch as patches
    from deltasync.codec.changes import apply_changes

    base = load_bf16(args.base)
    data = read_patch(args.patch)
    with naming(args.patch):
        patch = patches.decode(data, base)
    apply_changes(base, patch.changes)
    save_file(base, args.output, metadata={"format": "pt"})
    return {"step": patch.step, "changed": patch.changed}


def cmd_inspect(args: argparse.Namespace) -> dict:
    from deltasync.codec.header import read_info

    data = read_patch(args.patch)
    with naming(args.patch):
        info = read_info(data)
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
    from deltasync.sync import protocol
    from deltasync.sync.publisher import Publisher

    config = PublisherConfig(
        anchor_every=args.anchor_every,
        encoding=args.encoding,
        anchor_encoding=args.anchor_encoding,
        signing_key=args.signing_key,
        previous_signing_key=args.previous_signing_key,
    )
    state = load_bf16(args.checkpoint)  # a bad checkpoint is refused before the root is touched
    protocol.RunInfo.of(str(args.checkpoint), state)  # as are names and steps a reader would refuse
    if args.step is not None:
        protocol.check_step(args.step, "--step")
    with Publisher(args.root, model=str(args.checkpoint), config=config) as publisher:
        step = publisher.publish(state, step=args.step)
    assert publisher.head is not None  # closed without an error: the head names the step
    entries = [e for e in publisher.head.entries if e.step == step]
    return {"step": step, "kinds": [e.kind for e in entries], "payload_bytes": sum(e.bytes for e in entries)}


def cmd_pull(args: argparse.Namespace) -> dict:
    from safetensors.torch import save_file

    from deltasync.sync.signing import Trust
    from deltasync.sync.subscriber import Subscriber

    out = args.output
    if out.suffix != ".safetensors" or out.is_dir():
        if out.exists() and not out.is_dir():
            raise ValueError(f"{out} is a file: -o takes a folder or a .safetensors file to write")
        out = out / "model.safetensors"
    subscriber = Subscriber(args.root, retries=0, trust=Trust(args.trusted_key))
    applied = subscriber.sync(args.step)
    assert subscriber.state is not None  # synced without an error: it holds the step
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "step": str(subscriber.step), "fingerprint": f"{subscriber.fingerprint:016x}"}
    save_file(subscriber.state, out, metadata=meta)
    path = [f"{a.kind}:{a.step}" for a in applied]
    return {"step": subscriber.step, "path": path, "output": str(out), "trust": str(subscriber.trust)}


def cmd_keygen(args: argparse.Namespace) -> dict:
    """A new key pair: the private key (owner read/write only) at --out, its public line at --out.pub; never
    over an existing file. The private key is never printed."""
    from deltasync.sync.signing import SigningKey

    key = SigningKey.generate()
    public = key.save(args.out)  # refused, before a byte is written, where either file exists
    return {"public_key": key.public, "private_key_file": str(args.out), "public_key_file": str(public)}


def published_head(storage: Storage, root: str) -> Head:
    """ROOT's head; one line saying so where nothing was published there yet."""
    from deltasync.sync import protocol

    try:
        return protocol.read_head(storage)
    except FileNotFoundError:
        raise FileNotFoundError(f"no run published at {root} yet") from None


def cmd_ls(args: argparse.Namespace) -> None:
    from deltasync.storage import open_storage

    head = published_head(open_storage(args.root), args.root)
    for e in head.entries:
        row = {"step": e.step, "kind": e.kind, "bytes": e.bytes, "changed": e.changed}
        print(json.dumps(row | {"published_at": e.published_at}))


def cmd_gc(args: argparse.Namespace) -> dict:
    from deltasync.storage import open_storage
    from deltasync.sync import protocol
    from deltasync.sync.claim import WriterClaim
    from deltasync.sync.gc import collect_garbage

    storage = open_storage(args.root)
    published_head(storage, args.root)  # no run: nothing to claim
    claim = WriterClaim(storage)  # GC deletes: only as the root's one writer
    try:
        return {"head": protocol.read_head(storage).step, "deleted": collect_garbage(storage)}
    finally:
        claim.release()


ROOT_HELP = "the sync root: a folder, hf://buckets/NS/NAME[/prefix] (a Hub bucket) or an fsspec URL"
ROOTS = """ROOT, the sync root, is one of:
  a folder                         ./sync-root
  a Hugging Face Hub bucket        hf://buckets/NS/NAME[/prefix]   (HF_TOKEN or `hf auth login` for access)
  any other fsspec URL             s3://bucket/run-1 (with the filesystem's package installed)"""
EXAMPLES = {
    "diff": "deltasync diff step-0/model.safetensors step-1/model.safetensors -o step-1.patch",
    "apply": "deltasync apply step-0/model.safetensors step-1.patch -o step-1.safetensors",
    "inspect": "deltasync inspect step-1.patch",
    "push": "deltasync push hf://buckets/alice/run-1 ./checkpoint-100 --step 100",
    "pull": "deltasync pull hf://buckets/alice/run-1 -o ./latest",
    "ls": "deltasync ls ./sync-root",
    "gc": "deltasync gc hf://buckets/alice/run-1",
    "follow": "deltasync follow hf://buckets/alice/run-1 --vllm-url http://127.0.0.1:8000",
    "keygen": "deltasync keygen --out trainer.key",
}
COMPILES = ("diff", "apply", "push", "pull")  # the commands that run the codec's kernels (follow: vLLM does)


STOP_GRACE_S = 2.0  # after SIGINT or SIGTERM, a call to the server still in flight is abandoned after this


def cmd_follow(args: argparse.Namespace) -> None:
    """Follow ROOT into the vLLM server at --vllm-url until SIGINT or SIGTERM (deltasync.vllm.follower).
    The follower runs on a thread of its own, so that a stop is obeyed at once even while a call to a server
    that is starting or stalled waits for its answer."""
    import logging
    import os
    import signal
    import threading

    from deltasync.storage import POLL_BUDGET
    from deltasync.sync.signing import Trust
    from deltasync.vllm.follower import HttpEngine, follow

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    engine = HttpEngine(args.vllm_url, os.environ.get("VLLM_API_KEY"), stop=stop)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            follow(
                args.root,
                engine,
                stop,
                replica=args.replica,
                poll_s=args.poll_s,
                poll_budget=POLL_BUDGET if args.poll_budget is None else args.poll_budget,
                verify_every=args.verify_every,
                quantization=args.quantization,
                trust=Trust(args.trusted_key),
            )
        except BaseException as e:  # told by the main thread, unless it was stopped
            failure.append(e)

    thread = threading.Thread(target=run, name="deltasync-follow", daemon=True)
    thread.start()
    while thread.is_alive() and not stop.wait(0.2):
        pass
    thread.join(STOP_GRACE_S)
    if failure and not stop.is_set():
        raise failure[0]


def replica_id(text: str) -> str:
    """--replica, checked before anything starts."""
    from deltasync.telemetry import REPLICA_ID

    if not REPLICA_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} must match {REPLICA_ID.pattern}")
    return text


def seconds(text: str) -> float:
    """--poll-s: a finite number of seconds above 0 (0, a negative number or nan would poll without pause)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds above 0")
    return value


def public_keys(text: str) -> list[str]:
    """--trusted-key: public key lines (`ed25519:...`, comma-separated) or .pub files, checked at once."""
    from deltasync.sync.signing import parse_keys

    try:
        return parse_keys(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def trusted_keys(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trusted-key",
        type=public_keys,
        action="extend",
        default=[],
        metavar="KEY",
        help="apply only steps signed by this public key (`ed25519:...`, or a .pub file from `deltasync "
        "keygen`); repeat for several. Default: none, whoever can write ROOT is trusted",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deltasync",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=ROOTS + "\n\nexamples:\n" + "\n".join(f"  {e}" for e in EXAMPLES.values()),
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str, help: str, run: Callable[[argparse.Namespace], dict | None]
    ) -> argparse.ArgumentParser:
        takes_root = name in ("push", "pull", "ls", "gc", "follow")
        epilog = (ROOTS + "\n\n" if takes_root else "") + f"example:\n  {EXAMPLES[name]}"
        p = sub.add_parser(
            name,
            help=help,
            description=help[0].upper() + help[1:] + ".",
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if takes_root:
            p.add_argument("root", metavar="ROOT", help=ROOT_HELP)
        p.set_defaults(run=run)
        return p

    encoding_help = (
        "compact (smallest; decoding needs the old weights) or raw (int32 positions + bf16 values)"
    )

    p = command("diff", "write the patch that turns OLD into NEW", cmd_diff)
    p.add_argument(
        "old", metavar="OLD", type=Path, help="safetensors file or HF model folder: the base state"
    )
    p.add_argument(
        "new", metavar="NEW", type=Path, help="safetensors file or HF model folder: the next state"
    )
    p.add_argument("-o", "--output", metavar="PATCH", type=Path, required=True, help="patch file to write")
    p.add_argument(
        "--encoding", choices=ENCODINGS, default="compact", help=f"{encoding_help} (default compact)"
    )
    p.add_argument("--step", type=int, default=1, help="step number NEW gets (default 1)")
    p.add_argument("--base-step", type=int, default=0, help="step number of OLD (default 0)")

    p = command("apply", "apply PATCH to BASE, verified, and write the result as bf16", cmd_apply)
    p.add_argument(
        "base", metavar="BASE", type=Path, help="safetensors file or HF model folder the patch was made from"
    )
    p.add_argument("patch", metavar="PATCH", type=Path, help="patch file (from `deltasync diff`)")
    p.add_argument(
        "-o", "--output", metavar="OUT", type=Path, required=True, help="safetensors file to write"
    )

    p = command("inspect", "describe PATCH as JSON (no base needed)", cmd_inspect)
    p.add_argument("patch", metavar="PATCH", type=Path, help="patch file (from `deltasync diff`)")

    p = command("push", "publish CHECKPOINT as the next step of ROOT (an anchor, a delta or both)", cmd_push)
    p.add_argument("checkpoint", metavar="CHECKPOINT", type=Path, help="safetensors file or HF model folder")
    p.add_argument("--step", type=int, help="step number (default: the head step + 1)")
    p.add_argument(
        "--anchor-every",
        type=int,
        default=PublisherConfig.anchor_every,
        help=f"steps between complete anchors (default {PublisherConfig.anchor_every})",
    )
    p.add_argument(
        "--encoding",
        choices=ENCODINGS,
        default=PublisherConfig.encoding,
        help=f"delta encoding: {encoding_help} (default {PublisherConfig.encoding})",
    )
    p.add_argument(
        "--anchor-encoding",
        choices=("auto", *ANCHOR_ENCODINGS),
        default=PublisherConfig.anchor_encoding,
        help="anchor encoding: plain (bf16 safetensors any reader opens), packed (lossless, ~2/3 of the "
        f"bytes) or auto (packed unless ROOT is a folder; default {PublisherConfig.anchor_encoding})",
    )
    p.add_argument(
        "--signing-key",
        metavar="FILE",
        help="sign run.json and the head with this private key (`deltasync keygen`); a signed root needs it",
    )
    p.add_argument(
        "--previous-signing-key",
        metavar="FILE",
        help="the key that signed ROOT so far: it endorses --signing-key, which signs from now on (rotation)",
    )

    p = command("pull", "write the verified state of a step to a safetensors file", cmd_pull)
    p.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        type=Path,
        required=True,
        help="the .safetensors file to write, or a folder to write model.safetensors into",
    )
    p.add_argument("--step", type=int, help="a retained step (default: the newest)")
    trusted_keys(p)

    command("ls", "list the retained steps of ROOT, one JSON line each", cmd_ls)
    command("gc", "delete the files of ROOT its head no longer needs (as its only writer)", cmd_gc)

    p = command(
        "follow", "keep a running vLLM server on the newest step of ROOT, until interrupted", cmd_follow
    )
    p.add_argument(
        "--vllm-url",
        required=True,
        help="the server (started with VLLM_SERVER_DEV_MODE=1, on a private address; "
        "VLLM_API_KEY is sent if set)",
    )
    p.add_argument(
        "--replica",
        type=replica_id,
        help="replica id for the telemetry it writes to ROOT (default: none written)",
    )
    p.add_argument(
        "--poll-s", type=seconds, default=1.0, help="seconds between polls of the head (default 1)"
    )
    p.add_argument(
        "--poll-budget",
        type=int,
        help="Hub requests per 5-minute window that polling may spend when the bucket's change feed is not "
        "followed; polls are spaced to fit (default 1000)",
    )
    p.add_argument(
        "--verify-every",
        type=int,
        default=10,
        help="read the weights back from the server at anchors and every N deltas (default 10)",
    )
    p.add_argument(
        "--quantization",
        help="the server's --quantization (fp8_per_channel), to follow a root quantized so (default: bf16)",
    )
    trusted_keys(p)

    p = command("keygen", "write a key pair that signs a root: the private key and its .pub line", cmd_keygen)
    p.add_argument(
        "--out",
        type=Path,
        default=Path("deltasync.key"),
        metavar="FILE",
        help="the private key file to write (readable by its owner only), its public key beside it in "
        "FILE.pub (default deltasync.key); never replaces a file",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from huggingface_hub.utils import logging as hf_logging

    from deltasync.storage import open_storage, redact

    hf_logging.set_verbosity_error()  # the Hub client's retry warnings would bury our one line
    try:
        if getattr(args, "root", None) is not None:
            open_storage(args.root).probe()  # unreachable: one line now, not after minutes of retries
        with compile_notice() if args.command in COMPILES else nullcontext():
            result = args.run(args)
    except Exception as e:  # every failure is one line; a bug also shows its traceback, above that line
        if not isinstance(e, EXPECTED):
            traceback.print_exc()
            e = RuntimeError(f"bug: {type(e).__name__}: {e}")
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
