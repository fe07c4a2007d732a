"""Signed roots: a replica that trusts the trainer's key applies its steps and nothing that a bucket writer
without the key puts there (forged steps, replayed heads, restored older runs, changed files); rotation."""

import json
import os
import shutil
import stat
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.codec import fingerprint
from deltasync.codec.patch import encode, make_patch, read_info
from deltasync.errors import ManifestError
from deltasync.storage import LocalStorage
from deltasync.sync import protocol
from deltasync.sync.protocol import HEAD_PATH, RUN_PATH, Entry, delta_path, delta_paths
from deltasync.sync.publisher import Publisher, PublisherConfig, StoredDelta
from deltasync.sync.signing import SigningKey, Trust, parse_keys, sha256_of
from deltasync.sync.subscriber import Subscriber, SyncError, TensorsApplier
from tests.helpers import SHAPES, bf16, bitwise_equal, make_params, train_step, window_parts


@pytest.fixture
def keys(tmp_path):
    """Two key files, as `deltasync keygen` writes them: (path, public line) each."""
    made = []
    for name in ("trainer.key", "next.key"):
        key = SigningKey.generate()
        key.save(tmp_path / name)
        made.append((str(tmp_path / name), key.public))
    return made


class Trainer:
    """A signing publisher of the tests' tiny model, one flushed step at a time; `states[i]`: step i, bf16."""

    def __init__(self, root: Path, key: str | None, previous: str | None = None, params=None):
        self.params = params if params is not None else make_params()
        config = PublisherConfig(signing_key=key, previous_signing_key=previous, anchor_every=100)
        self.publisher = Publisher(root, model="tiny", config=config)
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def step(self, step: int) -> None:
        if step:
            train_step(self.params, step)
        self.publisher.publish(self.params, step=step)
        self.publisher.flush()
        self.states[step] = bf16(self.params)


def replica(root, *trusted: str, name: str | None = None) -> tuple[Subscriber, dict[str, torch.Tensor]]:
    target = {n: torch.zeros(s) for n, s in SHAPES.items()}
    return Subscriber(root, TensorsApplier(target), replica=name, trust=Trust(trusted)), target


def holds(subscriber: Subscriber, target, state, step: int) -> bool:
    return subscriber.step == step and bitwise_equal(bf16(target), state)


def forge_step(root: Path, trainer: Trainer, sign_with: SigningKey | None) -> None:
    """What a bucket writer without the trainer's key can do: a well-formed next step (a patch from the
    published state, fingerprints that verify, digests that match) and a head naming it, unsigned or signed
    by its own key."""
    head = protocol.read_head(LocalStorage(root))
    old = trainer.states[head.step]
    poisoned = {n: (t.float() + 1.0).to(torch.bfloat16) for n, t in old.items()}
    step, base_fp = head.step + 1, int(head.fingerprint, 16)
    patch = make_patch(old, poisoned, step, head.step, base_fp)
    data = encode(patch, old, "compact")
    path = delta_path(step)
    (root / path).write_bytes(data)
    fp = fingerprint.format_fingerprint(patch.fingerprint)
    entry = Entry(
        step, "delta", (path,), len(data), fp, time.time(), patch.changed, head.step, None, (sha256_of(data),)
    )
    forged = replace(head, step=step, fingerprint=fp, entries=(*head.entries, entry))
    body = forged.to_json() if sign_with is None else sign_with.sign(forged.to_json(), b"deltasync head\n")
    (root / HEAD_PATH).write_bytes(body)


def test_keys_are_written_for_their_owner_only_and_read_back(tmp_path, keys):
    path, public = keys[0]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert Path(f"{path}.pub").read_text().strip() == public
    assert SigningKey.load(path).public == public
    assert parse_keys(f"{public}, {path}.pub") == [public, public]  # a line, or the file holding it
    with pytest.raises(FileExistsError):
        SigningKey.generate().save(path)  # never over a key
    with pytest.raises(ValueError, match="is not a public key"):
        parse_keys("ed25519:bm90IGEga2V5")
    with pytest.raises(ValueError, match="not a private key file"):
        SigningKey.load(f"{path}.pub")


def test_a_trusting_replica_follows_the_trainer_bit_for_bit(tmp_path, keys):
    trainer = Trainer(tmp_path, keys[0][0])
    trusting, target = replica(tmp_path, keys[0][1])
    open_replica, open_target = replica(tmp_path)  # no keys: trusts the bucket, reads signed roots alike
    for step in range(4):
        trainer.step(step)
        assert [a.step for a in trusting.sync()] == [step]
        open_replica.sync()
        assert holds(trusting, target, trainer.states[step], step)
        assert holds(open_replica, open_target, trainer.states[step], step)
    trainer.publisher.close()
    head = json.loads((tmp_path / HEAD_PATH).read_bytes())
    assert head["signature"]["key"] == keys[0][1] and head["run"] == trusting.run.signing.run
    assert all(len(e["sha256"]) == len(e["files"]) for e in head["entries"])
    assert str(open_replica.trust).startswith("the bucket")


