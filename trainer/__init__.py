"""The Wordle trainer (`python -m trainer`), the demo, the deployment and the tiny models."""

import os

# The one place for the environment defaults of the project's processes, set before transformers, TRL,
# tokenizers or huggingface_hub read them: TRL's experimental-API notice, the tokenizers' fork warning
# (TRL's rollout worker is a spawned process), Hub telemetry.
for _name, _value in {
    "TRL_EXPERIMENTAL_SILENCE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}.items():
    os.environ.setdefault(_name, _value)
