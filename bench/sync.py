"""Sync end to end: publisher -> storage -> subscribers, against a full bf16 checkpoint per step, in one run.

    python -m bench.sync [--layers 2] [--steps 8] [--bandwidth-mb 100] [--latency-ms 50]
    python -m bench.sync --model qwen3-1.7b [--layers 28] [--steps 3]
    python -m bench.sync --signed 3      # the link row unsigned vs signed (docs/protocol.md), taking turns

A Qwen3-0.6B-shaped model (real shapes, N(0, 0.02) weights, fp32 master weights) takes Adam-like steps that
change ~1% of its bf16 elements. Each step is published and waited for until every subscriber has applied it
(verified), through (a) a local folder and (b) a simulated link: every request costs the latency (half
before it lands, half after) and its bytes at the bandwidth, per client, like separate machines. The dense
alternative writes the whole bf16 state as one safetensors file and a pointer per step; its subscribers poll
the pointer, download and load.

Columns: caller's blocked time per publish, and one bf16 copy of the weights (the cast from fp32) measured in
the same run; end-to-end latency from the publish call to the last subscriber's verified apply; bytes moved
over the link per step (uploads and downloads, polls included); for ours, the protocol overhead: end to end
minus the caller's copy, encode (change detection included), decode+apply and bytes/bandwidth, in request
latencies (the fewest possible is about 2.5: the delta's upload 1, the head landing 0.5, a poll seeing it 1 on
average; a subscriber at the head reads and decodes the next delta ahead of its head, so decode+apply is what
is left once the head names it). Subscribers poll back to back over the link (each poll costs a latency)
and every 10 ms on the local folder, like the dense readers. A size-limited read (a poll, a delta) is one
request here, as it is for folders and fsspec URLs (one ranged read); the Hub's bucket API reads no ranges,
so there it costs a stat and a download.

`--model qwen3-1.7b`: a whole Qwen3 model's shapes (all layers unless told), fp32 master weights, over the
link only, with the subscriber in its own process: `--steps` deltas with 1 codec thread on both sides, then
as many with 2; then, per anchor encoding (packed, plain), a fresh replica joins when the head is at step 20
(anchors every 20 steps) and catches up from the step-20 anchor. Peak resident memory of each process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load, save

from bench.codec import QWEN3, qwen3_shapes
from deltasync.storage import LocalStorage, Storage
from deltasync.sync.publisher import Publisher, PublisherConfig
from deltasync.sync.signing import SigningKey, Trust
from deltasync.sync.subscriber import Subscriber, TensorsApplier


class Link(Storage):
    """One client's connection to `inner`: each request pays the latency and its bytes at the bandwidth."""

    def __init__(self, inner: Storage, bandwidth: float, latency: float):
        self.inner, self.url, self.bandwidth, self.latency = inner, inner.url, bandwidth, latency
        self.bytes = 0

    def _request(self, up: int, call, down=len):
        time.sleep(self.latency / 2 + up / self.bandwidth)  # the request travels, with its payload
        result = call()
        size = down(result) if result is not None else 0
        self.bytes += up + size
        time.sleep(self.latency / 2 + size / self.bandwidth)
        return result

    def _read_bytes(self, path, limit):
        return self._request(0, lambda: self.inner._read_bytes(path, limit))

    def _write_bytes(self, path, data):
        self._request(len(data), lambda: self.inner._write_bytes(path, data))

    def _upload_file(self, local, path):
        self._request(Path(local).stat().st_size, lambda: self.inner._upload_file(local, path))

    def _download_file(self, path, local):
        self._request(
            0, lambda: self.inner._download_file(path, local) or Path(local), lambda p: p.stat().st_size
        )

    def _sizes(self, paths):
        return self._request(0, lambda: self.inner._sizes(paths), lambda _: 0)

    def _list(self, prefix):
        return self._request(0, lambda: self.inner._list(prefix), lambda _: 0)

    def _delete(self, paths):
        self._request(0, lambda: self.inner._delete(paths))


