"""A fleet on one token: Hub requests per 5-minute window, per component and class, at 10 to 1,000 replicas.

    python -m bench.hub [--replicas 10 100 1000] [--step-s 10] [--refresh-s 2]

A trainer publishing one step every `--step-s` seconds, the dashboard's telemetry reader and N replicas, all
through huggingface_hub's and hf_xet's real clients against the fake Hub (tests/fakehub.py), on the Hub's
terms: one user's quota per fixed window (the free tier up to 100 replicas, PRO above), shared by every
component, each with a token of its own so the fake counts them apart (`user_of` maps them all to one user),
and each with its share of the quota (deltasync.storage.budget.fleet_shares). Every replica is a Subscriber
with its own HubBucketStorage, change feed session, Xet tokens and telemetry sink, as a replica in a process
of its own would have (its own HTTP connection pool too: the client's default caps a process at 100).

Time is simulated: the fake Hub's windows, token expiries and feed sessions follow a clock the benchmark
moves, and so do the storages' budgets and the telemetry's delays. Replicas are driven in rounds on that
clock rather than each by a thread of its own (2 cores): after each step every replica syncs, and one whose
feed has not yet brought the head's event finds its old head (no request) and is asked again in the next
round, as its `follow()` would wake on the event. Its sink writes what has waited long enough at each round.
Measured: the first window (replicas start: run.json, anchor) and the second (steady), per component and
class, the 429s, that every replica applied every step (each verified against its fingerprint, the target
read back) and holds the trainer's bf16 weights bit for bit at the end; then two idle windows with no step
(the fleet's requests: only feed sessions the server ended, each one reconnect). A tiny model: the requests
matter, not the bytes.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx2
import torch

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import huggingface_hub._bucket_live_follow
from huggingface_hub import set_client_factory

from deltasync.errors import SyncError
from deltasync.storage import HubBucketStorage
from deltasync.storage.budget import FREE_TIER, PRO_TIER, WINDOW_S, Budget, fleet_shares
from deltasync.sync.publisher import Publisher, PublisherConfig
from deltasync.sync.subscriber import Subscriber, TensorsApplier
from deltasync.telemetry.reader import TelemetryReader
from deltasync.telemetry.sink import sink_for
from tests.fakehub import FakeHub

SHAPES = {"embed.weight": (256, 32), "mlp.weight": (128, 32)}
CLASSES = ("api", "resolvers", "cas")
SYNC_THREADS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0  # a window boundary

    def __call__(self) -> float:
        return self.t


def params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: 0.05 * torch.randn(s, generator=g) for n, s in SHAPES.items()}


def train(p: dict[str, torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for t in p.values():
        t += (torch.rand(t.shape, generator=g) < 0.01) * 0.05 * t.abs().clamp_min(1e-3)


class ThreadClients:
    """huggingface_hub's one HTTP client as a client per thread. Every replica's feed has a thread of its own,
    so a connection pool of its own, as a replica in a process of its own would: one pool holding 1,000 feed
    connections is scanned at every request and answer of any of them."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __getattr__(self, name: str):
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx2.Client(follow_redirects=True, timeout=None)
        return getattr(client, name)


def parse_datetime(value: str) -> datetime:
    """huggingface_hub's `parse_datetime` for the feed's timestamps (`...T12:34:56.789Z`, the same value)
    without `strptime`, whose process-wide lock the followers of 1,000 replicas in one process queue on
    (every change's two timestamps, in every follower): replicas in processes of their own would not."""
    return datetime.fromisoformat(value)


def wait(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.005)


