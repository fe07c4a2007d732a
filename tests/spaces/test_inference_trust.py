"""The inference app's TRUSTED_KEYS: the setting (key lines or .pub files, one line when one is no key), the
follower's subscriber built from it (`subscriber_of`, against a stand-in engine: no vLLM engine starts),
/weights' `trust`, and run.json at start (`lora_of`, `quantization_of`): refused in one line unless the keys
signed it."""

from types import SimpleNamespace

import pytest

from deltasync.sync.publisher import PublisherConfig
from deltasync.sync.signing import SigningKey, short
from deltasync.sync.subscriber import SyncError
from deltasync.vllm.follower import EngineApplier
from deltasync.vllm.lora import DeltasyncLoRAResolver
from tests.deltasync.vllm.test_follower import FakeEngine
from tests.helpers import assert_bitwise_equal, run_steps


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """A root the trainer's key signs (3 steps), an unsigned one, the key's .pub file, another key."""
    tmp = tmp_path_factory.mktemp("roots")
    key, other = SigningKey.generate(), SigningKey.generate()
    key.save(tmp / "trainer.key")
    states = run_steps(tmp / "signed", 3, PublisherConfig(signing_key=str(tmp / "trainer.key")))
    run_steps(tmp / "unsigned", 1)
    return SimpleNamespace(
        tmp=tmp, states=states, key=key.public, pub=f"{tmp}/trainer.key.pub", other=other.public
    )


def settings(app, model, root, **env):
    return app.Settings(model=str(model), sync_root=str(root), replica_id="r1", **env)


def test_trusted_keys_take_lines_and_pub_files_and_refuse_anything_else_in_one_line(
    app, model, roots, monkeypatch
):
    cfg = settings(app, model, roots.tmp / "signed", trusted_keys=f"{roots.pub}, {roots.other}")
    assert cfg.trust.keys == (roots.key, roots.other)
    assert str(cfg.trust) == f"keys {short(roots.key)}, {short(roots.other)}"
    assert settings(app, model, roots.tmp).trust.keys == ()
    monkeypatch.setenv("MODEL", str(model))
    monkeypatch.setenv("SYNC_ROOT", str(roots.tmp))
    for bad, said in (("ed25519:bm90", "is not a public key"), ("missing.pub", "nor a key file")):
        monkeypatch.setenv("TRUSTED_KEYS", bad)
        with pytest.raises(SystemExit) as exit:
            app.from_env(app.Settings)
        line = str(exit.value)
        assert line.startswith("bad configuration") and "TRUSTED_KEYS: " in line and said in line, line
        assert "\n" not in line


def test_the_follower_serves_the_signed_steps_and_its_status_says_what_it_trusts(app, model, roots):
    for trusted, root in ((roots.pub, "signed"), ("", "signed"), (roots.pub, "unsigned")):
        cfg = settings(app, model, roots.tmp / root, trusted_keys=trusted)
        engine = FakeEngine(root=roots.tmp / root)
        applier = EngineApplier(engine, cfg.sync_root)
        try:
            subscriber = app.subscriber_of(cfg, applier)
            if root == "unsigned":
                with pytest.raises(
                    SyncError, match="run.json: unsigned, and this replica trusts only signed"
                ):
                    subscriber.sync()
                assert engine.state == {}
            else:
                subscriber.sync()
                assert_bitwise_equal(engine.state, roots.states[-1])
            status = app.sync_status(cfg, subscriber, applier, app.InFlight(None))
        finally:
            applier.close()
        expected = f"keys {short(roots.key)}" if trusted else "the bucket (no trusted keys"
        assert status["trust"].startswith(expected) and status["replica"] == "r1"


def test_run_json_at_start_is_refused_in_one_line_unless_the_keys_signed_it(app, model, roots):
    for root in ("signed", "unsigned"):
        assert app.quantization_of(settings(app, model, roots.tmp / root)) is None  # no keys: as before
    trusting = settings(app, model, roots.tmp / "signed", trusted_keys=roots.pub)
    assert app.quantization_of(trusting) is None and app.lora_of(trusting) is None
    for root, keys, said in (
        ("unsigned", roots.pub, "run.json: unsigned, and this replica trusts only signed runs"),
        ("signed", roots.other, "key this replica trusts"),
    ):
        cfg = settings(app, model, roots.tmp / root, trusted_keys=keys)
        for read in (app.quantization_of, app.lora_of):
            with pytest.raises(SystemExit) as exit:
                read(cfg)
            assert str(exit.value).startswith(f"refused {roots.tmp / root}: ") and said in str(exit.value)
    empty = settings(app, model, roots.tmp / "empty", trusted_keys=roots.pub)
    assert app.quantization_of(empty) is None and app.lora_of(empty) is None  # no run.json yet: as before


def test_a_lora_roots_status_says_what_its_resolver_trusts(app, model, roots):
    cfg = settings(app, model, roots.tmp / "signed", trusted_keys=roots.pub)
    resolver = DeltasyncLoRAResolver(cfg.sync_root, trust=cfg.trust)
    args = SimpleNamespace(max_lora_rank=8, max_loras=6)
    assert app.lora_status(cfg, resolver, app.InFlight(None), args)["trust"] == f"keys {short(roots.key)}"
