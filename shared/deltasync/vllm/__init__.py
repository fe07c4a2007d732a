"""vLLM integration: the worker extension that patches a live engine's weights in place, and its applier.

Imported only by the inference Space and vLLM's worker processes; the rest of deltasync never imports vLLM.
"""
