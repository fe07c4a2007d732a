"""deltasync: exact sparse bf16 weight patches for async RL, synced through a Hub bucket."""
