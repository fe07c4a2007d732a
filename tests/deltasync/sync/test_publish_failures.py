"""A publish the publisher refuses, an upload that outlasts the lease, a root whose last delta is bad: the run
goes on, replicas get exactly the states the trainer handed over, and one writer still holds the root."""

import json
import logging
import time
import types
import uuid

import pytest
import torch

from deltasync import cli, telemetry
from deltasync.errors import SchemaError, Stopped
from deltasync.storage import FsspecStorage, WriterConflict, open_storage
from deltasync.sync import claim as claim_module
from deltasync.sync import protocol
from deltasync.sync.claim import WRITER_PATH
from deltasync.sync.publisher import Publisher, PublisherConfig
from deltasync.sync.subscriber import Subscriber, SyncError
from tests.deltasync.sync.test_single_writer import Stalling
from tests.helpers import bf16, bitwise_equal, delta_file, make_params, run_steps, train_step


def test_a_refused_state_leaves_the_pending_step_whole(tmp_path):
    params = make_params()
    storage = Stalling(tmp_path, step=1)  # step 1's head write waits: step 2 stays pending
    with Publisher(storage, model="tiny") as publisher:
        publisher.publish(params)
        publisher.flush()
        train_step(params, 1)
        publisher.publish(params)
        assert storage.reached.wait(60)
        train_step(params, 2)
        publisher.publish(params)  # pending: the worker is inside step 1
        handed = bf16(params)
        torn = make_params(seed=9)  # every tensor differs; the last one (in the order copied) is misshapen
        last = list(torn)[-1]
        torn[last] = torch.zeros(torn[last].shape[0] + 1)
        with pytest.raises(SchemaError, match=last):
            publisher.publish(torn)
        storage.release.set()
    reader = Subscriber(tmp_path)
    reader.sync()
    assert reader.step == 2 and bitwise_equal(reader.state, handed)


@pytest.mark.parametrize("value", [torch.tensor(0.5), True, "0.5", None, 2**64])
def test_info_values_are_checked_at_the_call(tmp_path, value):
    with Publisher(tmp_path, model="tiny") as publisher:
        with pytest.raises(ValueError, match="'reward_mean' is .* not a number"):
            publisher.publish(make_params(), info={"reward_mean": value})
        publisher.publish(make_params(), info={"reward_mean": 0.5, "reward_std": float("nan")})
        publisher.flush()  # the worker lives on
    record = telemetry.from_json(
        telemetry.TrainerRecord, (tmp_path / "telemetry/trainer/step-00000000.json").read_bytes()
    )
    assert record.info["reward_mean"] == 0.5  # a NaN, kept as readers take it, beside it


class LongUpload(FsspecStorage):
    """A lease root whose upload of step `step`'s delta takes `lease_s` twice over on the claim's clock; then
    `meanwhile` (if given) runs, as another writer would."""

    def __init__(self, url: str, clock: types.SimpleNamespace, step: int, lease_s: float, meanwhile=None):
        super().__init__(url)
        self.clock, self.step, self.lease_s, self.meanwhile = clock, step, lease_s, meanwhile

    def _write_many(self, files, delete):
        super()._write_many(files, delete)
        if any(protocol.step_of(path) == self.step and path.startswith("deltas/") for path, _ in files):
            self.clock.offset += 2 * self.lease_s
            if self.meanwhile:
                self.meanwhile(self)


@pytest.fixture
def clock(monkeypatch):
    """The claim's clock (leases, their checks), moved on by the storage instead of waited for."""
    clock = types.SimpleNamespace(offset=0.0, strftime=time.strftime, gmtime=time.gmtime)
    clock.time = lambda: time.time() + clock.offset
    monkeypatch.setattr(claim_module, "time", clock)
    return clock


