"""Fencing on a lease root (an fsspec folder, no lock): a writer stopped inside any of its write windows,
while another claims the root and publishes, never damages an acknowledged step, never acknowledges a step of
its own, and leaves a root that pulls and pushes. One folder under any spelling has one lock."""

import json
import threading
import time
import uuid

import pytest
import torch

from deltasync.storage import FsspecStorage, WriterConflict, open_storage
from deltasync.sync import protocol
from deltasync.sync.claim import WRITER_PATH, WriterClaim
from deltasync.sync.publisher import Publisher, PublisherConfig
from deltasync.sync.subscriber import Subscriber
from tests.helpers import bf16, bitwise_equal, make_params, train_step, wait_for

LEASE_S = 3.0  # the paused writer's lease: short, so that the test waits little for it to lapse


class Pausing(FsspecStorage):
    """A lease root whose next write under `prefix` (once `armed`) stops until `resume` is set."""

    def __init__(self, url: str, prefix: str):
        super().__init__(url)
        self.prefix, self.armed = prefix, False
        self.paused, self.resume = threading.Event(), threading.Event()

    def _pause(self, path: str) -> None:
        if self.armed and path.startswith(self.prefix):
            self.armed = False
            self.paused.set()
            assert self.resume.wait(120)

    def _write_bytes(self, path, data):
        self._pause(path)
        super()._write_bytes(path, data)

    def _upload_file(self, local, path):
        self._pause(path)
        super()._upload_file(local, path)


def lease_lapsed(url: str) -> bool:
    lease = json.loads(open_storage(url).read_bytes(WRITER_PATH))
    return time.time() > lease["expires_at"]


def objects(url: str, step: int) -> dict[str, bytes]:
    """Every data object of `step` under the root, by path."""
    storage = open_storage(url)
    paths = storage.list("deltas") + storage.list("anchors")
    return {p: storage.read_bytes(p) for p in paths if protocol.step_of(p) == step}


@pytest.mark.parametrize("window", ["deltas/", "anchors/", protocol.HEAD_PATH])
def test_a_paused_writer_never_damages_or_acknowledges(window):
    url = f"memory://fencing-{uuid.uuid4().hex}"
    config = PublisherConfig(anchor_every=3, keep_anchors=10_000, lease_s=LEASE_S)  # step 3: anchor + delta
    acked = {}  # step -> the bf16 state a publisher acknowledged
    params = make_params()
    a_storage = Pausing(url, window)
    a = Publisher(a_storage, model="tiny", config=config)
    for step in range(3):
        if step:
            train_step(params, step)
        a.publish(params, step=step)
        a.flush()
        acked[step] = bf16(params)

    a_storage.armed = True
    train_step(params, 3)
    a.publish(params, step=3)  # A's step 3 stops inside the window
    assert a_storage.paused.wait(60)
    wait_for(lambda: lease_lapsed(url), "the paused writer's lease to lapse")

    b_params = make_params(seed=7)  # another trainer: another state for the same step numbers
    b = Publisher(url, model="tiny", config=replace_lease(config, 60.0))
    b.publish(b_params, step=3)
    b.flush()
    acked[3] = bf16(b_params)
    b_files = objects(url, 3)

    a_storage.resume.set()
    with pytest.raises(RuntimeError, match="another publisher|lapsed"):  # fenced: never acknowledged
        a.flush(60)
    with pytest.raises(RuntimeError):
        a.close(60)
    assert all(objects(url, 3)[p] == data for p, data in b_files.items())  # B's objects untouched

    b.close()  # puts its head back if A replaced it
    for step, state in acked.items():
        reader = Subscriber(url)
        reader.sync(step)
        assert bitwise_equal(reader.state, state), f"step {step}"

    train_step(b_params, 4)
    with Publisher(url, model="tiny", config=config) as c:  # the next push succeeds
        assert c.last_step == 3
        c.publish(b_params, step=4)
    reader = Subscriber(url)
    reader.sync()
    assert reader.step == 4 and bitwise_equal(reader.state, bf16(b_params))


def stopped_in_head_write(url: str, config: PublisherConfig, steps: int) -> tuple[Publisher, Pausing]:
    """Writer A after publishing steps 0 to `steps` - 1, stopped inside the head write of step `steps` until
    its lease lapsed."""
    params = make_params()
    a_storage = Pausing(url, protocol.HEAD_PATH)
    a = Publisher(a_storage, model="tiny", config=config)
    for step in range(steps + 1):
        if step:
            train_step(params, step)
        a_storage.armed = step == steps
        a.publish(params, step=step)
        if step < steps:
            a.flush()
    assert a_storage.paused.wait(60)
    wait_for(lambda: lease_lapsed(url), "the paused writer's lease to lapse")
    return a, a_storage


def replace_lease(config: PublisherConfig, lease_s: float) -> PublisherConfig:
    return PublisherConfig(**{**config.__dict__, "lease_s": lease_s})


