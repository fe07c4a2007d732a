"""Dashboard cost at 10,000 steps of telemetry (1 trainer + 2 replicas = 30,000 records in a local folder).

    python -m bench.dashboard [--steps 10000] [--refreshes 10] [--no-browser]

Server side (in process): the first load, then ticks with nothing new (probing, or listing: a tick lists when
that keeps listing under 10% of the time) and ticks after appending one step (or 100), timed through the app's
own tick (`update`: poll the new records, summarise, redraw the text views, rebuild the figures) plus Gradio's
serialisation of the figures. Browser side (Debian's Chromium driven by
Playwright, if present): the page's first load, and per appended step the time until the plots show it
(includes waiting for the next 1 s tick) and the longest main-thread task (what a viewer feels as a freeze).
Hostile keys: the first tick and the `/api/series` size over 200 trainer records with 63 info keys of their
own each (valid) and 200 with 3,000 (skipped as invalid), against the same over a plain 200-step run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import gradio as gr
import plotly.graph_objects as go

from bench import load_space_app
from deltasync.telemetry import ReplicaRecord, TrainerRecord, to_json
from deltasync.telemetry.reader import LISTING_SHARE
from trainer.processes import serving

REPO = Path(__file__).resolve().parents[1]
APP = REPO / "spaces" / "dashboard" / "app.py"
CHROMIUM = Path("/usr/bin/chromium")
NUMEL = 596_049_920  # Qwen3-0.6B
REPLICAS = ("r0", "r1")


def write_steps(root: Path, steps: range, rng: random.Random) -> None:
    """Records as the publisher and two subscribers write them, saved without fsync (setup, not measured)."""
    for step in steps:
        published_at = time.time()
        changed = int(NUMEL * rng.uniform(0.01, 0.02))
        payload = int(changed * 0.9)
        info = {
            "reward_mean": rng.random(),
            "staleness_steps_mean": 1 + rng.random(),
            "staleness_steps_max": 3,
        }
        records = [
            TrainerRecord(
                step, "delta", published_at, NUMEL, changed, payload, 2 * NUMEL, 0.5, 1.2, 0.02, info=info
            )
        ]
        for replica in REPLICAS:
            applied_at = published_at + rng.uniform(0.5, 2.0)
            records.append(ReplicaRecord(replica, step, "delta", published_at, applied_at, 0.8, 0.1, True, 0))
        for record in records:
            path = root / record.path()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(to_json(record))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def server_side(root: Path, steps: int, refreshes: int, rng: random.Random) -> list[tuple[str, str]]:
    app = load_space_app("dashboard")
    board = app.Board(str(root))
    plot = gr.Plot(render=False)
    shown = -1

    def tick() -> None:
        nonlocal shown
        outputs = app.update(board, shown, refresh_s=2.0)
        shown = outputs[0]
        for figure in outputs[-len(app.PLOTS) :]:
            if isinstance(figure, go.Figure):
                plot.postprocess(figure)

    def listing(ticks: Callable[[], object]) -> object:
        """Run `ticks` with a listing on every poll (a tick lists about every 10 listing times)."""
        board.reader.listing_share = float("inf")
        try:
            return ticks()
        finally:
            board.reader.listing_share = LISTING_SHARE

    rows = []
    poll = timed(board.refresh)
    first = poll + timed(tick)
    rows.append((f"first load ({3 * steps:,} files)", f"{first * 1000:.0f} ms (poll {poll * 1000:.0f} ms)"))
    rows.append(("tick, nothing new (probe next steps)", _stats([timed(tick) for _ in range(refreshes)])))
    rows.append(
        ("tick, nothing new, full listing", _stats(listing(lambda: [timed(tick) for _ in range(refreshes)])))
    )
    one = []
    for i in range(refreshes):
        write_steps(root, range(steps + i, steps + i + 1), rng)
        one.append(timed(tick))
    rows.append(("tick, +1 step (3 records)", _stats(one)))
    start = steps + refreshes
    # Probes follow a writer 8 steps a tick: a burst is read by the next listing.
    write_steps(root, range(start, start + 100), rng)
    rows.append(("tick, +100 steps (300 records, listed)", f"{listing(lambda: timed(tick)) * 1000:.0f} ms"))
    return rows


def browser_side(root: Path, steps: int, refreshes: int, rng: random.Random) -> list[tuple[str, str]]:
    from playwright.sync_api import sync_playwright

    env, log = {"SYNC_ROOT": str(root), "REFRESH_S": "1"}, root.parent / "dashboard.log"
    with serving([sys.executable, str(APP)], log, env, timeout=90, health="/api/summary", grace_s=10) as url:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            density_points = """() => { const p = document.querySelector('#density .js-plotly-plot');
                const x = p && p.data[0] && p.data[0].x; return x ? x.length ?? x._inputArray.length : 0 }"""
            page.goto(url)
            start = time.perf_counter()
            page.wait_for_function(f"n => ({density_points})() === n", arg=steps, timeout=120_000)
            rows = [(f"page load until {steps:,}-point plots drawn", f"{time.perf_counter() - start:.2f} s")]
            page.evaluate("""() => { window.longest = 0; new PerformanceObserver(list => list.getEntries()
                .forEach(e => { window.longest = Math.max(window.longest, e.duration) }))
                .observe({ type: 'longtask' }) }""")
            shown, longest = [], []
            for i in range(refreshes):
                page.evaluate("window.longest = 0")
                write_steps(root, range(steps + i, steps + i + 1), rng)
                start = time.perf_counter()
                page.wait_for_function(f"n => ({density_points})() === n", arg=steps + i + 1, timeout=30_000)
                shown.append(time.perf_counter() - start)
                page.wait_for_timeout(300)  # let the other plots finish drawing
                longest.append(page.evaluate("window.longest") / 1000)
            rows.append(("+1 step: written to drawn (1 s timer)", _stats(shown)))
            rows.append(("+1 step: longest main-thread task", _stats(longest)))
            browser.close()
        return rows


def hostile_keys(tmp: Path) -> list[tuple[str, str]]:
    """The first tick and the series' JSON size over records with thousands of distinct info keys, and over
    a plain run of as many steps."""
    app = load_space_app("dashboard")
    plot = gr.Plot(render=False)
    results = {}
    for name, keys in (("plain", {}), ("hostile", {63: range(200), 3000: range(200, 400)})):
        root = tmp / f"keys-{name}"
        write_steps(root, range(200), random.Random(0))
        for count, steps in keys.items():
            for step in steps:
                info = {f"s{step}.k{i}": 1.0 for i in range(count)}
                record = TrainerRecord(
                    step, "delta", time.time(), NUMEL, 1, 1, 2 * NUMEL, 0.5, 1.2, 0.02, info=info
                )
                (root / record.path()).write_bytes(to_json(record))
        board = app.Board(str(root))

        def tick(board=board) -> None:
            for figure in app.update(board, -1, refresh_s=2.0)[-len(app.PLOTS) :]:
                plot.postprocess(figure)

        results[name] = (timed(tick), len(json.dumps(board.series())), len(board.reader.problems))
    (plain_s, plain_bytes, _), (hostile_s, hostile_bytes, skipped) = results["plain"], results["hostile"]
    return [
        (
            f"first tick, 400 records with 63 or 3,000 keys each ({skipped} skipped) vs a plain 200-step run",
            f"{hostile_s * 1000:.0f} ms vs {plain_s * 1000:.0f} ms ({hostile_s / plain_s:.1f}x)",
        ),
        (
            "/api/series size, same two roots",
            f"{hostile_bytes / 1e6:.2f} MB vs {plain_bytes / 1e6:.2f} MB "
            f"({hostile_bytes / plain_bytes:.1f}x)",
        ),
    ]


def _stats(seconds: list[float]) -> str:
    return f"median {statistics.median(seconds) * 1000:.0f} ms, max {max(seconds) * 1000:.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--refreshes", type=int, default=10)
    parser.add_argument("--no-browser", action="store_true")
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        write_steps(root, range(args.steps), rng)
        rows = server_side(root, args.steps, args.refreshes, rng)
        rows += hostile_keys(Path(tmp))
        if not args.no_browser and CHROMIUM.exists():
            browser_root = Path(tmp) / "browser-root"
            write_steps(browser_root, range(args.steps), rng)
            rows += browser_side(browser_root, args.steps, args.refreshes, rng)
    print(f"\n{args.steps:,} steps, 1 trainer + {len(REPLICAS)} replicas, {os.cpu_count()} CPUs\n")
    print("| what | time |\n|---|---|")
    for what, value in rows:
        print(f"| {what} | {value} |")


if __name__ == "__main__":
    main()
