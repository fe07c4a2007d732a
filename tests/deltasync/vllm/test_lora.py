"""The `deltasync` LoRA resolver against LoRA roots published by hand (adapters in PEFT's format, no vLLM
engine): each `{lora_name}-v{N}` resolves to the verified step N, written as a PEFT adapter; anything else
resolves to nothing, with one line saying why."""

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file

from deltasync.errors import TransientStorageError
from deltasync.sync.protocol import ManifestError, RunInfo
from deltasync.sync.publisher import Publisher, PublisherConfig
from deltasync.sync.signing import SigningKey, Trust
from deltasync.vllm.lora import DeltasyncLoRAResolver, keep_setting, trust_setting
from tests.helpers import assert_bitwise_equal, bf16

BASE = "tiny-base"
NAME = "policy"
HIDDEN, RANK = 64, 8
ADAPTER_CONFIG = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "r": RANK,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "v_proj"],
    "bias": "none",
    "base_model_name_or_path": BASE,
}


def adapter(seed: int) -> dict[str, torch.Tensor]:
    """An adapter's tensors under the names PEFT saves them."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.1 * torch.randn(RANK, HIDDEN, generator=g)
            tensors[f"{prefix}.lora_B.weight"] = 0.01 * torch.randn(HIDDEN, RANK, generator=g)
    return tensors


def publish(
    root, steps: int, model: str = BASE, lora: dict | None = None, config: PublisherConfig | None = None
) -> list[dict]:
    """`steps` versions of an adapter, each trained a little from the last; their bf16 states."""
    lora = {"name": NAME, "adapter_config": ADAPTER_CONFIG} if lora is None else lora
    tensors, states = adapter(0), []
    with Publisher(root, model=model, lora=lora or None, config=config) as publisher:
        for step in range(steps):
            if step:
                for t in tensors.values():
                    t += 0.05 * t.abs() * torch.randn(t.shape, generator=torch.Generator().manual_seed(step))
            publisher.publish(tensors, step=step)
            publisher.flush()
            states.append(bf16(tensors))
    return states


def resolve(resolver: DeltasyncLoRAResolver, name: str, base: str = BASE):
    return asyncio.run(resolver.resolve_lora(base, name))


@pytest.fixture
def resolver(tmp_path):
    (tmp_path / "cache").mkdir()
    return DeltasyncLoRAResolver(str(tmp_path / "root"), tmp_path / "cache")


def test_each_version_resolves_to_its_step_in_peft_format(tmp_path, resolver):
    states = publish(tmp_path / "root", 3)
    for step in (2, 0, 1):  # forward, back to the anchor, forward again
        request = resolve(resolver, f"{NAME}-v{step}")
        assert request.lora_name == f"{NAME}-v{step}" and request.base_model_name == BASE
        folder = tmp_path / "cache" / request.lora_path
        assert_bitwise_equal(load_file(folder / "adapter_model.safetensors"), states[step])
        assert json.loads((folder / "adapter_config.json").read_text()) == ADAPTER_CONFIG
    assert len(list((tmp_path / "cache").iterdir())) == 3  # one folder per version, nothing staged left


def test_a_version_not_published_yet_resolves_to_nothing(tmp_path, resolver):
    publish(tmp_path / "root", 2)
    assert resolve(resolver, f"{NAME}-v2") is None
    assert resolver.last_error == f"LoRA adapter {NAME}-v2: step 2 is not in {tmp_path / 'root'} yet (head 1)"
    assert not list((tmp_path / "cache").iterdir())


def test_an_empty_root_resolves_to_nothing(tmp_path, resolver):
    assert resolve(resolver, f"{NAME}-v0") is None
    assert "no run in" in resolver.last_error


def test_a_corrupt_adapter_file_is_refused_and_nothing_is_served(tmp_path, resolver):
    states = publish(tmp_path / "root", 3)
    root = tmp_path / "root"
    for path in [*root.glob("deltas/step-00000002*"), *root.glob("anchors/step-00000002*/*")]:  # all it has
        data = bytearray(path.read_bytes())
        data[-9] ^= 0x40  # a bit of the values: the file still parses, its fingerprint does not hold
        path.write_bytes(bytes(data))
    assert resolve(resolver, f"{NAME}-v2") is None
    line = resolver.last_error
    assert line.startswith(f"LoRA adapter {NAME}-v2: refused") and "\n" not in line
    assert not list((tmp_path / "cache").glob(f"{NAME}-v2-*"))
    # The versions before it are still served, verified.
    folder = tmp_path / "cache" / resolve(resolver, f"{NAME}-v1").lora_path
    assert_bitwise_equal(load_file(folder / "adapter_model.safetensors"), states[1])


@pytest.mark.parametrize(
    ("name", "base", "reason"),
    [
        (f"{NAME}-v0", "another-base", f"holds an adapter of {BASE}, not of another-base"),
        ("other-v0", BASE, f"publishes the adapter '{NAME}', not 'other'"),
    ],
)
def test_a_foreign_adapter_is_refused(tmp_path, resolver, name, base, reason):
    publish(tmp_path / "root", 1)
    assert resolve(resolver, name, base) is None
    assert reason in resolver.last_error
    assert not list((tmp_path / "cache").iterdir())


def test_a_full_weight_root_serves_no_adapter(tmp_path, resolver):
    publish(tmp_path / "root", 1, lora={})
    assert resolve(resolver, f"{NAME}-v0") is None
    assert "holds full weights of tiny-base, not a LoRA adapter" in resolver.last_error


def test_names_without_a_version_are_left_to_other_resolvers(tmp_path, resolver):
    publish(tmp_path / "root", 1)
    assert resolve(resolver, NAME) is None
    assert resolve(resolver, f"{NAME}-vX") is None
    assert resolver.last_error is None


def test_run_json_marks_a_lora_root_and_refuses_a_bad_mark():
    lora = {"name": NAME, "adapter_config": ADAPTER_CONFIG}
    run = RunInfo.of(BASE, {"a": torch.zeros(2)}, lora)
    assert RunInfo.from_json(run.to_json()) == run
    assert "lora" not in json.loads(RunInfo.of(BASE, {"a": torch.zeros(2)}).to_json())  # as before
    for bad in ([], {"name": NAME}, {"name": 3, "adapter_config": {}}):
        raw = json.loads(run.to_json())
        raw["lora"] = bad
        with pytest.raises(ManifestError, match="lora"):
            RunInfo.from_json(json.dumps(raw).encode())


@pytest.mark.parametrize("name", ["../../escaped", "org/policy", "-v"])
def test_names_that_are_no_folder_names_resolve_to_nothing_and_write_nothing(tmp_path, resolver, name):
    publish(tmp_path / "root", 1, lora={"name": name, "adapter_config": ADAPTER_CONFIG})
    assert resolve(resolver, f"{name}-v0") is None
    assert "not an adapter name" in resolver.last_error and "\n" not in resolver.last_error
    written = {p for p in tmp_path.rglob("*") if not p.is_relative_to(tmp_path / "root")}
    assert written == {tmp_path / "cache"}


def reads(resolver, monkeypatch) -> list[str]:
    """The paths `resolver` reads from its root from now on."""
    storage, paths = resolver.reader.storage, []
    for method in ("read_bytes", "download_file"):
        real = getattr(storage, method)
        monkeypatch.setattr(
            storage, method, lambda path, *a, real=real, **k: paths.append(path) or real(path, *a, **k)
        )
    return paths


@pytest.mark.parametrize(
    ("lora", "name", "base"),
    [({}, f"{NAME}-v1", BASE), (None, "other-v1", BASE), (None, f"{NAME}-v1", "another-base")],
)
def test_a_root_that_serves_no_such_adapter_is_refused_from_its_run_json_alone(
    tmp_path, resolver, monkeypatch, lora, name, base
):
    publish(tmp_path / "root", 2, lora=lora)
    paths = reads(resolver, monkeypatch)
    for _ in range(3):
        assert resolve(resolver, name, base) is None
    assert paths == ["run.json"]  # read once: nothing downloaded, no request for the same name again
    assert resolver.reader.step is None


def test_the_cache_keeps_the_folders_last_used_and_nothing_it_did_not_write(tmp_path):
    states = publish(tmp_path / "root", 4)
    cache = tmp_path / "cache"
    (cache / "notes").mkdir(parents=True)
    resolver = DeltasyncLoRAResolver(str(tmp_path / "root"), cache, keep=2)
    for step in (0, 1, 2, 1, 3):
        resolve(resolver, f"{NAME}-v{step}")
    assert sorted(p.name.split("-")[1] for p in cache.glob(f"{NAME}-v*")) == ["v1", "v3"]
    assert (cache / "notes").is_dir()
    folder = cache / resolve(resolver, f"{NAME}-v0").lora_path  # written again when named again
    assert_bitwise_equal(load_file(folder / "adapter_model.safetensors"), states[0])
    assert len(list(cache.glob(f"{NAME}-v*"))) == 2


@pytest.mark.parametrize("value", ["0", "-3", "many", "1.5"])
def test_a_keep_setting_that_is_no_count_stops_with_one_line(value):
    with pytest.raises(SystemExit, match="DELTASYNC_LORA_KEEP"):
        keep_setting(value)


def test_a_cache_that_cannot_be_written_resolves_to_nothing_with_one_line(tmp_path):
    publish(tmp_path / "root", 1)
    (tmp_path / "cache").write_text("a file, not a folder")
    resolver = DeltasyncLoRAResolver(str(tmp_path / "root"), tmp_path / "cache")
    assert resolve(resolver, f"{NAME}-v0") is None
    assert "Not a directory" in resolver.last_error and "\n" not in resolver.last_error


def test_a_storage_failure_is_not_the_roots_fault_and_the_next_request_resolves(
    tmp_path, resolver, monkeypatch
):
    states = publish(tmp_path / "root", 1)

    def failing(path: str, limit: int | None = None) -> bytes:
        raise TransientStorageError("the storage is down for now")

    with monkeypatch.context() as m:
        m.setattr(resolver.reader.storage, "read_bytes", failing)
        assert resolve(resolver, f"{NAME}-v0") is None
    assert "down for now" in resolver.last_error and "cannot be read" not in resolver.last_error
    request = resolve(resolver, f"{NAME}-v0")  # run.json was not taken as bad: read again, served
    assert_bitwise_equal(
        load_file(tmp_path / "cache" / request.lora_path / "adapter_model.safetensors"), states[0]
    )


def test_a_resolver_given_trusted_keys_resolves_only_what_they_signed(tmp_path):
    """DELTASYNC_LORA_TRUSTED_KEYS: the signed root's versions resolve, verified; an unsigned root (a bucket
    writer's, or a trainer without its key) resolves to nothing, in one line, and writes nothing."""
    key = SigningKey.generate()
    key.save(tmp_path / "trainer.key")
    states = publish(
        tmp_path / "signed", 2, config=PublisherConfig(signing_key=str(tmp_path / "trainer.key"))
    )
    publish(tmp_path / "unsigned", 2)
    trust = trust_setting(f"{tmp_path / 'trainer.key.pub'}")
    assert trust.keys == (key.public,) and trust_setting(None).keys == ()
    for name in ("signed", "unsigned"):
        (tmp_path / f"cache-{name}").mkdir()
    signed = DeltasyncLoRAResolver(str(tmp_path / "signed"), tmp_path / "cache-signed", trust=trust)
    folder = tmp_path / "cache-signed" / resolve(signed, f"{NAME}-v1").lora_path
    assert_bitwise_equal(load_file(folder / "adapter_model.safetensors"), states[1])
    unsigned = DeltasyncLoRAResolver(str(tmp_path / "unsigned"), tmp_path / "cache-unsigned", trust=trust)
    assert resolve(unsigned, f"{NAME}-v1") is None
    assert unsigned.last_error == (
        f"LoRA adapter {NAME}-v1: run.json: unsigned, and this replica trusts only signed runs"
    )
    assert not list((tmp_path / "cache-unsigned").iterdir())


