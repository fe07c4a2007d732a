"""vLLM integration: the `deltasync` weight-transfer backend (`engine`, registered by `plugin`), where each HF
tensor lives in a worker's model (`layout`), the follower that drives vLLM's weight-update protocol
(`follower`), and every vLLM name beyond its public API (`compat`).

Imported only by vLLM's processes, the inference Space and `deltasync follow`; the rest of deltasync never
imports vLLM.
"""
