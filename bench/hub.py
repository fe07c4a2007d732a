"""Hub requests per 5-minute window, per component and class: what a run costs against the Hub's quotas.

    python -m bench.hub [--replicas 1 4 8] [--step-s 10] [--refresh-s 2]

A trainer publishing one step every `--step-s` seconds, 1, 4 and 8 replicas and the dashboard's telemetry
reader, all through huggingface_hub's real client against the fake Hub (tests/fakehub.py), each component
with a token of its own so the fake counts them apart (on the Hub they share the user's quota: the total
column). Time is simulated: the fake Hub's windows follow a clock the benchmark moves, so a window takes
seconds, not five minutes. Two setups: replicas and dashboard following the bucket's change feed, and polling
without it (replicas at the interval their request budget allows, `HubBucketStorage.poll_s`; the dashboard
every `--refresh-s`). A tiny model (the bytes do not matter, the requests do). One window is measured after a
warm-up of a few steps. Also: an idle replica on the feed over a whole window, and how long a replica on the
feed takes from the head's write to its verified apply.

Not simulated: the lease renewal runs on the real clock (every 30 s of it), and it now rides the step's data
request (no request of its own while steps come faster than that); feed sessions end after 600 s of the
simulated clock (the Hub ends them when it rotates servers: how often is not documented).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from deltasync.storage import HubBucketStorage
from deltasync.sync.publisher import Publisher, PublisherConfig
from deltasync.sync.subscriber import Subscriber, TensorsApplier
from deltasync.telemetry.reader import TelemetryReader
from tests.fakehub import FREE_TIER, PRO_TIER, FakeHub

WINDOW_S = 300.0
WARMUP_STEPS = 3
SHAPES = {"embed.weight": (512, 64), "mlp.weight": (256, 64)}
CLASSES = ("api", "resolvers")


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: 0.05 * torch.randn(s, generator=g) for n, s in SHAPES.items()}


def train(p: dict[str, torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for t in p.values():
        t += (torch.rand(t.shape, generator=g) < 0.01) * 0.05 * t.abs().clamp_min(1e-3)


def wait(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.002)


class Run:
    """One setup on a fresh fake Hub: trainer, `replicas` replicas, the dashboard's reader."""

    def __init__(self, hub: FakeHub, replicas: int, feed: bool, root: str):
        self.hub, self.feed, self.clock = hub, feed, Clock()
        hub.reset()
        hub.clock = self.clock
        hub.quotas = {"api": 10**9, "resolvers": 10**9}  # measure the demand: nothing refused
        self.tokens = ["trainer", *(f"replica-{i}" for i in range(replicas)), "dashboard"]
        hub.tokens |= {f"hf_{name}" for name in self.tokens}

        def storage(name: str) -> HubBucketStorage:
            return HubBucketStorage("user/sync", root, token=f"hf_{name}", follow=feed)

        self.params = params()
        self.publisher = Publisher(
            storage("trainer"), model="tiny", config=PublisherConfig(anchor_every=1000)
        )
        self.publisher.publish(self.params, step=0)
        self.publisher.flush()
        self.step = 0
        self.stop = threading.Event()
        self.subscribers = []
        for i in range(replicas):
            target = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
            sub = Subscriber(storage(f"replica-{i}"), TensorsApplier(target), replica=f"replica-{i}")
            self.subscribers.append(sub)
            if feed:
                threading.Thread(target=sub.follow, args=(self.stop, 1.0), daemon=True).start()
        self.reader = TelemetryReader(storage("dashboard"))
        self.poll_s = self.subscribers[0].storage.poll_s if self.subscribers else 1.0  # type: ignore[attr-defined]
        self.latencies: list[float] = []

    def run(self, seconds: float, step_s: float, refresh_s: float) -> None:
        """Move the clock `seconds` forward, with each component acting when it is due."""
        end = self.clock.t + seconds
        next_step = self.clock.t + step_s
        next_poll = self.clock.t + (self.poll_s if not self.feed else float("inf"))
        next_refresh = self.clock.t + refresh_s
        while True:
            due = min(next_step, next_poll, next_refresh)
            if due > end:
                self.clock.t = end
                return
            self.clock.t = due
            if due == next_step:
                self.publish()
                next_step += step_s
            if due == next_poll:
                for sub in self.subscribers:
                    sub.sync()
                next_poll += self.poll_s
            if due == next_refresh:
                self.reader.poll()
                next_refresh += refresh_s

    def publish(self) -> None:
        self.step += 1
        train(self.params, self.step)
        self.publisher.publish(self.params, step=self.step)
        # No flush(): it would send the step's telemetry on its own, which rides the next step's data.
        wait(lambda: (head := self.publisher.head) is not None and head.step == self.step, "the publisher")
        if self.feed:  # the replicas act on the head's event: wait until they have, on the same clock time
            wait(lambda: all(s.step == self.step for s in self.subscribers), "the replicas")
            head = max(c.wall for c in self.hub.changes if c.change["path"].endswith("heads/latest.json"))
            self.latencies += [s.history[-1].applied_at - head for s in self.subscribers]

    def counts(self) -> dict[str, dict[str, int]]:
        return {name: {c: sum(self.hub.counts(c, f"hf_{name}")) for c in CLASSES} for name in self.tokens}

    def close(self) -> None:
        self.stop.set()
        self.publisher.close()


