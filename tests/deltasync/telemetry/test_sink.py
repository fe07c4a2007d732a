"""A replica's telemetry within its request budget: several steps per write, the oldest waiting at most
`max_delay_s`, refusals at once; the reader takes every step back out of the batches."""

import dataclasses

from deltasync.storage import HubBucketStorage, LocalStorage
from deltasync.storage.budget import Budget
from deltasync.telemetry import ReplicaRecord, write
from deltasync.telemetry.reader import TelemetryReader
from deltasync.telemetry.sink import batch_json, batch_path, sink_for
from tests.deltasync.storage.test_hub import Clock, eventually, follow


def record(step: int, replica: str = "r0", **changes) -> ReplicaRecord:
    r = ReplicaRecord(
        replica=replica,
        step=step,
        kind="delta",
        published_at=1_700_000_000.0 + step,
        applied_at=1_700_000_000.5 + step,
        download_s=0.1,
        apply_s=0.1,
        verified=True,
        lag_steps=0,
    )
    return dataclasses.replace(r, **changes)


def test_records_wait_for_one_write_of_several_steps_and_a_refusal_goes_at_once(fake_hub):
    fake_hub.clock = clock = Clock()
    HubBucketStorage("user/sync", follow=False).write_bytes("run.json", b"{}")
    storage = HubBucketStorage("user/sync", budget=Budget(api=5, resolvers=50), clock=clock)
    sink = sink_for(storage)
    assert sink.max_delay_s == 300 / 4  # the budget's API calls less the replica's overhead, over a window
    fake_hub.requests.clear()
    for step in range(1, 6):
        write(storage, record(step))
        clock.advance(10)
    assert fake_hub.requests == []  # 40 s: nothing due yet
    clock.advance(sink.max_delay_s - 40)
    sink.flush_due()
    batches = lambda: [r for r in fake_hub.requests if r.endswith("/batch")]  # noqa: E731
    assert batches() == ["POST /api/buckets/user/sync/batch"]  # five steps, one call (and, once, a token)
    write(storage, record(6, verified=False, error="bad file"))
    assert len(batches()) == 2  # a refusal: at once

    dashboard = HubBucketStorage("user/sync", clock=clock)
    follow(dashboard)
    reader = TelemetryReader(dashboard)

    def polled_all() -> bool:
        reader.poll()
        return 6 in reader.replicas.get("r0", {}) and 1 in reader.replicas["r0"]

    eventually(polled_all)
    assert sorted(reader.replicas["r0"]) == [1, 2, 3, 4, 5, 6]
    assert reader.replicas["r0"][6].error == "bad file"
    assert reader.problems == {}


def test_without_a_budget_each_record_is_written_at_once(tmp_path):
    storage = LocalStorage(tmp_path)
    write(storage, record(1))
    assert storage.list("telemetry") == ["telemetry/replicas/r0/step-00000001.json"]


def test_a_batch_holding_another_writers_record_is_skipped_and_named(tmp_path):
    storage = LocalStorage(tmp_path)
    good = [record(1), record(2)]
    storage.write_bytes(batch_path("r0", good), batch_json(good))
    stray = [record(3), record(4, replica="r1")]
    storage.write_bytes(batch_path("r0", stray), batch_json(stray))
    outside = [record(9)]
    storage.write_bytes("telemetry/replicas/r0/steps-00000005-00000006.json", batch_json(outside))
    storage.write_bytes("telemetry/replicas/r0/steps-00000007-00000008.json", b'{"not": "a list"}')
    reader = TelemetryReader(storage)
    reader.poll()
    assert sorted(reader.replicas["r0"]) == [1, 2]
    assert sorted(reader.problems) == [
        "telemetry/replicas/r0/steps-00000003-00000004.json",
        "telemetry/replicas/r0/steps-00000005-00000006.json",
        "telemetry/replicas/r0/steps-00000007-00000008.json",
    ]
