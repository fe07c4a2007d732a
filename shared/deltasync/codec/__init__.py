"""The patch codec: bf16 bit patterns, change detection, fingerprints and the patch file format."""
