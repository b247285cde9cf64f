"""mixed: each request prefills and decodes on one ``mixed`` worker, which reserves its prompt
tokens and its blocks: among those with KV room, the one with the lowest ``mixed_cost`` (its
prefill cost in blocks, the prompt tokens it holds cached credited, plus the KV blocks its
requests hold).
"""

from __future__ import annotations

from collections.abc import Sequence

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.records import Reserved
from splitbus.bus.registry import WorkerInfo
from splitbus.bus.roles import Phase, Role
from splitbus.placement.costs import blocks_needed
from splitbus.placement.decision import Decision, Placed, Placement, no_room
from splitbus.placement.ledger import Local
from splitbus.placement.policies import register
from splitbus.placement.policies.base import Policy, PolicyOptions
from splitbus.placement.prefixes import NO_PREFIXES, Prefixes


@register("mixed")
class MixedPolicy(Policy):
    def __init__(self, options: PolicyOptions | None = None, prefixes: Prefixes = NO_PREFIXES) -> None:
        super().__init__(options, prefixes)
        from splitbus.placement import columns  # numpy: when a policy is made, not when the CLI lists them

        self.columns = columns
        self.tables = columns.Tables()

    def place(self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> Decision:
        table = self.tables(workers, request.model, Role.MIXED)
        loads = table.loads(local)
        roomy = table.roomy(request, loads)
        bound = self.options.max_queued_prefill_tokens
        rows = table.open_queues(roomy, loads, bound, request.priority)
        cached = self.cached(request, table.candidates)
        costs = self.columns.mixed_costs(table, loads, rows, request, cached, self.options.cost)
        row = self.columns.pick(rows, costs, self.rng)
        if row is None:
            every_full = not len(table.open_queues(table.every(), loads, bound, request.priority))  # a smaller one?
            return no_room(request.model, Role.MIXED, len(roomy), model_wide=every_full)
        worker = table.workers[row]
        blocks = blocks_needed(request, worker.record.block_size)
        # what it computes: the prompt less what it holds cached (or will: a sibling routed there)
        reserve = Reserved(len(request.prompt_token_ids) - cached.get(worker.record.worker_id, 0), 1, blocks)
        return Placed((Placement(worker, Phase.MIXED, "", reserve),))
