"""Where a step's time goes in `bench.sync`'s link row (link 100 MB/s + 50 ms, compact, 1 subscriber).

    python -m bench.sync_timeline [--layers 2] [--steps 4]

Runs the row's loop (bench.sync.run_ours) with the publisher's and the subscriber's phases timed by
wrapping them (make_patch: change detection and the fingerprint; encode; the upload request; the head's
write and read-back; the subscriber's decode of the next delta ahead of its head, and its apply) and every
request over the link, then prints, per delta step, each event's time since that step's publish() call.
The row's "overhead" (end to end minus the caller's copy, encode, decode+apply and bytes/bandwidth) is what
lies between these events.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import threading
import time
from pathlib import Path

import bench.sync as bench
from deltasync.sync import publisher, subscriber

Event = tuple[float, str, str]  # (time, thread, what)
PHASES = [
    (publisher, "make_patch", "diff + fingerprint"),
    (publisher, "encode", "encode"),
    (publisher.Publisher, "_upload", "upload"),
    (publisher.Publisher, "_write_head", "head write + read-back"),
    (subscriber.Subscriber, "_decode_ahead", "decode ahead"),
    (subscriber.Subscriber, "_apply", "apply"),
]


def timed(events: list[Event], owner, name: str, what: str) -> None:
    call = getattr(owner, name)

    @functools.wraps(call)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            thread = threading.current_thread().name
            events.append((start, thread, f"{what}: {1e3 * (time.perf_counter() - start):.0f} ms"))

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    args.bandwidth, args.latency, args.lr = 100e6, 0.05, 2.5e-7
    events: list[Event] = []
    for owner, name, what in PHASES:
        timed(events, owner, name, what)
    request = bench.Link._request

    def timed_request(link, up, call, down=len):
        start = time.perf_counter()
        result = request(link, up, call, down)
        took = 1e3 * (time.perf_counter() - start)
        events.append((start, threading.current_thread().name, f"request, {up} B up: {took:.0f} ms"))
        return result

    bench.Link._request = timed_request  # type: ignore[method-assign]
    calls: list[float] = []
    publish = publisher.Publisher.publish

    def timed_publish(self, params, step=None, info=None):
        calls.append(time.perf_counter())
        return publish(self, params, step, info)

    publisher.Publisher.publish = timed_publish  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        rows = bench.run_ours(Path(tmp) / "ours", True, 1, "compact", args)
    ends = [*calls[2:], float("inf")]  # each delta step's events: up to the next publish() call
    for step, (row, start, end) in enumerate(zip(rows, calls[1:], ends, strict=True), 1):
        print(
            f"--- step {step}: end to end {row['e2e_s']:.3f} s, caller's copy {row['blocked_s']:.3f} s, "
            f"encode {row['encode_s']:.3f} s, apply {row['apply_s']:.3f} s"
        )
        for at, thread, what in sorted(events):
            polls = thread.endswith("(follow)") and what.startswith("request, 0 B")  # back-to-back polls
            if start <= at < end and not polls:
                print(f"{at - start:7.3f} s  {thread[:24]:24}  {what}")


if __name__ == "__main__":
    main()
