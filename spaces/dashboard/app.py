"""Dashboard Space: plots a run's sync health from the sync root's telemetry/ alone.

    SYNC_ROOT=/path/or/hf://buckets/ns/name python spaces/dashboard/app.py

Environment: SYNC_ROOT (required), HF_TOKEN (private buckets), PORT (default 7860), HOST (default 0.0.0.0),
REFRESH_S (seconds between refreshes, default 2), STALE_AFTER_S (a replica behind the newest step and silent
this long is shown as stopped reporting, default 120), POLL_BUDGET (requests per 5-minute window the board may
spend on a remote root, default 1000: polls are spaced and record reads capped to keep within it; a long run's
history is read newest first over as many windows as it takes).

The UI is at `/`; scripts read `GET /api/summary` and `GET /api/series?since=STEP` (JSON).

On a LoRA root (run.json's `lora`, read once the first trainer record is in) it also shows the adapter
versions, each version's payload beside what the merged path would have published (where the trainer measured
it: `merged_payload_bytes`), and the versions each replica holds (`TelemetryReader.adapter_summary`). On a
quantized root (run.json's `quantization`) the status says the recipe the replicas serve.
"""

from __future__ import annotations

import html
import logging
import math
import re
import string
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import gradio as gr
import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic_settings import BaseSettings

from appkit.asgi import BodyLimit, serve
from appkit.settings import from_env
from appkit.units import format_bytes, format_steps
from deltasync.errors import EXPECTED, ManifestError
from deltasync.storage import POLL_BUDGET, LocalStorage, open_storage, redact
from deltasync.storage.hub import WINDOW_S
from deltasync.sync.protocol import RUN_PATH, RunInfo, read_manifest
from deltasync.sync.signing import Trust, short
from deltasync.telemetry import ReplicaRecord
from deltasync.telemetry.reader import TelemetryReader

log = logging.getLogger("deltasync.dashboard")

PLOTS = [
    "density",
    "payload",
    "staleness-seconds",
    "staleness-steps",
    "reward",
    "rollouts",
    "tokens",
    "trainer-time",
]
REWARD_WINDOW = 5  # steps in the reward's rolling mean
REPLICA_COLUMNS = [
    "replica",
    "status",
    "step",
    "behind",
    "last lag",
    "last apply",
    "applied",
    "refused",
    "last error",
]
SHOWN_PROBLEMS = 50
MAX_REQUEST_BYTES = 64 << 10  # the page's event calls carry a version number; the API takes no body
RATE_LIMIT_SHOWN_S = 600.0  # a replica's rate limit stays on the page this long after it ended
REQUEST_WAIT_S = (
    2.0  # a page tick or an API call waits this long for a poll it started, then shows what is there
)
DENSE = 0.1  # mean delta density above which the page says why this run changes far more than real models do
OUTLIER_QUANTILE, OUTLIER_HEADROOM = (
    95,
    1.5,
)  # a plot's y-range ends at 1.5x its 95th percentile; higher: marked
ASCII_PUNCTUATION = re.compile(f"([{re.escape(string.punctuation)}])")  # what Markdown lets one escape
pio.templates.default = "plotly_white"  # set once: a per-figure template= costs a deep copy on every refresh
CSS = """
#headline .cards { display: grid; gap: 10px; grid-template-columns: repeat(auto-fit, minmax(140px, 1fr)); }
#headline .card { min-width: 0; border: 1px solid var(--border-color-primary); border-radius: 8px;
                  padding: 8px 10px; }
#headline .label, #headline .note { font-size: 0.85em; color: var(--body-text-color-subdued); }
#headline .value { font-size: 1.5em; font-weight: 600; white-space: nowrap; }
"""


