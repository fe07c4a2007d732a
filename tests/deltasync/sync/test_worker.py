"""The publisher's background worker: whatever stops it reaches the caller, a closed publisher takes no step,
and nothing is acknowledged that a reader would refuse."""

import json
import uuid

import pytest
import torch

from deltasync.storage import LocalStorage, open_storage
from deltasync.sync.protocol import HEAD_PATH, MAX_MANIFEST_BYTES, RUN_PATH, delta_paths, read_head
from deltasync.sync.publisher import Publisher, PublisherConfig, StoredDelta
from deltasync.sync.subscriber import Subscriber, SyncError
from tests.helpers import make_params, run_steps, wait_for


def test_a_tensor_named_like_the_safetensors_header_is_refused_before_writing(tmp_path):
    """A tensor `__metadata__` would make every file holding it unreadable (a duplicate header field)."""
    params = {**make_params(), "__metadata__": torch.ones(3)}
    with Publisher(tmp_path, "tiny") as publisher:
        with pytest.raises(ValueError, match="'__metadata__'.*reserved by safetensors"):
            publisher.publish(params, step=0)
        publisher.publish(make_params(), step=0)  # the publisher still works
    assert read_head(LocalStorage(tmp_path)).step == 0
    reader = Subscriber(tmp_path)
    reader.sync()
    assert reader.step == 0


def test_a_stored_delta_with_parts_out_of_order_is_refused_before_its_head(tmp_path):
    run_steps(tmp_path, 1)
    with Publisher(tmp_path, "tiny") as publisher:
        paths = delta_paths(1, 2, publisher.claim.tag)
        for path in paths:
            publisher.storage.write_bytes(path, b"part")
        swapped = StoredDelta((paths[1], paths[0]), 8, 1, 0)
        with pytest.raises(ValueError, match="not where this writer's delta of step 1 lives"):
            publisher.publish_stored(swapped, 1)
        publisher.flush()
    assert read_head(LocalStorage(tmp_path)).step == 0  # the root still reads and takes the next step
    with Publisher(tmp_path, "tiny") as publisher:
        publisher.publish(make_params(1), step=1)
    reader = Subscriber(tmp_path)
    reader.sync()
    assert reader.step == 1


def test_an_idle_lease_renewal_that_fails_reaches_the_caller():
    """A head over the manifest limit met by the idle lease renewal stops the worker: the next publish()
    raises the cause, and flush() and close() return instead of waiting for a thread that is gone."""
    url = f"memory://idle-{uuid.uuid4().hex}"
    publisher = Publisher(url, "tiny", PublisherConfig(lease_s=0.4))
    publisher.publish(make_params(), step=0)
    publisher.flush()
    open_storage(url).write_bytes(HEAD_PATH, b" " * (MAX_MANIFEST_BYTES + 1))
    wait_for(lambda: publisher._worker.error is not None, "the idle renewal to meet the head")
    with pytest.raises(RuntimeError, match="more than"):
        publisher.publish(make_params(), step=1)
    with pytest.raises(RuntimeError, match="more than"):
        publisher.flush(timeout=60)
    with pytest.raises(RuntimeError, match="more than"):
        publisher.close(timeout=60)


def test_a_closed_publisher_takes_no_step(tmp_path):
    publisher = Publisher(tmp_path, "tiny")
    publisher.publish(make_params(), step=0)
    publisher.close()
    with pytest.raises(RuntimeError, match="closed"):
        publisher.publish(make_params(), step=1)
    publisher.flush(timeout=60)  # returns: nothing is pending
    assert read_head(LocalStorage(tmp_path)).step == 0


def test_a_worker_that_raises_while_idle_stops_and_says_why():
    from deltasync.sync.worker import Worker

    def idle():
        raise KeyError("boom")

    worker: Worker[int] = Worker("test-worker", "the test worker", lambda job: None, idle=idle, idle_s=0.01)
    wait_for(lambda: worker.error is not None, "the idle call")
    with pytest.raises(RuntimeError, match="the test worker failed: 'boom'"):
        worker.submit(lambda _: 1)
    with pytest.raises(RuntimeError, match="boom"):
        worker.close(timeout=60)


def test_run_json_records_the_weight_dtype_and_readers_refuse_another(tmp_path):
    run_steps(tmp_path, 1)
    run = json.loads((tmp_path / RUN_PATH).read_bytes())
    assert run["dtype"] == "bf16"
    (tmp_path / RUN_PATH).write_text(json.dumps(run | {"dtype": "f8_e4m3"}))
    with pytest.raises(SyncError, match="run.json: weights are 'f8_e4m3'; this reader handles bf16 only"):
        Subscriber(tmp_path).sync()
