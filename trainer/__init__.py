"""The Wordle trainer (`python -m trainer`), the demo, the deployment and the tiny models."""

import logging
import os
import warnings

# The one place for the environment defaults of the project's processes, set before transformers, TRL,
# tokenizers or huggingface_hub read them: TRL's experimental-API notice, the tokenizers' fork warning
# (TRL's rollout worker is a spawned process), Hub telemetry.
for _name, _value in {
    "TRL_EXPERIMENTAL_SILENCE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}.items():
    os.environ.setdefault(_name, _value)

# TRL 1.16 warns on import that it was tested with vLLM <= 0.31; the rollout path uses only vLLM's OpenAI
# server over HTTP, which vllm 0.32 serves unchanged (the end-to-end tests run it).
warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)
# vLLM, which TRL imports, notes on a CPU that its Triton has no CPU backend: nothing the trainer uses.
logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
# TRL 1.16's AsyncGRPOTrainer registers two StepIntervalCallbacks (weight sync, metrics), by design;
# transformers warns about the second.
logging.getLogger("transformers.trainer_callback").addFilter(
    lambda record: "StepIntervalCallback" not in record.getMessage()
)
