"""`DEMO_QUANT=fp8_per_channel make demo`: the recipe reaches the trainer (--quantization) and the replica
(QUANTIZATION), and the summary says what the replicas serve, from run.json."""

import torch

from deltasync.sync.publisher import Publisher, PublisherConfig
from trainer import demo


def test_the_summary_says_the_recipe_the_replicas_serve(tmp_path, monkeypatch):
    monkeypatch.setenv("DEMO_QUANT", "fp8_per_channel")
    assert demo.Settings().demo_quant == "fp8_per_channel"
    config = PublisherConfig(quantization="fp8_per_channel")
    with Publisher(tmp_path / "fp8", model="tiny", config=config) as publisher:
        publisher.publish({"model.layers.0.mlp.up_proj.weight": torch.ones(8, 8)})
    text = demo.format_summary(demo.summarize(tmp_path / "fp8"))
    assert "replicas serve        fp8_per_channel (vLLM's codes and scales, verified)" in text
    with Publisher(tmp_path / "bf16", model="tiny") as publisher:
        publisher.publish({"w": torch.ones(8, 8)})
    assert "replicas serve" not in demo.format_summary(demo.summarize(tmp_path / "bf16"))