def test_unsigned_roots_and_other_keys_are_refused_in_one_line(tmp_path, keys):
    Trainer(tmp_path / "unsigned", None).step(0)
    subscriber, _ = replica(tmp_path / "unsigned", keys[0][1])
    with pytest.raises(SyncError, match=r"run\.json: unsigned, and this replica trusts only signed runs"):
        subscriber.sync()
    Trainer(tmp_path / "other", keys[1][0]).step(0)
    subscriber, _ = replica(tmp_path / "other", keys[0][1])
    with pytest.raises(SyncError, match="descend from no key this replica trusts"):
        subscriber.sync()
    assert subscriber.step is None


@pytest.mark.parametrize("forger", ["unsigned", "own key"])
def test_a_bucket_writer_without_the_key_is_refused_and_the_next_real_step_applies(tmp_path, keys, forger):
    trainer = Trainer(tmp_path, keys[0][0])
    subscriber, target = replica(tmp_path, keys[0][1], name="r1")
    for step in range(3):
        trainer.step(step)
        subscriber.sync()
    forge_step(tmp_path, trainer, None if forger == "unsigned" else SigningKey.generate())
    with pytest.raises(SyncError, match=r"refused .*heads/latest\.json: (unsigned|signed by 'ed25519:)"):
        subscriber.sync()
    assert holds(subscriber, target, trainer.states[2], 2)  # still serving its last good step
    record = json.loads((tmp_path / "telemetry/replicas/r1/step-00000003.json").read_bytes())
    assert record["kind"] == "head" and not record["verified"] and "head refused" in record["error"]
    trainer.step(3)  # the trainer replaces the forged head: not a writer of its run
    assert [a.step for a in subscriber.sync()] == [3]
    assert holds(subscriber, target, trainer.states[3], 3)
    trainer.publisher.close()


def test_a_changed_file_under_an_untouched_signed_head_is_refused_before_any_write(tmp_path, keys):
    trainer = Trainer(tmp_path, keys[0][0])
    subscriber, target = replica(tmp_path, keys[0][1], name="r1")
    subscriber.prefetch = False  # the file is read when its head names it, after the change below
    trainer.step(0)
    subscriber.sync()
    trainer.step(1)
    (path,) = protocol.read_head(LocalStorage(tmp_path)).entry(1, "delta").files
    data = bytearray((tmp_path / path).read_bytes())
    data[-1] ^= 1  # the same size; the head untouched
    (tmp_path / path).write_bytes(bytes(data))
    with pytest.raises(SyncError, match="SHA-256 is not the one the signed head names"):
        subscriber.sync()
    assert holds(subscriber, target, trainer.states[0], 0)
    trainer.publisher.close()


def test_a_replayed_older_head_is_refused(tmp_path, keys):
    trainer = Trainer(tmp_path, keys[0][0])
    subscriber, target = replica(tmp_path, keys[0][1], name="r1")
    trainer.step(0)
    trainer.step(1)
    subscriber.sync()
    old_head = (tmp_path / HEAD_PATH).read_bytes()
    for step in (2, 3):
        trainer.step(step)
    subscriber.sync()
    (tmp_path / HEAD_PATH).write_bytes(old_head)  # correctly signed, by the trainer, two steps ago
    with pytest.raises(SyncError, match="step 1 .* is older than step 3 .*: a replayed head"):
        subscriber.sync()
    assert holds(subscriber, target, trainer.states[3], 3)
    record = json.loads((tmp_path / "telemetry/replicas/r1/step-00000001.json").read_bytes())
    assert record["verified"] and record["kind"] == "delta"  # the step's record, not overwritten
    trainer.publisher.close()