class Board:
    """What every browser session and the API share: one reader of the sync root and the figures of the
    latest data version (rebuilt only when new records arrive). However many viewers tick, one polls at a
    time, at most once per `min_poll_s` (or the storage's `poll_s`, set by `poll_budget`, without a change
    feed); the others render what is there, even while a slow bucket holds the poll."""

    def __init__(
        self,
        root: str,
        stale_after_s: float = 120.0,
        min_poll_s: float = 0.0,
        poll_budget: int = POLL_BUDGET,
        wait_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.root = redact(root)  # shown on the page and in /api/summary: never its credentials
        self.stale_after_s = stale_after_s
        self.min_poll_s = min_poll_s
        self.poll_budget = poll_budget
        self.wait_s = wait_s  # how long refresh() waits for the poll it starts (None: until it ends)
        self.clock = clock  # of polls and the quota window
        self._polled_at = -float("inf")
        self._polling = threading.Lock()  # held by the poll under way (its thread releases it)
        self._requests = float(poll_budget)  # what the quota window has left for this board (remote roots)
        self._requests_at = self.clock()
        self.lock = threading.Lock()  # guards the reader's records and the fields below
        self.version = 0  # bumped whenever a poll reads something new
        self.error: str | None = None  # why the root cannot be read right now
        self.unread: dict[str, str] = {}
        self.read_at: float | None = None  # end of the last successful poll (unix s)
        self.reader: TelemetryReader | None = None
        self.run: RunInfo | None = None  # run.json (None: not read yet, or telemetry alone)
        self.signature_error: str | None = None  # why a signed run.json's signature does not hold
        self._run_read = False  # run.json read (once the trainer's first record is in: it precedes them)
        self._figures: tuple[int, list[go.Figure]] | None = None
        if not root:
            self.error = "SYNC_ROOT is not set: start the app with SYNC_ROOT=<folder or hf://buckets/ns/name>"
            return
        try:
            self.reader = TelemetryReader(open_storage(root, poll_budget=poll_budget))
        except Exception as e:  # a malformed URL is shown on the page, like any other failure
            self.error = redact(f"cannot open {root}: {e}")

    def refresh(self) -> int:
        """Start a poll for the records written since the last one, unless one is under way or ended less than
        `min_poll_s` ago, and wait up to `wait_s` for it; return the data version. The poll runs in its own
        thread: a root that does not answer holds no page and no API call longer than `wait_s`."""
        if self.reader is None or not self._polling.acquire(blocking=False):
            return self.version
        storage = self.reader.storage
        budget_s = 0.0 if storage.follows_changes else storage.poll_s  # a feed's news cost no request
        left = self._requests_left()
        # a listing and a stat (of the next names, or of refusals a replica may rewrite); run.json until read
        cost = (0 if storage.follows_changes else 2) + (not self._run_read)
        if self.clock() - self._polled_at < max(self.min_poll_s, budget_s) or (
            left is not None and left < cost
        ):
            self._polling.release()
            return self.version
        max_reads = None if left is None else int(left) - cost
        poll = threading.Thread(target=self._poll, args=(max_reads, cost), name="dashboard-poll", daemon=True)
        poll.start()
        poll.join(self.wait_s)
        return self.version

    def _requests_left(self) -> float | None:
        """Requests this board may still send in the quota window (refilled at poll_budget per WINDOW_S);
        None for a folder, which has no quota."""
        if isinstance(self.reader.storage, LocalStorage):
            return None
        now = self.clock()
        refill = (now - self._requests_at) * self.poll_budget / WINDOW_S
        self._requests = min(float(self.poll_budget), self._requests + refill)
        self._requests_at = now
        return self._requests

    def _poll(self, max_reads: int | None, cost: int) -> None:
        try:
            try:
                fetched = self.reader.fetch(max_reads)  # the slow part, outside self.lock
            except Exception as e:  # the root is unreadable: keep the last data and say why
                error = redact(str(e)) or type(e).__name__
                if error != self.error:  # said once, and again when it changes
                    log.warning("cannot read %s: %s", self.root, error)
                self.error = error
                return
            finally:
                self._polled_at = self.clock()
            self._requests -= cost + len(fetched)
            with self.lock:
                poll = self.reader.apply(fetched)
                if self.error:
                    log.warning("reading %s again", self.root)
                self.error, self.unread, self.read_at = None, poll.unread, time.time()
                if not self._run_read and self.reader.trainer:
                    self._read_run()
                if poll.records or poll.problems:
                    self.version += 1
        finally:
            self._polling.release()

    def _read_run(self) -> None:
        try:
            data = read_manifest(self.reader.storage, RUN_PATH)
            self.run = RunInfo.from_json(data)
            self.signature_error = signature_error(self.run, data)
        except FileNotFoundError:  # telemetry alone (copied from a run): shown as full weights
            pass
        except EXPECTED:  # unreadable now: the telemetry is still shown, and the next poll tries again
            return
        self._run_read = True

    @property
    def lora(self) -> dict | None:
        """run.json's `lora`: a LoRA root."""
        return self.run.lora if self.run else None

    def summary(self) -> dict[str, Any]:
        """The reader's summary plus this board's error state (JSON-ready); once run.json is read, `run`
        (run_summary); on a LoRA root, `adapters`."""
        with self.lock:
            if self.reader is None:
                return {"root": self.root, "error": self.error}
            base = self.reader.summary(time.time(), self.stale_after_s)
            state = {"error": self.error, "unread": len(self.unread), "read_at": self.read_at}
            run = {"run": run_summary(self.run, self.signature_error)} if self.run else {}
            adapters = {"adapters": self.reader.adapter_summary(self.lora)} if self.lora else {}
            refusals = {"head_refusals": head_refusals(self.reader.replicas)}
            return {**base, **state, **run, **adapters, **refusals, "version": self.version}

    def series(self, since: int = -1) -> dict[str, Any]:
        with self.lock:
            return self.reader.series(since) if self.reader else {"trainer": {}, "replicas": {}}

    def problems(self) -> dict[str, str]:
        with self.lock:
            return dict(self.reader.problems) if self.reader else {}

    def figures(self) -> list[go.Figure]:
        with self.lock:
            if self._figures is None or self._figures[0] != self.version:
                series = self.reader.series() if self.reader else None
                figures = build_figures(series, self.lora) if series else [_figure("", "", [])] * len(PLOTS)
                self._figures = (self.version, figures)
            return self._figures[1]


def run_summary(run: RunInfo, signature_error: str | None = None) -> dict[str, Any]:
    """The fields of run.json the page shows (run_lines), JSON-ready: the model, on a quantized root the
    recipe its replicas serve (None: bf16), on a signed root the key that signs its heads (`signed_by`, None:
    unsigned) and `signature_error` if run.json's signature does not hold (signature_error())."""
    signed_by = run.signing.keys[-1] if run.signing else None
    return {
        "model": run.model,
        "quantization": run.quantization,
        "signed_by": signed_by,
        "signature_error": signature_error,
    }


def signature_error(run: RunInfo, data: bytes) -> str | None:
    """Why the signed run.json `data` is not signed by the keys it names (None: it is, or it is unsigned).
    The board trusts no key of its own: it checks that the key shown did sign, which a bucket writer without
    that key cannot fake; which key to trust is the replicas' setting."""
    if run.signing is None:
        return None
    try:
        Trust(run.signing.keys[:1]).run(data)
    except ManifestError as e:
        return str(e)
    return None


def head_refusals(replicas: dict[str, dict[int, ReplicaRecord]]) -> dict[str, dict[str, Any]]:
    """Per replica that refused heads for their signature (records of kind "head"): how many, and the last
    refusal's error and time."""
    refusals = {}
    for name, steps in replicas.items():
        refused = sorted((r for r in steps.values() if r.kind == "head"), key=lambda r: r.applied_at)
        if refused:
            last = refused[-1]
            refusals[name] = {"count": len(refused), "last_error": last.error, "last_at": last.applied_at}
    return refusals


# ------------------------------------------------------------------------------------------------- figures


def build_figures(series: dict[str, Any], lora: dict | None = None) -> list[go.Figure]:
    """One figure per entry of PLOTS from TelemetryReader.series(), x = step (on a LoRA root, `lora`: the
    adapter version of that step), on one shared step axis. Columns become numpy arrays: plotly ships those to
    the browser as binary, which keeps refreshes of long runs fast."""
    trainer = {k: np.asarray(v) for k, v in series["trainer"].items()}
    kind = trainer["kind"].astype(str)
    delta, published = kind == "delta", kind != "skipped"
    anchored = published & ((kind == "anchor") | (trainer["anchor_bytes"] > 0))
    figures = [
        _density(trainer, delta),
        _payload(trainer, delta, anchored, lora),
        _staleness_seconds(series["replicas"]),
        _info_figure(trainer, "Staleness of trained rollouts (steps)", "versions behind", "staleness_steps"),
        _reward(trainer),
        _rollouts(trainer),
        _tokens(trainer),
        _trainer_time(trainer, published),
    ]
    steps = [trainer["step"], *(np.asarray(r["step"]) for r in series["replicas"].values())]
    axis = step_axis(np.concatenate(steps))
    for figure in figures:
        if figure.data:
            figure.update_xaxes(**axis)
    return figures


def step_axis(steps: np.ndarray) -> dict[str, Any]:
    """The x-axis all plots share, so that a step sits at the same place in each: the run's steps, whole
    numbers only, about ten ticks (1-2-5 spacing)."""
    lo, hi = (int(steps.min()), int(steps.max())) if len(steps) else (0, 1)
    spacing = next(d for d in _one_two_five(1) if (hi - lo) / d <= 10)
    return dict(range=[lo - 0.5, hi + 0.5], tick0=0, dtick=spacing, tickformat="d")


def _one_two_five(start: float, mantissas: tuple[float, ...] = (1, 2, 5)) -> Any:
    """start, 2 start, 5 start, 10 start, 20 start, ... for ever (or other `mantissas` of each decade)."""
    decade = start
    while True:
        yield from (m * decade for m in mantissas)
        decade *= 10


def byte_ticks(values: np.ndarray) -> dict[str, Any]:
    """A log axis for byte counts with labels one can read off: 1, 2 and 5 of each decade the values span
    (finer within less than a decade, only each decade's 1 past four decades), in B, kB, MB, GB."""
    positive = values[values > 0]
    if not len(positive):
        return {}
    lo, hi = float(positive.min()) / 1.5, float(positive.max()) * 1.5
    for mantissas in ((1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [v for v in _ticks_between(lo, hi, mantissas) if lo <= v <= hi]
        if len(ticks) >= 4:
            break
    if math.log10(hi / lo) > 4:
        ticks = [v for v in ticks if f"{v:e}".startswith("1")]
    labels = [format_bytes(v).replace(".0 ", " ") for v in ticks]
    return dict(type="log", tickvals=ticks, ticktext=labels, range=[math.log10(lo), math.log10(hi)])


def _ticks_between(lo: float, hi: float, mantissas: tuple[float, ...]) -> list[float]:
    ticks = []
    for v in _one_two_five(10 ** math.floor(math.log10(lo)), mantissas):
        if v > hi:
            return ticks
        ticks.append(v)
    return ticks


def _figure(title: str, y_title: str, traces: list[go.Scatter], empty: str = "no data yet") -> go.Figure:
    fig = go.Figure([t for t in traces if len(t.x)])
    fig.update_layout(
        title=dict(text=title, font_size=15),
        height=340,
        margin=dict(l=60, r=20, t=40, b=70),
        legend=dict(orientation="h", y=-0.22, x=0, yanchor="top"),
        hovermode="closest",
        uirevision="keep",  # keep the viewer's zoom across refreshes
        xaxis=dict(title="step", automargin=False),
        yaxis=dict(title=y_title, automargin=False),
    )
    if not fig.data:
        fig.add_annotation(text=empty, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
    return fig


def _line(name: str, x: np.ndarray, y: np.ndarray, **kwargs: Any) -> go.Scatter:
    return go.Scatter(name=name, x=x, y=y, mode="lines", **kwargs)


def _density(trainer: dict[str, np.ndarray], delta: np.ndarray) -> go.Figure:
    percent = trainer["density"][delta] * 100
    trace = _line("changed", trainer["step"][delta], percent, hovertemplate="%{y:.3f}%<extra></extra>")
    return _figure("Changed bf16 elements per delta", "% of elements", [trace])


def _payload(
    trainer: dict[str, np.ndarray], delta: np.ndarray, anchored: np.ndarray, lora: dict | None
) -> go.Figure:
    """Each step's delta and each anchor at its own size (a step may upload both), beside the full model."""
    what = "Payload per adapter version" if lora else "Payload per step"
    if not (delta | anchored).any():
        return _figure(what, "bytes (log)", [])
    steps, payload, full = trainer["step"], trainer["payload_bytes"], trainer["full_bytes"]
    # An older publisher's anchor step carried the anchor in payload_bytes and had no delta.
    anchor = np.where(trainer["anchor_bytes"] > 0, trainer["anchor_bytes"], payload)
    ratio = lambda part: np.divide(part, full, out=np.zeros(len(full)), where=full > 0) * 100  # noqa: E731
    published = delta | anchored
    hover = "%{y:.3s}B (%{customdata:.3f}% of full)<extra></extra>"
    traces = [
        _line("delta", steps[delta], payload[delta], customdata=ratio(payload)[delta], hovertemplate=hover),
        go.Scatter(
            name="anchor",
            x=steps[anchored],
            y=anchor[anchored],
            mode="markers",
            marker_symbol="diamond",
            customdata=ratio(anchor)[anchored],
            hovertemplate=hover,
        ),
        _line(
            "full bf16",
            steps[published],
            full[published],
            line_dash="dash",
            hovertemplate="%{y:.3s}B<extra></extra>",
        ),
    ]
    shown = [payload[delta], anchor[anchored], full[published]]
    merged_steps, merged = _info({k: v[published] for k, v in trainer.items()}, "merged_payload_bytes")
    if len(merged_steps):  # a LoRA run's trainer measured what the merged path would have published
        hover = "%{y:.3s}B<extra>merged path</extra>"
        traces.append(
            _line("merged path (measured)", merged_steps, merged, line_dash="dot", hovertemplate=hover)
        )
        shown.append(merged)
    median = (
        f"median delta {np.median(ratio(payload)[delta]):.3g}% of full" if delta.any() else "no deltas yet"
    )
    fig = _figure(f"{what} ({median})", "bytes (log)", traces)
    if lora:
        fig.update_xaxes(title=f"step (= adapter version {lora['name']}-v<step>)")
    fig.update_yaxes(**byte_ticks(np.concatenate(shown).astype(float)))
    return fig


def _staleness_seconds(replicas: dict[str, dict[str, list]]) -> go.Figure:
    traces, refused_x, refused_y = [], [], []
    for name, columns in replicas.items():
        step, lag, verified = (np.asarray(columns[k]) for k in ("step", "lag_s", "verified"))
        verified = verified.astype(bool)
        traces.append(_line(name, step[verified], lag[verified], hovertemplate="%{y:.2f} s<extra></extra>"))
        refused_x += step[~verified].tolist()
        refused_y += lag[~verified].tolist()
    traces.append(
        go.Scatter(
            name="refused",
            x=refused_x,
            y=refused_y,
            mode="markers",
            marker=dict(symbol="x", size=10, color="crimson"),
            hovertemplate="refused after %{y:.2f} s<extra></extra>",
        )
    )
    return _figure("Staleness: publish to verified apply (s)", "seconds", traces)


def _info_figure(trainer: dict[str, np.ndarray], title: str, y_title: str, prefix: str) -> go.Figure:
    """The trainer's own numbers info[<prefix>_mean] and info[<prefix>_max], where it reported them."""
    traces = [
        _line(stat, *_info(trainer, f"{prefix}_{stat}"), line_dash=dash)
        for stat, dash in (("mean", "solid"), ("max", "dot"))
    ]
    empty = f"the trainer reports no {prefix}_mean" if len(trainer["step"]) else "no data yet"
    return _figure(title, y_title, traces, empty)


def _info(trainer: dict[str, np.ndarray], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and float values of info[key] where the trainer reported it."""
    values = trainer.get(f"info.{key}")
    if values is None:
        return np.zeros(0), np.zeros(0)
    known = values != None  # noqa: E711 (element-wise on an object array)
    return trainer["step"][known], values[known].astype(float)


def _reward(trainer: dict[str, np.ndarray]) -> go.Figure:
    steps, reward = _info(trainer, "reward_mean")
    # trailing mean over the last REWARD_WINDOW reported steps (fewer at the start)
    sums = np.convolve(reward, np.ones(REWARD_WINDOW))[: len(reward)] if len(reward) else reward
    rolling = sums / np.minimum(np.arange(1, len(reward) + 1), REWARD_WINDOW)
    traces = [
        go.Scatter(name="mean per step", x=steps, y=reward, mode="lines", line=dict(width=1), opacity=0.5),
        _line(f"rolling mean of {REWARD_WINDOW} steps", steps, rolling, line=dict(width=3)),
    ]
    empty = "the trainer reports no reward_mean" if len(trainer["step"]) else "no data yet"
    return _figure("Reward", "reward", traces, empty)


def _rollouts(trainer: dict[str, np.ndarray]) -> go.Figure:
    """Of the rollouts generated so far, the share trained and the share dropped as too stale."""
    steps, generated = _info(trainer, "rollouts_generated")
    total = np.maximum(np.cumsum(generated), 1)
    traces = []
    for key, name in (("rollouts_trained", "trained"), ("rollouts_dropped", "dropped as stale")):
        used_steps, used = _info(trainer, key)
        if len(steps) and np.array_equal(used_steps, steps):  # the trainer reports the three together
            share = np.cumsum(used) / total * 100
            traces.append(_line(name, steps, share, hovertemplate="%{y:.1f}%<extra></extra>"))
    empty = "the trainer reports no rollouts_generated" if len(trainer["step"]) else "no data yet"
    return _figure("Generated rollouts used (cumulative)", "% of generated", traces, empty)


def _tokens(trainer: dict[str, np.ndarray]) -> go.Figure:
    traces = [_line(name, *_info(trainer, f"tokens_{name}")) for name in ("generated", "trained")]
    empty = "the trainer reports no tokens_generated" if len(trainer["step"]) else "no data yet"
    return _figure("Tokens per step", "tokens", traces, empty)


def _trainer_time(trainer: dict[str, np.ndarray], published: np.ndarray) -> go.Figure:
    steps = trainer["step"]
    columns = [
        ("blocked (training loop waited)", steps, trainer["blocked_s"]),
        ("encode", steps[published], trainer["encode_s"][published]),
        ("upload", steps[published], trainer["upload_s"][published]),
    ]
    fig = _figure("Trainer time per step (s)", "seconds", [_line(*column) for column in columns])
    clip_outliers(fig, [(x, y) for _, x, y in columns])
    return fig


def clip_outliers(fig: go.Figure, columns: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """End the y-axis at OUTLIER_HEADROOM x the OUTLIER_QUANTILE-th percentile when a few points (a slow first
    step: compiling, a cold cache) would flatten the rest; those points sit on the top edge as triangles that
    show their value."""
    values = np.concatenate([y for _, y in columns]).astype(float) if columns else np.zeros(0)
    if not len(values):
        return
    top = float(np.percentile(values, OUTLIER_QUANTILE)) * OUTLIER_HEADROOM
    if top <= 0 or values.max() <= top:
        return
    x = np.concatenate([x[y > top] for x, y in columns])
    y = np.concatenate([y[y > top] for _, y in columns])
    fig.add_trace(
        go.Scatter(
            name=f"above {top:.3g} s (clipped)",
            x=x,
            y=np.full(len(y), top),
            customdata=y,
            mode="markers",
            marker=dict(symbol="triangle-up", size=10, color="crimson"),
            cliponaxis=False,
            hovertemplate="%{customdata:.3g} s<extra>clipped</extra>",
        )
    )
    fig.update_yaxes(range=[0, top])


# ------------------------------------------------------------------------------------------- text views


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "–"
    if abs(s) < 1:
        return f"{s * 1000:.0f} ms"
    if abs(s) < 120:
        return f"{s:.1f} s"
    return f"{s / 60:.1f} min" if abs(s) < 7200 else f"{s / 3600:.1f} h"


def headline_html(summary: dict[str, Any]) -> str:
    """Cards with the headline numbers; each carries its raw value in data-value for scripts and tests."""
    if "steps" not in summary:
        return ""
    mean, full = summary["mean_delta_payload_bytes"], summary["full_bytes"]
    ratio = mean / full if mean is not None and full else None
    saved = summary["saved_fraction"]
    cards = [
        (
            "steps",
            "Steps published",
            summary["steps"],
            summary["steps"],
            f"latest {summary['latest_step']}, {summary['anchors']} anchors, "
            f"{summary['skipped_steps']} folded into later ones"
            if summary["steps"]
            else "none yet",
        ),
        (
            "mean-payload",
            "Mean delta payload",
            mean,
            format_bytes(mean),
            f"{ratio * 100:.3f}% of the {format_bytes(full)} bf16 model" if ratio is not None else "",
        ),
        (
            "bytes-saved",
            "Bytes saved",
            summary["bytes_saved"],
            format_bytes(summary["bytes_saved"]),
            f"{saved * 100:.2f}% less than full uploads ({format_bytes(summary['uploaded_bytes'])} uploaded, "
            "anchors included)"
            if saved is not None
            else "",
        ),
        (
            "median-latency",
            "Median sync latency",
            summary["median_sync_latency_s"],
            fmt_seconds(summary["median_sync_latency_s"]),
            f"publish to verified apply, {summary['verified_applies']} applies",
        ),
    ]
    adapters = summary.get("adapters")
    if adapters:
        cards = cards[:1] + adapter_cards(summary, adapters) + cards[2:]
    return (
        '<div class="cards">'
        + "".join(
            f'<div class="card" data-key="{key}" data-value="{"" if raw is None else raw}">'
            f'<div class="label">{label}</div><div class="value">{html.escape(str(shown))}</div>'
            f'<div class="note">{html.escape(note)}</div></div>'
            for key, label, raw, shown, note in cards
        )
        + "</div>"
    )


def adapter_cards(summary: dict[str, Any], adapters: dict[str, Any]) -> list[tuple[str, str, Any, str, str]]:
    """A LoRA root's cards, in place of the mean delta payload: its adapter versions, what one version costs
    to publish (its upload: a delta, or an anchor of the whole adapter), and the merged path's per version."""
    versions = adapters["versions"]
    adapter, merged = adapters["mean_adapter_payload_bytes"], adapters["mean_merged_payload_bytes"]
    per_version = summary["uploaded_bytes"] / summary["steps"] if summary["steps"] else None
    span = f"{versions[0]['version']} .. {versions[-1]['version']}" if versions else "none yet"
    rank = adapters["lora"]["rank"]
    return [
        (
            "adapter-versions",
            "Adapter versions",
            len(versions),
            len(versions),
            f"{span}, LoRA rank {rank if rank is not None else 'not given'}",
        ),
        (
            "version-cost",
            "Per-version cost",
            per_version,
            format_bytes(per_version),
            "mean upload per version (deltas and anchors); the whole adapter is "
            + format_bytes(summary["full_bytes"]),
        ),
        (
            "merged-payload",
            "Merged path per version",
            merged,
            format_bytes(merged),
            f"{merged / max(adapter, 1):.1f}x the adapter's {format_bytes(adapter)} per version "
            "(the same versions, measured by the trainer)"
            if merged is not None and adapter is not None
            else "the trainer did not measure it (--measure_merged)",
        ),
    ]


def density_markdown(summary: dict[str, Any]) -> str:
    """One note beside the density plot when the run changes far more of its weights per step than RL runs of
    real models do (a tiny demo model at a high learning rate), so that nobody reads it as the product's
    regime; empty otherwise."""
    density, numel = summary.get("mean_delta_density"), summary.get("numel")
    if density is None or density <= DENSE:
        return ""
    return (
        f"**Why {density * 100:.0f}% of the elements change per step here:** this model "
        f"({numel / 1e6:.1f}M parameters) trains at a learning rate far above RL's, so most updates move a "
        "weight by more than half a bf16 step. RL runs of real models change a few % per step: 0.6-2.5% on "
        "all-MiniLM-L6-v2 at AdamW lr 1e-6 to 3e-6, 1.3% on Qwen3-1.7B at lr 2.5e-7 (docs/benchmarks.md)."
    )


def status_markdown(summary: dict[str, Any], refresh_s: float) -> str:
    """One line on the state of the run: unreadable root, no run yet, stopped replicas, or live."""
    root = f"`{summary['root']}`"
    if summary["error"]:
        shown = f" Showing the last data read ({summary['steps']} steps)." if summary.get("steps") else ""
        error = markdown_text(summary["error"])
        return f"⚠ **Cannot read the sync root.** {error}.{shown} Retrying every {refresh_s:g} s."
    if summary["read_at"] is None:
        return f"Reading {root} for the first time…"
    lines = []
    if not summary["steps"] and not summary["replicas"]:
        lines.append(f"**No run yet** at {root}: no telemetry records. This page updates by itself.")
    elif summary["finished"]:
        cadence = summary["step_interval_s"]
        lines.append(
            f"**Finished** at {root}: latest step {summary['latest_step']}, no new step for "
            f"{fmt_seconds(summary['trainer_silent_s'])}"
            + (f" (steps came every {fmt_seconds(cadence)})." if cadence is not None else ".")
        )
    else:
        lines.append(f"**Live** at {root}: latest step {summary['latest_step']}.")
    if summary["read_at"]:
        lines[-1] += f" Read {fmt_seconds(max(0.0, time.time() - summary['read_at']))} ago."
    lines += run_lines(summary.get("run"))
    for name, refused in summary.get("head_refusals", {}).items():
        lines.append(
            f"⚠ Replica **{markdown_text(name)}** refused {refused['count']} head"
            f"{'s' if refused['count'] > 1 else ''} for their signature (serving its last good step); the "
            f"last at {_clock(refused['last_at'])}: {markdown_text(refused['last_error'] or '')}"
        )
    for row in summary["replicas"]:
        if row["status"] == "stopped reporting":
            lines.append(
                f"⚠ Replica **{markdown_text(row['replica'])}** stopped reporting "
                f"{fmt_seconds(row['silent_s'])} ago "
                f"(holds step {row['step']}, {row['behind_steps']} behind)."
            )
    adapters = summary.get("adapters")
    for name, held in (adapters["versions_held"] if adapters else {}).items():
        lines.append(
            f"Replica **{markdown_text(name)}** holds {len(held)} adapter versions: steps "
            f"{format_steps(held)}" + "."  # numbers of our own: nothing to escape
        )
    if summary.get("rate_limited_until"):
        lines.append(
            f"⚠ **Rate limited** by the Hub until {_clock(summary['rate_limited_until'])}: "
            "this page shows the last data read until then."
        )
    for row in summary["replicas"]:
        until = row.get("rate_limited_until")
        if until is not None and time.time() - until < RATE_LIMIT_SHOWN_S:
            lines.append(
                f"⚠ Replica **{markdown_text(row['replica'])}** was rate limited until {_clock(until)} "
                f"(its step {row['step']} waited for it)."
            )
    if summary["unread_records"]:
        lines.append(
            f"Reading the run's history, newest first: {summary['unread_records']} records to go "
            "(within POLL_BUDGET requests per 5 minutes); the numbers above lack them until then."
        )
    if summary["problem_count"]:
        lines.append(f"⚠ {summary['problem_count']} invalid telemetry files skipped (listed below).")
    if summary["unread"]:
        lines.append(f"⚠ {summary['unread']} telemetry files could not be read this time; retrying.")
    return "\n\n".join(lines)


def run_lines(run: dict[str, Any] | None) -> list[str]:
    """What run.json says of the whole run (run_summary), one line per field shown, under the status line:
    the recipe a quantized root's replicas serve, and whether it is signed and by which key. Nothing before
    run.json is read."""
    if not run:
        return []
    lines = []
    key = markdown_text(short(run["signed_by"])) if run["signed_by"] else None
    if key and run["signature_error"]:
        error = markdown_text(run["signature_error"])
        lines.append(
            f"⚠ run.json names the key **{key}**, but its signature does not hold ({error}): replicas "
            "trusting that key refuse this root."
        )
    elif key:
        setting = markdown_text("(TRUSTED_KEYS, --trusted-key)")
        lines.append(
            f"Signed by **{key}**: replicas given this key {setting} apply only the steps it signed."
        )
    else:
        setting = markdown_text("(the trainer's --signing_key)")
        lines.append(f"Unsigned: replicas trust whoever can write this bucket {setting}.")
    if run["quantization"]:
        lines.append(
            f"Replicas serve **{markdown_text(run['quantization'])}** (a quantized root): at every step the "
            "codes and scales of the trainer's bf16 weights quantized as vLLM does, checked by fingerprint."
        )
    return lines


def replicas_frame(summary: dict[str, Any]) -> pd.DataFrame:
    now = time.time()
    rows = [
        [
            r["replica"],
            r["status"],
            _or_blank(r["step"]),
            _or_blank(r["behind_steps"]),
            fmt_seconds(r["last_lag_s"]),
            _when(r["last_applied_at"], now),
            r["applied"],
            r["refused"],
            r["last_error"] or "",
        ]
        for r in summary.get("replicas", [])
    ]
    return pd.DataFrame(rows, columns=REPLICA_COLUMNS)


def _or_blank(value: Any) -> Any:
    return "" if value is None else value


def _clock(t: float) -> str:
    return f"{datetime.fromtimestamp(t, UTC):%H:%M:%S} UTC"


def _when(t: float | None, now: float) -> str:
    if t is None:
        return "never"
    return f"{datetime.fromtimestamp(t, UTC):%H:%M:%S} UTC ({fmt_seconds(max(0.0, now - t))} ago)"


def problems_markdown(problems: dict[str, str]) -> str:
    if not problems:
        return "None."
    shown = list(problems.items())[-SHOWN_PROBLEMS:]
    more = f"\n\n…and {len(problems) - len(shown)} more." if len(problems) > len(shown) else ""
    return "\n".join(f"- {markdown_text(path)}: {markdown_text(why)}" for path, why in shown) + more


def markdown_text(text: str) -> str:
    """`text` shown as it is in Markdown (file names and errors come from the sync root, which whoever can
    write there shapes): control characters as escapes, all ASCII punctuation escaped, so no Markdown, HTML,
    link or formula can start."""
    printable = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return ASCII_PUNCTUATION.sub(r"\\\1", printable)


# ---------------------------------------------------------------------------------------------------- app


def update(board: Board, shown: int, refresh_s: float) -> list:
    """One tick for a page that shows data version `shown`: poll, redraw the text views (they age), and send
    the figures only if the data changed: [version, status, headline, density note, replicas, problems,
    *figures]."""
    version = board.refresh()
    summary = board.summary()
    figures = board.figures() if version != shown else [gr.skip()] * len(PLOTS)
    texts = [
        status_markdown(summary, refresh_s),
        headline_html(summary),
        density_markdown(summary),
        replicas_frame(summary),
        problems_markdown(board.problems()),
    ]
    return [version, *texts, *figures]


def build_app(
    root: str, refresh_s: float = 2.0, stale_after_s: float = 120.0, poll_budget: int = POLL_BUDGET
) -> FastAPI:
    """The JSON API and the Gradio UI (mounted at "/") over one Board."""
    board = Board(root, stale_after_s, refresh_s / 2, poll_budget, wait_s=REQUEST_WAIT_S)
    api = FastAPI(title="deltasync dashboard")
    api.add_middleware(BodyLimit, max_bytes=MAX_REQUEST_BYTES)

    @api.get("/api/summary")
    def summary() -> JSONResponse:
        """Headline numbers, one row per replica, and the error state (503 while the root is unreadable)."""
        board.refresh()
        body = board.summary()
        return JSONResponse(body, status_code=503 if body["error"] else 200)

    @api.get("/api/series")
    def series(since: int = -1) -> JSONResponse:
        """Per-step columns of the records with step > since."""
        board.refresh()
        if board.error:
            return JSONResponse({"error": board.error, **board.series(since)}, status_code=503)
        return JSONResponse(board.series(since))

    with gr.Blocks(title="deltasync dashboard", analytics_enabled=False) as demo:
        gr.Markdown("# deltasync: sync health")
        status = gr.Markdown(elem_id="status")
        headline = gr.HTML(elem_id="headline")
        density_note = gr.Markdown(elem_id="density-note")
        plots = []
        for left, right in zip(PLOTS[::2], PLOTS[1::2], strict=True):
            with gr.Row():
                plots += [gr.Plot(elem_id=left, show_label=False), gr.Plot(elem_id=right, show_label=False)]
        replicas = gr.Dataframe(
            headers=REPLICA_COLUMNS,
            label="Replicas",
            interactive=False,
            wrap=True,
            column_widths=["7%", "11%", "5%", "6%", "7%", "18%", "7%", "7%", "32%"],
            elem_id="replicas",
        )
        with gr.Accordion("Skipped telemetry files", open=False):
            problems = gr.Markdown(elem_id="problems")
        shown_version = gr.State(-1)
        timer = gr.Timer(refresh_s)

        outputs = [shown_version, status, headline, density_note, replicas, problems, *plots]
        for event in (demo.load, timer.tick):
            event(
                lambda shown: update(board, shown, refresh_s),
                shown_version,
                outputs,
                show_progress="hidden",
                api_visibility="private",
                concurrency_limit=None,  # viewers do not queue behind each other (Board serialises polls)
            )

    return gr.mount_gradio_app(api, demo, path="/", css=CSS)


class Settings(BaseSettings):
    """The Space's configuration, from the environment variables of the same names in upper case."""

    sync_root: str = ""  # unset: the page says so instead of failing
    host: str = "0.0.0.0"
    port: int = 7860
    refresh_s: float = 2.0
    stale_after_s: float = 120.0
    poll_budget: int = POLL_BUDGET


def main() -> None:
    cfg = from_env(Settings)
    # The Hub client logs each of its retries; the board says once that the root cannot be read.
    logging.getLogger("huggingface_hub.utils._http").setLevel(logging.ERROR)
    app = build_app(cfg.sync_root, cfg.refresh_s, cfg.stale_after_s, cfg.poll_budget)
    serve(app, "deltasync dashboard", cfg.host, cfg.port, log_level="warning")


if __name__ == "__main__":
    main()
