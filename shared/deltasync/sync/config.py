"""The publisher's settings, in a module that imports nothing heavy: the command line's help shows them."""

from __future__ import annotations

from dataclasses import dataclass

LEASE_S = 120.0  # object stores: a writer's lease lasts this long unless renewed (every quarter)
ANCHOR_ENCODINGS = ("plain", "packed")


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