def test_a_restarted_writer_and_a_new_run_are_followed_a_restored_older_run_is_not(tmp_path, keys):
    root, saved = tmp_path / "root", tmp_path / "saved"
    trainer = Trainer(root, keys[0][0])
    subscriber, target = replica(root, keys[0][1])
    trainer.step(0)
    trainer.step(1)
    trainer.publisher.close()
    shutil.copytree(root, saved)  # the first run as it was: restored later
    resumed = Trainer(root, keys[0][0], params=trainer.params)  # a restarted writer: a newer epoch
    resumed.states = trainer.states
    resumed.step(2)
    resumed.publisher.close()
    subscriber.sync()
    assert holds(subscriber, target, resumed.states[2], 2)
    first_run = subscriber.run.signing.run
    for name in ("heads", "deltas", "anchors", RUN_PATH, "writer.lock"):
        shutil.rmtree(root / name) if (root / name).is_dir() else (root / name).unlink()
    new_run = Trainer(root, keys[0][0], params=make_params(seed=7))
    new_run.step(0)
    subscriber.sync()  # a new run, begun later: followed from its anchor
    assert subscriber.run.signing.run != first_run and holds(subscriber, target, new_run.states[0], 0)
    new_run.publisher.close()
    for name in ("heads", RUN_PATH):  # the old run put back: every file correctly signed
        shutil.rmtree(root / name) if (root / name).is_dir() else (root / name).unlink()
        shutil.copytree(saved / name, root / name) if (saved / name).is_dir() else shutil.copy(
            saved / name, root
        )
    with pytest.raises(SyncError, match="began before run .*: a restored older run"):
        subscriber.sync()
    assert holds(subscriber, target, new_run.states[0], 0)


def test_a_rotated_key_is_followed_from_the_old_key_and_from_the_new_one(tmp_path, keys):
    (old_path, old_public), (new_path, new_public) = keys
    trainer = Trainer(tmp_path, old_path)
    trusts_old, old_target = replica(tmp_path, old_public)
    for step in range(2):
        trainer.step(step)
        trusts_old.sync()
    trainer.publisher.close()
    with pytest.raises(ValueError, match="descend from no key"):  # a new key alone cannot take the run over
        Publisher(tmp_path, model="tiny", config=PublisherConfig(signing_key=new_path))
    rotated = Trainer(tmp_path, new_path, previous=old_path, params=trainer.params)
    rotated.states = trainer.states
    for step in (2, 3):
        rotated.step(step)
        assert [a.step for a in trusts_old.sync()] == [step]
    rotated.publisher.close()
    run = json.loads((tmp_path / RUN_PATH).read_bytes())
    assert run["signing"]["keys"] == [old_public, new_public] and run["signature"]["key"] == new_public
    trusts_new, new_target = replica(tmp_path, new_public)  # started after the rotation
    trusts_new.sync()
    assert holds(trusts_old, old_target, rotated.states[3], 3) and holds(
        trusts_new, new_target, rotated.states[3], 3
    )


def test_steps_stored_in_parts_are_signed_with_each_part_digest(tmp_path, keys):
    """What a ShardedPublisher's ranks hand the writer: each part's digest, which the signed head names."""
    trainer = Trainer(tmp_path, keys[0][0])
    subscriber, target = replica(tmp_path, keys[0][1])
    trainer.step(0)
    publisher, old = trainer.publisher, trainer.states[0]
    train_step(trainer.params, 1)
    new = bf16(trainer.params)
    parts = window_parts(old, new, [(0, 6000), (6000, 1 << 20)], step=1, base_step=0)
    paths = delta_paths(1, 2, publisher.claim.tag)
    for path, data in zip(paths, parts, strict=True):
        publisher.storage.write_bytes(path, data)
    changed, fp = sum(read_info(d).changed for d in parts), read_info(parts[-1]).fingerprint
    unsigned = StoredDelta(tuple(paths), sum(map(len, parts)), changed, fp)
    with pytest.raises(ValueError, match="names each part's sha256"):
        publisher.publish_stored(unsigned, 1)
    publisher.publish_stored(replace(unsigned, sha256=tuple(map(sha256_of, parts))), 1)
    publisher.close()
    assert [a.step for a in subscriber.sync()] == [0, 1]
    assert holds(subscriber, target, new, 1)


@settings(max_examples=60, deadline=None)
@given(position=st.integers(min_value=0), flip=st.integers(min_value=1, max_value=127))
def test_any_change_to_a_signed_head_is_refused(signed_root, position, flip):
    run_data, head_data, public = signed_root
    trust = Trust([public])
    run = trust.run(run_data)
    changed = bytearray(head_data)
    changed[position % len(changed)] ^= flip
    try:
        head = trust.head(bytes(changed), run)
    except ManifestError:
        return
    # Whitespace and the JSON's own escapes aside, what parses is what was signed.
    assert head == trust.head(head_data, run)


@pytest.fixture(scope="module")
def signed_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("signed")
    key = SigningKey.generate()
    key.save(root / "k")
    trainer = Trainer(root / "root", str(root / "k"))
    for step in range(3):
        trainer.step(step)
    trainer.publisher.close()
    return (root / "root" / RUN_PATH).read_bytes(), (root / "root" / HEAD_PATH).read_bytes(), key.public