def test_a_lease_that_lapsed_during_a_long_upload_is_taken_again(clock):
    url = f"memory://long-upload-{uuid.uuid4().hex}"
    lease_s = 600.0  # on the claim's clock: no renewal falls due on its own during the test
    params = make_params()
    with Publisher(
        LongUpload(url, clock, 1, lease_s), model="tiny", config=PublisherConfig(lease_s=lease_s)
    ) as p:
        p.publish(params)
        p.flush()
        train_step(params, 1)
        p.publish(params)
        p.flush()  # acknowledged: nobody else touched the root
        epoch, holder = p.claim.epoch, p.claim.holder
    reader = Subscriber(url)
    reader.sync()
    assert reader.step == 1 and bitwise_equal(reader.state, bf16(params))
    lease = json.loads(open_storage(url).read_bytes(WRITER_PATH))
    assert (lease["holder"], lease["epoch"]) == (holder, epoch)


def test_a_lapsed_lease_another_writer_took_is_never_taken_back(clock):
    url = f"memory://long-upload-{uuid.uuid4().hex}"
    lease_s = 600.0

    def takeover(storage):  # another publisher claimed the root once the lease lapsed
        lease = {"holder": "someone else", "epoch": 99, "expires_at": clock.time() + lease_s}
        storage.write_bytes(WRITER_PATH, json.dumps(lease).encode())

    params = make_params()
    storage = LongUpload(url, clock, 1, lease_s, meanwhile=takeover)
    publisher = Publisher(storage, model="tiny", config=PublisherConfig(lease_s=lease_s))
    publisher.publish(params)
    publisher.flush()
    publisher.publish(make_params(seed=1))
    with pytest.raises(Stopped, match="someone else") as failed:
        publisher.flush()
    assert isinstance(failed.value.__cause__, WriterConflict)
    with pytest.raises(Stopped):
        publisher.close()
    assert protocol.read_head(open_storage(url)).step == 0  # step 1 never acknowledged
    assert json.loads(open_storage(url).read_bytes(WRITER_PATH))["holder"] == "someone else"


def corrupt_last_delta(root, step: int) -> None:
    """Flip bytes in the middle of step `step`'s delta (its size stays what the head lists)."""
    path = delta_file(root, step)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    path.write_bytes(bytes(data))


def test_a_bad_last_delta_does_not_lock_the_root(tmp_path, caplog):
    run_steps(tmp_path, 4)
    corrupt_last_delta(tmp_path, 3)
    replica = Subscriber(tmp_path)
    with pytest.raises(SyncError, match="refused delta of step 3"):
        replica.sync()
    assert replica.step == 2  # its last good step, until the next anchor
    params = make_params(seed=5)
    caplog.set_level(logging.WARNING, logger="deltasync.sync.publisher")
    with Publisher(tmp_path) as restarted:  # a restarted trainer
        assert restarted.publish(params) == 4
    (said,) = [r.getMessage() for r in caplog.records if "does not verify" in r.getMessage()]
    assert "step 3" in said and "anchor" in said
    head = protocol.read_head(open_storage(tmp_path))
    assert [(e.kind, e.step) for e in head.entries] == [("anchor", 4)]  # a new chain: the old one is broken
    replica.sync()  # recovers from the next anchor
    assert replica.step == 4 and bitwise_equal(replica.state, bf16(params))


def test_push_of_a_complete_checkpoint_over_a_bad_last_delta(tmp_path):
    from safetensors.torch import save_file

    run_steps(tmp_path / "root", 3)
    corrupt_last_delta(tmp_path / "root", 2)
    checkpoint = bf16(make_params(seed=6))
    save_file(checkpoint, tmp_path / "model.safetensors")
    assert cli.main(["push", str(tmp_path / "root"), str(tmp_path / "model.safetensors")]) == 0
    reader = Subscriber(tmp_path / "root")
    reader.sync()
    assert reader.step == 3 and bitwise_equal(reader.state, checkpoint)
    with Publisher(tmp_path / "root") as publisher:  # and the chain goes on from it: a delta
        params = make_params(seed=6)
        train_step(params, 4)
        publisher.publish(params)
    head = protocol.read_head(open_storage(tmp_path / "root"))
    assert [(e.kind, e.step) for e in head.entries] == [("anchor", 3), ("delta", 4)]
    reader.sync()
    assert reader.step == 4 and bitwise_equal(reader.state, bf16(params))
