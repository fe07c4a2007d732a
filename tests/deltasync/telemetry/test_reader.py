"""Hostile telemetry files against the dashboard: each is skipped and named, every other step stays plotted,
no poll blocks, and the app still stops on SIGTERM (the reader, the in-process Board, `python app.py`)."""

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
from pathlib import Path

import pytest
import requests
import torch

from deltasync.storage import open_storage
from deltasync.sync.publisher import Publisher
from deltasync.telemetry import MAX_INFO_KEYS, MAX_RECORD_BYTES, ReplicaRecord, TrainerRecord, write
from deltasync.telemetry.reader import SERIES_REPLICAS, TelemetryReader
from tests.helpers import REPO, post_with_length
from trainer.processes import free_port, start_process, stop_process, wait_healthy

APP = REPO / "spaces" / "dashboard" / "app.py"
GOOD_STEPS = range(10)
T0 = 1_700_000_000.0
HUGE = "1" + "0" * 400  # an integer no float can hold
DIGITS = "9" * 5000  # over Python's 4300-digit limit for int(str)
DEEP = "[" * 30_000 + "]" * 30_000  # 60 KB: under the size limit, far past the parser's recursion limit
MANY_KEYS = json.dumps({f"k{i}": 0.5 for i in range(3000)})  # 36 KB: under the size limit


def trainer(step: int) -> TrainerRecord:
    return TrainerRecord(
        step=step,
        kind="anchor" if step == 0 else "delta",
        published_at=T0 + step,
        numel=1000,
        changed=1000 if step == 0 else 10,
        payload_bytes=2000 if step == 0 else 30,
        full_bytes=2000,
        encode_s=0.1,
        upload_s=0.2,
        blocked_s=0.01,
        base_step=step - 1 if step else None,
        info={"reward_mean": 0.5},
    )


def replica(step: int) -> ReplicaRecord:
    return ReplicaRecord(
        replica="r0",
        step=step,
        kind="anchor" if step == 0 else "delta",
        published_at=T0 + step,
        applied_at=T0 + step + 0.5,
        download_s=0.1,
        apply_s=0.1,
        verified=True,
        lag_steps=0,
    )


def with_raw(record: TrainerRecord | ReplicaRecord, **raw: str) -> bytes:
    """`record` as JSON with the named fields' values replaced by raw JSON text."""
    fields = {k: json.dumps(v) for k, v in dataclasses.asdict(record).items()} | raw
    return ("{" + ",".join(f'"{k}":{v}' for k, v in fields.items()) + "}").encode()


BAD = {
    "float-field-too-large-for-a-float": (trainer(10).path(), with_raw(trainer(10), published_at=HUGE)),
    "int-over-4300-digits": (trainer(11).path(), with_raw(trainer(11), payload_bytes=DIGITS)),
    "deep-nesting": (trainer(12).path(), DEEP.encode()),
    "trainer-number-too-large-for-a-float": (
        trainer(13).path(),
        with_raw(trainer(13), info=f'{{"reward_mean": {HUGE}}}'),
    ),
    "replica-time-too-large-for-a-float": (replica(10).path(), with_raw(replica(10), applied_at=HUGE)),
    "replica-time-in-the-year-3-billion": (replica(11).path(), with_raw(replica(11), applied_at="1e17")),
    "replica-time-before-1970": (replica(12).path(), with_raw(replica(12), applied_at="-1e13")),
    "replica-time-nan": (replica(13).path(), with_raw(replica(13), applied_at="NaN")),
    "replica-time-infinite": (replica(14).path(), with_raw(replica(14), published_at="Infinity")),
    "trainer-time-in-the-year-3-billion": (trainer(14).path(), with_raw(trainer(14), published_at="1e17")),
    "trainer-info-with-3000-keys": (trainer(15).path(), with_raw(trainer(15), info=MANY_KEYS)),
    "trainer-info-with-an-empty-key": (trainer(16).path(), with_raw(trainer(16), info='{"": 1.0}')),
    "trainer-merged-payload-nan": (
        trainer(17).path(),
        with_raw(trainer(17), info='{"merged_payload_bytes": NaN}'),
    ),
    "trainer-step-a-bool": (trainer(18).path(), with_raw(trainer(18), step="true")),
    "trainer-anchor-bytes-negative": (trainer(19).path(), with_raw(trainer(19), anchor_bytes="-1")),
}


