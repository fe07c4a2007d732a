"""TRL integration: train with `trl.experimental.async_grpo.AsyncGRPOTrainer` and publish every step to a sync
root that vLLM replicas follow (examples/grpo_bucket.py is a whole script):

    from deltasync.trl import BucketWeightTransfer, check_or_exit, schema_of, stamp_rollouts

    transfer = BucketWeightTransfer(sync_root, model_id=model_name)
    trainer = AsyncGRPOTrainer(model=..., args=args, ..., weight_transfer=transfer)
    check_or_exit(sync_root, schema_of(trainer.model), model_name, [replica_url])  # exit 2 if anything is off
    stamp_rollouts(trainer, transfer)   # staleness from the replicas' weight versions, step telemetry
    trainer.train()

- `BucketWeightTransfer` (transfer.py): TRL's `weight_transfer=` protocol; each sync becomes the next step of
  the root, encoded and uploaded in the background, under the checkpoint's tensor names (checkpoint.py: MoE
  experts, fused in transformers, one tensor per expert as vLLM loads them).
- Adapter mode (`BucketWeightTransfer(..., lora_name="policy")` with TRL's `peft_config=`): each sync
  publishes the LoRA adapter alone, and every request names the adapter version it wants (`policy-vN`), which
  vLLM replicas fetch from the root with the `deltasync` LoRA resolver (`deltasync.vllm.lora`).
- `stamp_rollouts` (rollout.py): TRL's rollout worker stamps each rollout with the weight version of the
  replica that served it, spreads rollouts over several replicas, holds generation close to training
  (`max_ahead`, see `rollouts_ahead`), and each step's telemetry record gets its rewards and staleness; it
  tells the transfer the trainer's model (`BucketWeightTransfer.use_model`).
- `preflight` / `check_or_exit` (preflight.py): the root, the replicas and the environment answer and hold the
  same model, before anything is published.
- `apply_cpu_shims` (cpu.py): what TRL's async trainer needs to run on a CPU.

TRL's private names are all in compat.py.
"""

from deltasync.trl.cpu import apply_cpu_shims
from deltasync.trl.preflight import check_or_exit, preflight, schema_of
from deltasync.trl.rollout import (
    RolloutCounters,
    VersionedRolloutLoop,
    rollouts_ahead,
    stamp_rollouts,
    step_info,
)
from deltasync.trl.transfer import BucketWeightTransfer

__all__ = [
    "BucketWeightTransfer",
    "RolloutCounters",
    "VersionedRolloutLoop",
    "apply_cpu_shims",
    "check_or_exit",
    "preflight",
    "rollouts_ahead",
    "schema_of",
    "stamp_rollouts",
    "step_info",
]
