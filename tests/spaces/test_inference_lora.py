"""The inference app's choice of LoRA mode (`lora_of`, `server_args`): from run.json when the Space starts, or
from MAX_LORA_RANK before any run.json exists (the demo starts the Space before its trainer), refused in one
line when run.json contradicts the setting. Imports the app (and so vLLM) but starts no engine."""

import pytest
import torch

from deltasync.sync.publisher import Publisher


def settings(app, model, root, **env):
    return app.Settings(model=str(model), sync_root=str(root), **env)


def publish(root, lora=None) -> None:
    with Publisher(root, model="tiny", lora=lora) as publisher:
        publisher.publish({"w": torch.ones(8, 8)})


def flags(args) -> tuple:
    return args.enable_lora, args.max_lora_rank


def test_max_lora_rank_starts_lora_mode_before_run_json(app, model, tmp_path):
    cfg = settings(app, model, tmp_path, max_lora_rank=16)
    assert app.lora_of(cfg) == {}
    assert flags(app.server_args(cfg, app.lora_of(cfg))) == (True, 16)
    unset = settings(app, model, tmp_path)
    assert app.lora_of(unset) is None and not app.server_args(unset).enable_lora  # full weights, as before


def test_run_json_decides_without_the_setting_and_must_agree_with_it(app, model, tmp_path):
    lora = {"name": "policy", "adapter_config": {"r": 32}}
    publish(tmp_path / "lora", lora)
    assert app.lora_of(settings(app, model, tmp_path / "lora")) == lora
    assert flags(app.server_args(settings(app, model, tmp_path / "lora"), lora)) == (True, 32)
    with pytest.raises(SystemExit, match="adapter of rank 32, above MAX_LORA_RANK 16$"):
        app.lora_of(settings(app, model, tmp_path / "lora", max_lora_rank=16))
    publish(tmp_path / "full")
    with pytest.raises(SystemExit, match="MAX_LORA_RANK is set, but .* holds full weights of tiny"):
        app.lora_of(settings(app, model, tmp_path / "full", max_lora_rank=16))


@pytest.mark.parametrize(
    ("r", "line"),
    [
        (1024, r"holds an adapter of rank 1024, above the largest vLLM serves \(512\)$"),
        ("sixteen", "holds an adapter whose adapter_config says r 'sixteen': not a rank$"),
        (None, "holds an adapter whose adapter_config says r 'None': not a rank$"),
    ],
)
def test_an_adapter_vllm_cannot_serve_stops_the_space_with_one_line(app, model, tmp_path, r, line):
    publish(tmp_path, {"name": "policy", "adapter_config": {"r": r}})
    with pytest.raises(SystemExit, match=line):
        app.lora_of(settings(app, model, tmp_path))


def test_a_max_lora_rank_above_vllms_stops_the_space_with_one_line(app, model, tmp_path, monkeypatch):
    monkeypatch.setenv("MODEL", str(model))
    monkeypatch.setenv("SYNC_ROOT", str(tmp_path))
    monkeypatch.setenv("MAX_LORA_RANK", "1024")
    with pytest.raises(SystemExit, match="^bad configuration .*MAX_LORA_RANK: .*512$"):
        app.from_env(app.Settings)