def write_good_run(storage) -> None:
    for step in GOOD_STEPS:
        write(storage, trainer(step))
        write(storage, replica(step))


def assert_only_bad_skipped(reader: TelemetryReader, bad_paths: set[str]) -> None:
    """Every good step is there, each bad file has one line naming it, and the views are strict JSON."""
    assert sorted(reader.trainer) == list(GOOD_STEPS)
    assert sorted(reader.replicas["r0"]) == list(GOOD_STEPS)
    assert set(reader.problems) == bad_paths
    assert all(path in why and "\n" not in why for path, why in reader.problems.items())
    summary = json.loads(json.dumps(reader.summary(T0 + 60), allow_nan=False))
    assert summary["steps"] == len(GOOD_STEPS) and summary["problem_count"] == len(bad_paths)
    assert {p for p in bad_paths if any(p in line for line in summary["problems"])} == bad_paths
    series = json.loads(json.dumps(reader.series(), allow_nan=False))
    assert series["trainer"]["step"] == list(GOOD_STEPS)


@pytest.fixture(params=["local", "memory", "hub"])
def storage(request, tmp_path):
    if request.param == "hub":
        request.getfixturevalue("fake_hub")
    url = {"local": str(tmp_path / "run"), "memory": f"memory://{tmp_path.name}", "hub": "hf://buckets/u/r"}
    return open_storage(url[request.param])


@pytest.mark.parametrize("case", BAD)
def test_one_malformed_record_is_skipped_and_named(storage, case):
    write_good_run(storage)
    path, data = BAD[case]
    storage.write_bytes(path, data)
    reader = TelemetryReader(storage)
    poll = reader.poll()
    assert list(poll.problems) == [path] and not poll.unread
    assert_only_bad_skipped(reader, {path})
    assert not reader.poll().problems  # reported once


def test_series_carry_the_info_keys_that_most_records_report(tmp_path):
    storage = open_storage(tmp_path)
    for step in range(200):  # each record: the run's key and 63 keys of its own
        record = trainer(step)
        record.info |= {f"step{step}.k{i}": 1.0 for i in range(MAX_INFO_KEYS - 1)}
        write(storage, record)
    reader = TelemetryReader(storage)
    reader.poll()
    assert not reader.problems and len(reader.trainer) == 200
    columns = [key for key in reader.series()["trainer"] if key.startswith("info.")]
    assert len(columns) == MAX_INFO_KEYS
    assert "info.reward_mean" in columns
    assert reader.series()["trainer"]["info.reward_mean"] == [0.5] * 200


def test_series_carry_the_replicas_that_reached_the_newest_steps(tmp_path):
    storage = open_storage(tmp_path)
    for i in range(SERIES_REPLICAS + 36):
        write(storage, dataclasses.replace(replica(i), replica=f"r{i:03d}"))
    reader = TelemetryReader(storage)
    reader.poll()
    assert len(reader.replicas) == SERIES_REPLICAS + 36
    assert list(reader.series()["replicas"]) == [f"r{i:03d}" for i in range(36, SERIES_REPLICAS + 36)]


@pytest.mark.parametrize(
    "info", [{f"k{i}": 1.0 for i in range(MAX_INFO_KEYS + 1)}, {"": 1.0}, {"k" * 129: 1.0}]
)
def test_the_publisher_refuses_info_that_readers_would_skip(tmp_path, info):
    with Publisher(tmp_path, model="tiny") as publisher:
        with pytest.raises(ValueError, match="publish\\(\\): info has"):
            publisher.publish({"w": torch.zeros(3)}, info=info)
        publisher.publish({"w": torch.zeros(3)}, info={f"k{i}": 1.0 for i in range(MAX_INFO_KEYS)})
        publisher.flush()
    reader = TelemetryReader(open_storage(tmp_path))
    reader.poll()
    assert not reader.problems and len(reader.trainer[0].info) == MAX_INFO_KEYS