def measure(hub: FakeHub, replicas: int, feed: bool, step_s: float, refresh_s: float) -> dict:
    run = Run(hub, replicas, feed, f"bench-{replicas}-{int(feed)}")
    try:
        run.run(WARMUP_STEPS * step_s, step_s, refresh_s)
        hub.windows.clear()
        run.latencies.clear()
        run.run(WINDOW_S, step_s, refresh_s)
        counts = run.counts()
    finally:
        run.close()
    replica_counts = [counts[f"replica-{i}"] for i in range(replicas)]
    return {
        "replicas": replicas,
        "feed": feed,
        "poll_s": None if feed else run.poll_s,
        "trainer": counts["trainer"],
        "replica": {c: statistics.fmean(r[c] for r in replica_counts) for c in CLASSES},
        "dashboard": counts["dashboard"],
        "total": {c: sum(v[c] for v in counts.values()) for c in CLASSES},
        "latency_s": statistics.median(run.latencies) if run.latencies else None,
        "latency_max_s": max(run.latencies, default=None),
    }


def idle_replica(hub: FakeHub) -> list[str]:
    """The requests of one replica following the feed for a whole window while nothing changes."""
    run = Run(hub, 1, True, "bench-idle")
    try:
        wait(lambda: run.subscribers[0].step == 0, "the replica")
        time.sleep(0.5)
        hub.requests.clear()
        for _ in range(30):
            run.clock.t += WINDOW_S / 30
            time.sleep(0.05)
        time.sleep(1.5)  # a reconnect the server asked for at the window's end
        return list(hub.requests)
    finally:
        run.close()


def fits(total: dict[str, float], tier: dict[str, int]) -> str:
    return "yes" if all(total[c] <= tier[c] for c in CLASSES) else "no"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--step-s", type=float, default=10.0)
    parser.add_argument("--refresh-s", type=float, default=2.0)
    args = parser.parse_args()
    hub = FakeHub(Path(tempfile.mkdtemp(prefix="bench-hub-cas-")))
    hub.start()
    os.environ["HF_ENDPOINT"] = hub.endpoint
    os.environ["HF_XET_CACHE"] = str(hub.client_cache)
    from huggingface_hub import constants

    constants.ENDPOINT = hub.endpoint  # read at import: point the imported client at the fake
    started = time.monotonic()
    try:
        rows = [
            measure(hub, n, feed, args.step_s, args.refresh_s)
            for feed in (True, False)
            for n in args.replicas
        ]
        idle = idle_replica(hub)
    finally:
        hub.stop()
    print(
        f"Requests per 5-minute window (API / resolver), trainer one step per {args.step_s:g} s, dashboard "
        f"every {args.refresh_s:g} s, simulated clock; {time.monotonic() - started:.0f} s of wall time.\n"
    )
    print("| setup | replicas | trainer | each replica | dashboard | total | free tier | PRO |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        setup = "change feed" if r["feed"] else f"polling every {r['poll_s']:.2f} s"

        def cell(v: dict[str, float]) -> str:
            return f"{v['api']:.0f} / {v['resolvers']:.0f}"

        print(
            f"| {setup} | {r['replicas']} | {cell(r['trainer'])} | {cell(r['replica'])} | "
            f"{cell(r['dashboard'])} | {cell(r['total'])} | {fits(r['total'], FREE_TIER)} | "
            f"{fits(r['total'], PRO_TIER)} |"
        )
    for r in rows:
        if r["latency_s"] is not None:
            print(
                f"\nOn the feed, {r['replicas']} replicas: head written -> a replica verified it, "
                f"median {r['latency_s']:.3f} s, at most {r['latency_max_s']:.3f} s (wall clock)."
            )
    print(f"An idle replica on the feed, one whole window: {len(idle)} requests {sorted(set(idle))}.")


if __name__ == "__main__":
    main()
