"""TRL integration: the bucket weight transfer for `AsyncGRPOTrainer(weight_transfer=...)`."""