def without_blocking(call, fifos: list[Path]):
    """call() in a thread; if it is still running after a minute (stuck opening a FIFO), open the FIFOs for
    writing until it returns, and fail."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=call()), daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        while thread.is_alive():  # it reads the FIFOs one after the other
            for fifo in fifos:
                with contextlib.suppress(OSError):  # ENXIO: no reader waits on this one
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the blocked open() now reads EOF
            thread.join(0.1)
        pytest.fail("blocked on a FIFO")
    return result["value"]


def hostile_folder(root: Path) -> tuple[set[str], list[Path]]:
    """A good run plus a FIFO under a trainer and a replica record's names and a record over the size limit;
    returns the bad paths and the FIFOs."""
    storage = open_storage(root)
    write_good_run(storage)
    fifos = [root / trainer(20).path(), root / replica(20).path()]
    for fifo in fifos:
        os.mkfifo(fifo)
    big = trainer(21).path()
    (root / big).write_bytes(b" " * MAX_RECORD_BYTES + b"{}")
    return {trainer(20).path(), replica(20).path(), big}, fifos


def test_fifos_and_oversized_files_are_skipped_without_opening_them(tmp_path):
    bad, fifos = hostile_folder(tmp_path)
    reader = TelemetryReader(open_storage(tmp_path))
    poll = without_blocking(reader.poll, fifos)
    assert set(poll.problems) == bad
    assert all("not a regular file" in poll.problems[str(f.relative_to(tmp_path))] for f in fifos)
    assert_only_bad_skipped(reader, bad)
    reader.listing_share = float("inf")  # the next poll probes the next step names (20 is a FIFO): no read
    assert not without_blocking(reader.poll, fifos).problems


# ------------------------------------------------------------------------------------------- the dashboard


def test_the_page_plots_every_good_step_and_lists_each_bad_file(dashboard, tmp_path):
    bad, fifos = hostile_folder(tmp_path)
    storage = open_storage(tmp_path)
    for path, data in BAD.values():
        storage.write_bytes(path, data)
        bad.add(path)
    board = dashboard.Board(str(tmp_path))
    without_blocking(board.refresh, fifos)
    version, status, _, _, _, problems, *figures = dashboard.update(board, -1, 2)
    assert board.error is None and version == 1
    assert f"**Finished** at `{tmp_path}`: latest step {GOOD_STEPS[-1]}" in status  # its records are old
    assert f"⚠ {len(bad)} invalid telemetry files skipped" in status
    assert all(dashboard.markdown_text(path) in problems for path in bad)
    density = figures[dashboard.PLOTS.index("density")]
    assert list(density.data[0].x) == list(GOOD_STEPS[1:])  # every delta plotted


def test_the_live_app_reports_bad_files_and_stops_on_sigterm(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    bad, _ = hostile_folder(root)
    storage = open_storage(root)
    for path, data in BAD.values():
        storage.write_bytes(path, data)
        bad.add(path)
    log = tmp_path / "dashboard.log"
    port = free_port()
    env = {**os.environ, "SYNC_ROOT": str(root), "HOST": "127.0.0.1", "PORT": str(port), "REFRESH_S": "1"}
    proc = start_process([sys.executable, str(APP)], log, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, f"{url}/api/summary", log, timeout=90)
        summary = requests.get(f"{url}/api/summary", timeout=30).json()
        assert summary["error"] is None and summary["steps"] == len(GOOD_STEPS)
        assert summary["problem_count"] == len(bad)
        assert {p for p in bad if any(p in line for line in summary["problems"])} == bad
        series = requests.get(f"{url}/api/series", timeout=30).json()
        assert series["trainer"]["step"] == list(GOOD_STEPS)
        assert series["replicas"]["r0"]["step"] == list(GOOD_STEPS)
        for length, status in [("abc", 400), ("-1", 400), (str(10 << 20), 413)]:
            assert post_with_length(url, "/gradio_api/queue/join", length) == status, length
        assert f"deltasync dashboard listening on 127.0.0.1:{port}" in log.read_text()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)  # TimeoutExpired if SIGTERM does not stop it
    finally:
        stop_process(proc, grace_s=0)