def poll_s(links: bool) -> float:
    """Over a link each poll costs a latency, so readers poll back to back; on the local folder that would be
    a busy loop stealing the publisher's CPU."""
    return 0.0 if links else 0.01


def trajectory(layers: int, steps: int, lr: float, model: str = "qwen3-0.6b"):
    """fp32 master weights, N(0, 0.02) matrices and unit norms; each step moves every element by lr."""
    g = torch.Generator().manual_seed(0)
    master = {
        n: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02)
        for n, s in qwen3_shapes(layers, model).items()
    }
    for step in range(steps + 1):
        if step:
            for w in master.values():
                for rows in w.split(1 << 14):  # bounds the temporary to a slice
                    rows.add_(torch.randn(rows.shape, generator=g).sign_(), alpha=-lr)
        yield master


def run_ours(
    root: Path, links: bool, subscribers: int, encoding: str, args, key: Path | None = None
) -> list[dict]:
    """Publishes args.steps deltas after an anchor; one row per delta step. `key`: a signing key file (the
    subscribers trust its public key)."""
    storage = LocalStorage(root)
    client = (lambda: Link(storage, args.bandwidth, args.latency)) if links else (lambda: storage)
    config = PublisherConfig(encoding=encoding, signing_key=str(key) if key else None)
    trust = Trust([SigningKey.load(key).public] if key else [])
    publisher = Publisher(client(), model="qwen3-0.6b-shapes", config=config)
    followers, stop = [], threading.Event()
    rows = []
    for step, master in enumerate(trajectory(args.layers, args.steps, args.lr)):
        copy_start = time.perf_counter()
        {n: w.bfloat16() for n, w in master.items()}
        copy_s = time.perf_counter() - copy_start
        published_at = time.time()
        start = time.perf_counter()
        publisher.publish(master, step=step)
        blocked_s = time.perf_counter() - start
        if step == 0:  # the subscribers start on the anchor, then follow; bytes are counted from step 1
            publisher.flush()
            for i in range(subscribers):
                target = {n: torch.empty(w.shape, dtype=torch.bfloat16) for n, w in master.items()}
                sub = Subscriber(
                    client(), TensorsApplier(target), replica=f"bench-{i}", verify_every=1 << 30, trust=trust
                )
                sub.sync()
                followers.append(sub)
            for sub in followers:
                threading.Thread(target=sub.follow, args=(stop, poll_s(links)), daemon=True).start()
            reset_counters([publisher, *followers])
            continue
        while not all(s.step == step for s in followers):
            time.sleep(0.002)
        done = [next(a for a in s.history if a.step == step) for s in followers]
        publisher.flush()  # its head read back (subscribers may apply before), and the step's telemetry
        entry = publisher.head.entry(step, "delta")
        record = json.loads((root / f"telemetry/trainer/step-{step:08d}.json").read_text())
        rows.append(
            {
                "blocked_s": blocked_s,
                "copy_s": copy_s,
                "e2e_s": max(a.applied_at for a in done) - published_at,
                "encode_s": record["encode_s"],
                "apply_s": max(a.apply_s for a in done),
                "payload": entry.bytes,
                "changed": entry.changed,
                "moved": sum(getattr(c.storage, "bytes", 0) for c in [publisher, *followers]),
            }
        )
        reset_counters([publisher, *followers])
    stop.set()
    publisher.close()
    return rows


def reset_counters(clients) -> None:
    for c in clients:
        if isinstance(c.storage, Link):
            c.storage.bytes = 0


