"""mixed: each request prefills and decodes on one ``mixed`` worker: the one with the most free KV
blocks (then the fewest active requests), which reserves its prompt tokens and its blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.registry import Reserved, WorkerInfo
from splitbus.scheduler.placement import Eligible, Local, Placement, blocks_needed, decode_worker
from splitbus.scheduler.policies import register
from splitbus.scheduler.policies.base import Decision, NoPlacement, Placed, Policy, PolicyOptions


@register("mixed")
class MixedPolicy(Policy):
    def __init__(self, options: PolicyOptions | None = None) -> None:
        super().__init__(options)
        self.eligible = Eligible()

    def place(self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> Decision:
        worker = decode_worker(request, self.eligible(workers, request.model, "mixed"), local, self.rng)
        if worker is None:
            return NoPlacement(f"no live mixed worker with room serves model '{request.model}'")
        blocks = blocks_needed(request, worker.record.block_size)
        reserve = Reserved(len(request.prompt_token_ids), 1, blocks)
        return Placed((Placement(worker, "mixed", "", reserve),))