def test_trusted_keys_that_are_no_keys_stop_with_one_line():
    with pytest.raises(SystemExit, match="^DELTASYNC_LORA_TRUSTED_KEYS: 'ed25519:bm90' is not a public key"):
        trust_setting("ed25519:bm90")
    assert isinstance(trust_setting(""), Trust)


def test_the_plugin_registers_a_resolver_trusting_the_keys_of_its_environment(tmp_path, monkeypatch):
    """What a stock server (and the inference Space, which sets the variables) gets: the resolver the
    `vllm.general_plugins` entry point registers trusts DELTASYNC_LORA_TRUSTED_KEYS."""
    from vllm.lora.resolver import LoRAResolverRegistry

    from deltasync.vllm.lora import RESOLVER, register_resolver

    key = SigningKey.generate()
    monkeypatch.setattr(LoRAResolverRegistry, "resolvers", {})  # this test's registry, restored after
    monkeypatch.setenv("DELTASYNC_LORA_ROOT", str(tmp_path))
    monkeypatch.setenv("DELTASYNC_LORA_TRUSTED_KEYS", key.public)
    register_resolver("r1")
    resolver = LoRAResolverRegistry.get_resolver(RESOLVER)
    assert resolver.reader.trust.keys == (key.public,) and resolver.replica == "r1"
