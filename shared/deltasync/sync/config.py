"""The publisher's settings, in a module that imports nothing heavy: the command line's help shows them."""

from __future__ import annotations

from dataclasses import dataclass

LEASE_S = 120.0  # object stores: a writer's lease lasts this long unless renewed (every quarter)
ANCHOR_ENCODINGS = ("plain", "packed")
PREVIOUS_COPIES = ("auto", "device", "host")


@dataclass
class PublisherConfig:
    encoding: str = "compact"
    anchor_every: int = 50  # steps between complete anchors (also earlier once the deltas outweigh one)
    keep_anchors: int = 2  # GC keeps this many newest anchors and every delta after the oldest of them
    shard_bytes: int = 2 << 30
    anchor_encoding: str = "auto"  # plain | packed | auto: packed unless the root is a local folder
    threads: int | None = None  # codec threads; None: every core this process may run on
    retry_s: tuple[float, float] = (0.5, 30.0)  # backoff of failed uploads: first and longest wait
    lease_s: float = LEASE_S  # object stores: a writer's lease lasts this long unless renewed (every quarter)
    # Where the last published bf16 state (the previous copy) and the handed-over one live: "device" beside
    # the weights (on CUDA: publish() blocks for a device copy, the GPU codec diffs and ranks there, the
    # host gets O(changed elements); 2 B per parameter each), "host" in (pinned) host memory (publish()
    # blocks for the device-to-host copy, the host codec diffs), "auto" device where the weights are on
    # CUDA. A ShardedPublisher keeps each rank's own shards there.
    previous_copy: str = "auto"
    # A quantized root (docs/protocol.md, "Quantized replicas"): the recipe its replicas serve, as vLLM's
    # --quantization names it (deltasync.quant.recipe); each delta then carries the bf16 patch of the tensors
    # it leaves alone and the quantized delta; anchors stay bf16. None: a bf16 root.
    quantization: str | None = None
    # A signed root (docs/protocol.md, "Signed steps"): the private key file (`deltasync keygen`) that signs
    # run.json and every head; replicas given its public key refuse anything else. `previous_signing_key`:
    # the key that signed the run so far, which endorses this one (rotation). None: unsigned.
    signing_key: str | None = None
    previous_signing_key: str | None = None

    def __post_init__(self) -> None:
        if self.previous_copy not in PREVIOUS_COPIES:
            raise ValueError(
                f"previous_copy {self.previous_copy!r}: choose from {', '.join(PREVIOUS_COPIES)}"
            )
