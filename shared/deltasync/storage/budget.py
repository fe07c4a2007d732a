"""Request budgets: each component's share of the Hub's per-user quotas, known up front.

The Hub counts a user's requests in fixed 5-minute windows, per class (API calls, resolver calls), and every
component of a run spends from the same token: the trainer, the dashboard and every replica. `fleet_shares`
splits a tier's quotas between them; a `HubBucketStorage` given its share counts what it sends and backs off
(RateLimited, without a request) before it goes over, and all of them back off when the Hub says the user's
window is nearly spent, so no request of theirs meets a 429.
"""

from __future__ import annotations

from dataclasses import dataclass

WINDOW_S = 300.0  # the Hub's quota window
FREE_TIER = {"api": 1000, "resolvers": 5000}
PRO_TIER = {"api": 2500, "resolvers": 12000}
RESERVE = 0.05  # of each quota: left unspent by everyone (other tools on the same token, a request in flight)
TRAINER = {"api": 150, "resolvers": 200}  # at one step per 10 s: 2 batches a step, 3 reads (bench.hub)
DASHBOARD = {"api": 100, "resolvers": 500}  # the board's POLL_BUDGET: a poll's listing or tokens, and reads
# What a replica spends per window besides its telemetry, on the feed: at most a reconnect (the Hub ends
# sessions), its read and write tokens (each lasts longer than a window); no resolver read.
REPLICA_OVERHEAD = {"api": 1, "resolvers": 0}


@dataclass(frozen=True)
class Budget:
    """Requests per 5-minute window a component may send, per class."""

    api: int
    resolvers: int

    def __post_init__(self) -> None:
        if self.api < 1 or self.resolvers < 1:
            raise ValueError(f"a budget needs at least 1 request of each class per window, got {self}")

    def of(self, cls: str) -> int:
        return self.api if cls == "api" else self.resolvers


def fleet_shares(tier: dict[str, int], replicas: int) -> dict[str, Budget]:
    """Each component's share of `tier` (requests per window per class): `trainer`, `dashboard` and `replica`
    (each of `replicas`). ValueError when the replicas' shares would not cover their fixed overhead."""
    share = {}
    for cls in ("api", "resolvers"):
        left = tier[cls] * (1 - RESERVE) - TRAINER[cls] - DASHBOARD[cls]
        share[cls] = int(left // max(replicas, 1))
        if share[cls] <= REPLICA_OVERHEAD[cls]:  # nothing left for its telemetry
            raise ValueError(
                f"{replicas} replicas do not fit {tier}: each would have {share[cls]} {cls} calls a window, "
                f"its feed and tokens alone take {REPLICA_OVERHEAD[cls]}"
            )
    return {
        "trainer": Budget(**TRAINER),
        "dashboard": Budget(**DASHBOARD),
        "replica": Budget(**share),
    }