def run_dense(root: Path, links: bool, subscribers: int, args) -> list[dict]:
    """The dense alternative: the whole bf16 state and a pointer per step; readers poll, download, load."""
    storage = LocalStorage(root)
    client = (lambda: Link(storage, args.bandwidth, args.latency)) if links else (lambda: storage)
    writer, readers = client(), [client() for _ in range(subscribers)]
    rows = []
    for step, master in enumerate(trajectory(args.layers, args.steps, args.lr)):
        published_at = time.time()
        start = time.perf_counter()
        state = {n: w.bfloat16() for n, w in master.items()}
        blocked_s = time.perf_counter() - start
        done_at = []

        def publish(state=state, step=step):  # in the background, like ours
            writer.write_bytes(f"dense/step-{step}.safetensors", save(state))
            writer.write_bytes("dense/latest", str(step).encode())

        def follow(reader, step=step, done_at=done_at):
            while _pointer(reader) != step:
                time.sleep(poll_s(links))
            loaded = load(reader.read_bytes(f"dense/step-{step}.safetensors"))
            target = {n: torch.empty_like(t) for n, t in loaded.items()}
            for n, t in loaded.items():
                target[n].copy_(t)
            done_at.append(time.time())

        threads = [threading.Thread(target=publish)] + [
            threading.Thread(target=follow, args=(r,)) for r in readers
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if step:
            moved = sum(getattr(c, "bytes", 0) for c in [writer, *readers])
            rows.append({"blocked_s": blocked_s, "e2e_s": max(done_at) - published_at, "moved": moved})
        for c in [writer, *readers]:
            if isinstance(c, Link):
                c.bytes = 0
        storage.delete([f"dense/step-{step}.safetensors"])
    return rows


def _pointer(reader: Storage) -> int | None:
    try:
        return int(reader.read_bytes("dense/latest"))
    except FileNotFoundError:
        return None


def megabytes(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def peak_rss() -> int:
    """This process's peak resident memory, bytes."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) * 1024


def replica(root: str, args, commands, reports) -> None:
    """A subscriber process over its own link. Commands: (step, threads): reach `step`, decoding on
    `threads` threads, and report; None: report the peak memory and stop."""
    link = Link(LocalStorage(Path(root)), args.bandwidth, args.latency)
    sub = Subscriber(link, replica="bench", verify_every=1 << 30)
    while (command := commands.get()) is not None:
        step, sub.threads = command
        start, link.bytes = time.time(), 0
        while sub.step != step:
            sub.sync()
        done = next(a for a in sub.history if a.step == step)
        reports.put(
            {"start": start, "applied_at": done.applied_at, "apply_s": done.apply_s, "moved": link.bytes}
        )
    reports.put({"peak_rss": peak_rss()})


def run_model(args) -> None:
    """The whole-model benchmark (see the module's docstring)."""
    numel = sum(torch.Size(s).numel() for s in qwen3_shapes(args.layers, args.model).values())
    print(
        f"{args.model} shapes, {args.layers} layers: {numel / 1e9:.2f}B parameters, "
        f"{2 * numel / 1e9:.2f} GB bf16, fp32 master"
    )
    print(
        "| step | threads | density | payload | caller blocked | encode | decode + verify + apply "
        "| end to end |"
    )
    print("|---" * 8 + "|")
    spawn = multiprocessing.get_context("spawn")
    catch_up = {}
    for encoding in ("packed", "plain"):
        with tempfile.TemporaryDirectory() as tmp:
            storage = LocalStorage(Path(tmp))
            config = PublisherConfig(anchor_every=20, anchor_encoding=encoding, threads=1)
            publisher = Publisher(
                Link(storage, args.bandwidth, args.latency), model=args.model, config=config
            )
            commands, reports = spawn.Queue(), spawn.Queue()
            plan = [1] * args.steps + [2] * args.steps if encoding == "packed" else []
            steps = trajectory(args.layers, len(plan) + 1, args.lr, args.model)
            publisher.publish(next(steps), step=0)
            publisher.flush()
            follower = spawn.Process(target=replica, args=(tmp, args, commands, reports))
            follower.start()
            if plan:  # (the plain run only needs the late replica)
                commands.put((0, None))
                reports.get()
            for step, threads in enumerate(plan, 1):
                master = next(steps)
                publisher.config.threads = threads
                published_at, start = time.time(), time.perf_counter()
                publisher.publish(master, step=step)
                blocked_s = time.perf_counter() - start
                commands.put((step, threads))
                r = reports.get()
                publisher.flush()  # its head read back (replicas may apply first), its telemetry
                entry = publisher.head.entry(step, "delta")
                record = json.loads((Path(tmp) / f"telemetry/trainer/step-{step:08d}.json").read_text())
                cells = [step, threads, f"{entry.changed / numel:.2%}", megabytes(entry.bytes)]
                cells += [f"{blocked_s * 1e3:.0f} ms", f"{record['encode_s']:.2f} s", f"{r['apply_s']:.2f} s"]
                cells += [f"{r['applied_at'] - published_at:.2f} s"]
                print("| " + " | ".join(map(str, cells)) + " |", flush=True)
            commands.put(None)
            follower_peak = reports.get()["peak_rss"]
            follower.join()
            publisher.config.threads = None
            publisher.publish(next(steps), step=20)  # a delta and the anchor of step 20
            publisher.flush()
            anchor = publisher.head.entry(20, "anchor")
            late = spawn.Process(target=replica, args=(tmp, args, commands, reports))
            late.start()
            commands.put((20, None))
            r = reports.get()
            commands.put(None)
            late_peak = reports.get()["peak_rss"]
            late.join()
            publisher.close()
            catch_up[encoding] = {
                "bytes": anchor.bytes,
                "s": r["applied_at"] - r["start"],
                "apply_s": r["apply_s"],
            }
            catch_up[encoding] |= {"moved": r["moved"], "peak": late_peak}
            if encoding == "packed":
                print(
                    f"\npeak RSS: trainer + publisher process {peak_rss() / 1e9:.2f} GB (fp32 master "
                    f"{4 * numel / 1e9:.2f} GB), subscriber process {follower_peak / 1e9:.2f} GB"
                )
    print(
        f"\nA replica joining at step 20 (anchor of step 20, link {args.bandwidth_mb:g} MB/s, "
        f"{args.latency_ms:g} ms; decoding on all {os.cpu_count()} cores):\n"
    )
    print(
        "| anchor | stored | of bf16 | moved | decode + verify + load | caught up after | replica peak RSS |"
    )
    print("|---" * 7 + "|")
    for encoding, c in catch_up.items():
        cells = [encoding, f"{c['bytes'] / 1e9:.2f} GB", f"{c['bytes'] / (2 * numel):.1%}"]
        cells += [
            f"{c['moved'] / 1e9:.2f} GB",
            f"{c['apply_s']:.1f} s",
            f"**{c['s']:.1f} s**",
            f"{c['peak'] / 1e9:.2f} GB",
        ]
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def compare_signed(args, link: str) -> None:
    """The link row (compact, 1 subscriber) unsigned and signed, taking turns (each first in every other
    round): medians per round, and the signed / unsigned ratio of end to end over all rounds."""
    print(f"{link}, compact, 1 subscriber: medians of {args.steps} delta steps per run, the two taking turns")
    print("| round | end to end: unsigned | signed | signed / unsigned | encode: unsigned | signed |")
    print("|---" * 6 + "|")
    e2e: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "trainer.key"
        SigningKey.generate().save(key)
        for round_ in range(1, args.signed + 1):
            med = {}
            for signed in (False, True) if round_ % 2 else (True, False):  # each goes first in turn
                rows = run_ours(
                    Path(tmp) / f"root-{round_}-{signed}", True, 1, "compact", args, key if signed else None
                )
                med[signed] = {k: statistics.median(r[k] for r in rows) for k in ("e2e_s", "encode_s")}
                e2e[signed].append(med[signed]["e2e_s"])
            ratio = med[True]["e2e_s"] / med[False]["e2e_s"]
            cells = [round_, f"{med[False]['e2e_s']:.3f} s", f"{med[True]['e2e_s']:.3f} s", f"{ratio:.3f}"]
            cells += [f"{med[False]['encode_s']:.3f} s", f"{med[True]['encode_s']:.3f} s"]
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    overall = statistics.median(e2e[True]) / statistics.median(e2e[False])
    print(f"signed / unsigned, end to end, median over rounds: {overall:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(QWEN3), help="a whole model's shapes, see above")
    parser.add_argument("--layers", type=int, help="decoder layers (default 2; with --model, all 28)")
    parser.add_argument(
        "--steps", type=int, help="delta steps measured (default 8; with --model, 3 per thread count)"
    )
    parser.add_argument("--lr", type=float, default=2.5e-7, help="Adam-like step size (~1%% of bf16 change)")
    parser.add_argument("--bandwidth-mb", type=float, default=100)
    parser.add_argument("--latency-ms", type=float, default=50)
    parser.add_argument(
        "--signed",
        type=int,
        metavar="ROUNDS",
        help="instead: the link row unsigned and signed (issue 46), taking turns ROUNDS times",
    )
    args = parser.parse_args()
    args.bandwidth, args.latency = args.bandwidth_mb * 1e6, args.latency_ms / 1e3
    if args.model:
        args.layers = 28 if args.layers is None else args.layers
        args.steps = 3 if args.steps is None else args.steps
        return run_model(args)
    args.layers = 2 if args.layers is None else args.layers
    args.steps = 8 if args.steps is None else args.steps
    numel = sum(torch.Size(s).numel() for s in qwen3_shapes(args.layers).values())
    link = f"link {args.bandwidth_mb:g} MB/s, {args.latency_ms:g} ms"
    print(f"Qwen3-0.6B shapes, {args.layers} layers: {numel / 1e6:.0f}M parameters, {2 * numel / 1e6:.0f} MB")
    if args.signed:
        return compare_signed(args, link)
    print(
        "| storage | encoding | subscribers | density | payload | caller blocked / bf16 copy "
        "| end to end: ours | dense | dense / ours | bytes moved: ours | dense | dense / ours "
        "| encode | decode + apply | overhead |"
    )
    print("|---" * 15 + "|")
    dense_rows = {}
    for links, subscribers, encoding in [
        (False, 1, "compact"),
        (True, 1, "compact"),
        (True, 4, "compact"),
        (True, 1, "raw"),
        (True, 4, "raw"),
    ]:
        with tempfile.TemporaryDirectory() as tmp:
            ours = run_ours(Path(tmp) / "ours", links, subscribers, encoding, args)
            if (links, subscribers) not in dense_rows:
                dense_rows[links, subscribers] = run_dense(Path(tmp) / "dense", links, subscribers, args)
        dense = dense_rows[links, subscribers]
        med = {k: statistics.median(r[k] for r in ours) for k in ours[0]}
        dense_e2e = statistics.median(r["e2e_s"] for r in dense)
        ratio = med["blocked_s"] / med["copy_s"]
        blocked = f"{med['blocked_s'] * 1e3:.0f} / {med['copy_s'] * 1e3:.0f} ms ({ratio:.2f}x)"
        cells = [link if links else "local folder", encoding, subscribers, f"{med['changed'] / numel:.2%}"]
        cells += [megabytes(med["payload"]), blocked, f"{med['e2e_s']:.2f} s", f"{dense_e2e:.2f} s"]
        cells += [f"**{dense_e2e / med['e2e_s']:.1f}x**"]
        if links:
            dense_moved = statistics.median(r["moved"] for r in dense)
            wire = 2 * med["payload"] / args.bandwidth  # up, then down (each client has its own link)
            overhead = med["e2e_s"] - med["blocked_s"] - med["encode_s"] - med["apply_s"] - wire
            cells += [
                megabytes(med["moved"]),
                megabytes(dense_moved),
                f"**{dense_moved / med['moved']:.0f}x**",
            ]
            cells += [
                f"{med['encode_s']:.2f} s",
                f"{med['apply_s']:.2f} s",
                f"{overhead / args.latency:.1f} latencies",
            ]
        else:
            cells += ["-", "-", "-", f"{med['encode_s']:.2f} s", f"{med['apply_s']:.2f} s", "-"]
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)


if __name__ == "__main__":
    main()