def test_a_fenced_head_is_replaced_by_the_current_writers_next_step():
    """The fenced writer's head (a smaller epoch) never hides the current writer's (its head under its
    epoch), and latest.json is taken back at the current writer's next head write."""
    url = f"memory://fencing-{uuid.uuid4().hex}"
    config = PublisherConfig(keep_anchors=10_000, lease_s=LEASE_S)
    a, a_storage = stopped_in_head_write(url, config, steps=1)
    b_params = make_params(seed=7)
    b = Publisher(url, model="tiny", config=replace_lease(config, 60.0))
    b.publish(b_params, step=1)
    b.flush()
    a_storage.resume.set()
    with pytest.raises(RuntimeError, match="another publisher"):
        a.close(60)
    fenced = protocol.Head.from_json(open_storage(url).read_bytes(protocol.HEAD_PATH))
    assert fenced.epoch < b.claim.epoch  # A's head replaced latest.json once: complete, readable
    assert protocol.read_head(open_storage(url)).epoch == b.claim.epoch  # readers still take B's
    assert Subscriber(url).sync()
    train_step(b_params, 2)
    b.publish(b_params, step=2)
    b.flush()  # acknowledged over the fenced head
    for step in (1, 2):
        reader = Subscriber(url)
        reader.sync(step)
        expected = make_params(seed=7) if step == 1 else b_params
        assert bitwise_equal(reader.state, bf16(expected))
    b.close()


def test_one_folder_has_one_lock_whatever_its_spelling(tmp_path):
    root = tmp_path / "root"
    with Publisher(root, model="tiny") as publisher:
        publisher.publish(make_params())
        publisher.flush()
        for url in (f"local://{root}", f"file://{root}"):
            with pytest.raises(WriterConflict, match="being written by another publisher"):
                Publisher(url)
        with pytest.raises(WriterConflict):  # an fsspec storage of a local folder takes the same flock
            WriterClaim(FsspecStorage(f"local://{root}"))
    with Publisher(f"local://{root}") as publisher:  # released: any spelling may write
        publisher.publish({n: t + 1 for n, t in make_params().items()})


def test_local_fsspec_roots_create_their_folders(tmp_path):
    params = make_params()
    with Publisher(f"local://{tmp_path}/new/root", model="tiny") as publisher:
        publisher.publish(params)
    storage = FsspecStorage(f"local://{tmp_path}/other")
    storage.write_bytes("deltas/x", b"1")
    assert (tmp_path / "other" / "deltas" / "x").read_bytes() == b"1"
    reader = Subscriber(f"local://{tmp_path}/new/root")
    reader.sync()
    assert bitwise_equal(reader.state, bf16(params))


def test_steps_and_names_a_reader_would_refuse_are_refused_before_writing(tmp_path):
    root = tmp_path / "root"
    with Publisher(root, model="tiny") as publisher:
        for step in (protocol.MAX_INT + 1, 10**30, -1):
            with pytest.raises(ValueError, match="step"):
                publisher.publish(make_params(), step=step)
        with pytest.raises(ValueError, match="tensor ''"):
            publisher.publish({"": torch.ones(2), **make_params()})
        assert not (root / protocol.HEAD_PATH).exists() and not (root / protocol.RUN_PATH).exists()
        publisher.publish(make_params(), step=protocol.MAX_INT)  # the largest a reader takes
    reader = Subscriber(root)
    reader.sync()
    assert reader.step == protocol.MAX_INT


def test_a_paused_writers_late_head_never_hides_a_closed_writers_acknowledged_step():
    """The window a head without a condition leaves: A stops inside its head write for longer than its lease,
    B claims the root, acknowledges step 3 and closes; then A's head lands on heads/latest.json. Readers and
    the next writer still take B's step 3 (B's head under its epoch), never A's."""
    url = f"memory://fencing-{uuid.uuid4().hex}"
    config = PublisherConfig(keep_anchors=10_000, lease_s=LEASE_S)
    a, a_storage = stopped_in_head_write(url, config, steps=3)
    b_params = make_params(seed=7)
    with Publisher(url, model="tiny", config=replace_lease(config, 60.0)) as b:
        b.publish(b_params, step=3)  # acknowledged, then B closes
    a_storage.resume.set()
    with pytest.raises(RuntimeError, match="another publisher|lapsed"):
        a.close(60)
    assert protocol.Head.from_json(open_storage(url).read_bytes(protocol.HEAD_PATH)).epoch == a.claim.epoch
    b_step_3 = bf16(b_params)
    reader = Subscriber(url)
    reader.sync()
    assert reader.step == 3 and bitwise_equal(reader.state, b_step_3)  # B's step, not A's
    train_step(b_params, 4)
    with Publisher(url, model="tiny", config=config) as c:  # resumes from B's step 3
        assert c.last_step == 3 and bitwise_equal(c._published, b_step_3)
        c.publish(b_params, step=4)
    for step, state in ((3, b_step_3), (4, bf16(b_params))):
        reader = Subscriber(url)
        reader.sync(step)
        assert bitwise_equal(reader.state, state), step
