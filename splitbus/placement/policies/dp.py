"""dp, the naive DP policy: each arrival at once to the rank (of a complete DP group) with the
lowest prefill cost (queued prefill tokens plus the prompt tokens it does not hold cached,
``prefill_cost``) that has KV blocks for it. ``splitbus scheduler --mode dp
--no-stagger``; ``stagger`` batches arrivals instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.registry import WorkerInfo
from splitbus.placement.costs import (
    blocks_needed,
    choose,
    dp_placement,
    dp_ranks,
    free_blocks,
    prefill_cost,
    reserved,
)
from splitbus.placement.decision import Decision, NoPlacement, Placed
from splitbus.placement.ledger import Local
from splitbus.placement.policies import register
from splitbus.placement.policies.base import Policy


@register("dp")
class DpPolicy(Policy):
    def place(self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> Decision:
        ranks = [
            w
            for w in dp_ranks(workers, request.model)
            if free_blocks(w, reserved(local, w)) >= blocks_needed(request, w.record.block_size)
        ]
        cached = self.cached(request, ranks)
        rank = choose(ranks, prefill_cost(ranks, request, cached, local, self.options.cost), self.rng)
        if rank is None:
            return NoPlacement(f"no live DP rank with room serves model '{request.model}'")
        return Placed((dp_placement(rank, request, cached=cached.get(rank.record.worker_id, 0)),))