class Fleet:
    """One run on a fresh fake Hub: the trainer, `replicas` replicas and the dashboard's reader."""

    def __init__(self, hub: FakeHub, replicas: int, tier: dict[str, int]):
        self.hub, self.clock = hub, Clock()
        hub.reset()
        hub.clock, hub.quotas, hub.feed_check_s = self.clock, dict(tier), 2.0
        self.shares = fleet_shares(tier, replicas)
        self.names = ["trainer", "dashboard", *(f"replica-{i}" for i in range(replicas))]
        hub.tokens |= {f"hf_{name}" for name in self.names}
        hub.user_of = {f"hf_{name}": "user" for name in self.names}
        self.params = params()
        self.publisher = Publisher(
            self.storage("trainer"), model="tiny", config=PublisherConfig(anchor_every=10**6)
        )
        self.publisher.publish(self.params, step=0)
        self.publisher.flush()
        self.step = 0
        self.subscribers: list[Subscriber] = []
        self.targets: list[dict[str, torch.Tensor]] = []
        for i in range(replicas):
            target = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
            sub = Subscriber(self.storage(f"replica-{i}"), TensorsApplier(target), f"replica-{i}", threads=1)
            sink_for(sub.storage).timer = False  # its writes are due on the test clock: `run` asks each sink
            self.subscribers.append(sub)
            self.targets.append(target)
        self.applied: dict[str, list[int]] = collections.defaultdict(list)
        self.failures: list[str] = []
        self.reader = TelemetryReader(self.storage("dashboard"))
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(SYNC_THREADS)  # kept: its threads' HTTP clients too (ThreadClients)
        for sub in self.subscribers:  # each opens its feed session, as follow() does before it waits
            sub.storage.wait_for_change(self.stop, 0.0)
        wait(lambda: all(s.storage.live for s in self.subscribers), "every replica's feed")  # type: ignore[attr-defined]
        self.settle()

    def storage(self, name: str) -> HubBucketStorage:
        share = self.shares["replica" if name.startswith("replica") else name]
        return HubBucketStorage("user/sync", token=f"hf_{name}", budget=share, clock=self.clock)

    def settle(self) -> None:
        """Sync every replica, round after round, until each holds the trainer's step."""
        behind, pause = self.subscribers, 0.01
        while behind:
            failed = len(self.failures)
            list(self.pool.map(self.sync, behind))
            ahead, behind = len(behind), [s for s in behind if s.step != self.step]
            # A round that moved no one: the feeds' events are still on the way, the next round later.
            pause = 0.01 if len(behind) < ahead else min(2 * pause, 0.5)
            if len(self.failures) > failed:
                print(
                    f"step {self.step}: {len(self.failures) - failed} syncs failed, "
                    f"{len(behind)} behind, first: {self.failures[failed]}",
                    file=sys.stderr,
                    flush=True,
                )
            if behind:
                time.sleep(pause)

    def sync(self, sub: Subscriber) -> None:
        try:
            for a in sub.sync():
                self.applied[sub.replica or ""].append(a.step)
        except SyncError as e:
            self.failures.append(f"{sub.replica}: {e}")
        sink_for(sub.storage).flush_due()

    def run(self, seconds: float, step_s: float | None, refresh_s: float) -> None:
        """Move the clock `seconds` forward: a step every `step_s` (None: none), the dashboard every
        `refresh_s`, the replicas' sinks at each."""
        end = self.clock.t + seconds
        next_step = self.clock.t + step_s if step_s else float("inf")
        next_refresh = self.clock.t + refresh_s
        while True:
            due = min(next_step, next_refresh)
            if due >= end:
                self.clock.t = end
                return
            self.clock.t = due
            if due == next_step:
                self.publish()
                next_step += step_s or 0
            if due == next_refresh:
                self.reader.poll()
                list(self.pool.map(lambda sub: sink_for(sub.storage).flush_due(), self.subscribers))
                next_refresh += refresh_s

    def publish(self) -> None:
        self.step += 1
        train(self.params, self.step)
        self.publisher.publish(self.params, step=self.step)
        wait(lambda: (head := self.publisher.head) is not None and head.step == self.step, "the publisher")
        self.settle()

    def counts(self, window: int) -> dict[str, dict[str, int]]:
        index = int(self.clock.t // WINDOW_S) if window < 0 else window
        out = {}
        for name in self.names:
            w = self.hub.windows.get((f"Bearer hf_{name}", index))
            out[name] = {c: (w.counts[c] if w else 0) for c in CLASSES}
        return out

    def window_index(self) -> int:
        return int(self.clock.t // WINDOW_S)

    def check(self) -> list[str]:
        """What is wrong: a replica that missed a step or holds other weights than the trainer's."""
        problems = []
        want = {n: t.to(torch.bfloat16) for n, t in self.params.items()}
        for sub, target in zip(self.subscribers, self.targets, strict=True):
            if self.applied[sub.replica or ""] != list(range(0, self.step + 1)):
                problems.append(f"{sub.replica} applied {len(self.applied[sub.replica or ''])} steps")
            if any(not torch.equal(target[n].view(torch.int16), want[n].view(torch.int16)) for n in want):
                problems.append(f"{sub.replica} holds other weights")
        return problems

    def close(self) -> None:
        self.stop.set()
        self.publisher.close()
        self.pool.shutdown()


def summarize(fleet: Fleet, window: int) -> dict:
    counts = fleet.counts(window)
    replicas = [counts[n] for n in fleet.names[2:]]
    total = {c: sum(v[c] for v in counts.values()) for c in CLASSES}
    return {
        "trainer": counts["trainer"],
        "dashboard": counts["dashboard"],
        "replicas": {c: sum(r[c] for r in replicas) for c in CLASSES},
        "replica_max": {c: max((r[c] for r in replicas), default=0) for c in CLASSES},
        "total": total,
    }


def progress(replicas: int, done: str, fleet: Fleet, started: float) -> None:
    elapsed = time.monotonic() - started
    spent = summarize(fleet, fleet.window_index())["total"]
    paths = collections.Counter(r.rsplit("/", 1)[-1] for r in fleet.hub.requests).most_common(5)
    print(
        f"{replicas} replicas: {done} at step {fleet.step}, {elapsed:.0f} s; this window so far "
        f"{cell(spent)}; requests by path {paths}",
        file=sys.stderr,
        flush=True,
    )


def measure(hub: FakeHub, replicas: int, step_s: float, refresh_s: float) -> dict:
    tier = FREE_TIER if replicas <= 100 else PRO_TIER
    started = time.monotonic()
    fleet = Fleet(hub, replicas, tier)
    try:
        first = fleet.window_index()
        progress(replicas, "started", fleet, started)
        fleet.run(WINDOW_S - (fleet.clock.t % WINDOW_S), step_s, refresh_s)  # the start's window
        progress(replicas, "start window", fleet, started)
        fleet.run(WINDOW_S, step_s, refresh_s)  # a steady one
        progress(replicas, "steady window", fleet, started)
        delays = [sink_for(s.storage).max_delay_s for s in fleet.subscribers[:1]]
        fleet.run(2 * WINDOW_S, None, refresh_s)  # idle: what waits is written, then nothing but reconnects
        idle_from = len(hub.requests)
        for _ in range(60):  # slowly enough for the feed's sessions to see the clock (they check every 2 s)
            fleet.run(2 * WINDOW_S / 60, None, refresh_s)
            time.sleep(0.1)
        idle = collections.Counter(r.rsplit("/", 1)[-1] for r in hub.requests[idle_from:])
        problems = fleet.check()
        limited = hub.limited()
        fleet.reader.poll()
        shown = sum(len(steps) for steps in fleet.reader.replicas.values())
    finally:
        fleet.close()
    return {
        "replicas": replicas,
        "tier": "free" if tier is FREE_TIER else "PRO",
        "quota": tier,
        "start": summarize(fleet, first),
        "steady": summarize(fleet, first + 1),
        "limited": limited,
        "failures": fleet.failures,
        "problems": problems,
        "steps": fleet.step,
        "delay_s": delays[0] if delays else None,
        "idle": dict(idle),
        "shown": shown,
        "share": fleet.shares["replica"],
        "wall_s": time.monotonic() - started,
    }


def cell(v: dict[str, float]) -> str:
    return f"{v['api']:,.0f} / {v['resolvers']:,.0f} / {v['cas']:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--step-s", type=float, default=10.0)
    parser.add_argument("--refresh-s", type=float, default=2.0)
    args = parser.parse_args()
    # This process only (a private name: its canary is in tests/deltasync/storage/test_compat.py)
    huggingface_hub._bucket_live_follow.parse_datetime = parse_datetime
    set_client_factory(ThreadClients)
    hub = FakeHub(Path(tempfile.mkdtemp(prefix="bench-hub-cas-")))
    hub.start()
    os.environ["HF_ENDPOINT"] = hub.endpoint
    os.environ["HF_XET_CACHE"] = str(hub.client_cache)
    from huggingface_hub import constants

    constants.ENDPOINT = hub.endpoint  # read at import: point the imported client at the fake
    rows = []
    try:
        for n in args.replicas:
            rows.append(measure(hub, n, args.step_s, args.refresh_s))
            r = rows[-1]
            print(f"{n} replicas: {r['wall_s']:.0f} s of wall time, {r['steps']} steps", flush=True)
    finally:
        hub.stop()
    print(
        f"\nRequests per 5-minute window (API / resolver / CAS), trainer one step per {args.step_s:g} s, "
        f"dashboard every {args.refresh_s:g} s, simulated clock, everyone on one user's quota.\n"
    )
    columns = [
        "replicas",
        "tier",
        "window",
        "trainer",
        "dashboard",
        "all replicas",
        "busiest replica",
        "total",
    ]
    print("| " + " | ".join([*columns, "fits", "429s"]) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        quota = f"{r['tier']} ({r['quota']['api']:,} / {r['quota']['resolvers']:,})"
        for name in ("start", "steady"):
            s = r[name]
            fits = "yes" if all(s["total"][c] <= r["quota"][c] for c in ("api", "resolvers")) else "NO"
            cells = [s[k] for k in ("trainer", "dashboard", "replicas", "replica_max", "total")]
            row = [f"{r['replicas']:,}", quota, name, *map(cell, cells), fits, str(r["limited"])]
            print("| " + " | ".join(row) + " |")
    for r in rows:
        share: Budget = r["share"]
        held = (
            "every replica applied every step, verified, bit for bit"
            if not r["problems"]
            else r["problems"][:3]
        )
        print(
            f"\n{r['replicas']:,} replicas: a replica's share {share.api} API / {share.resolvers} resolver "
            f"calls a window, its telemetry written at most every {r['delay_s']:.0f} s; {r['steps']} steps: "
            f"{held}; sync failures {len(r['failures'])} {r['failures'][:2]}; the dashboard holds "
            f"{r['shown']:,} replica records of {r['replicas'] * (r['steps'] + 1):,} steps applied; two idle "
            f"windows: {sum(r['idle'].values())} requests {r['idle']}."
        )


if __name__ == "__main__":
    main()
