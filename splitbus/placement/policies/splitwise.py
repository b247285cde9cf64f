"""splitwise: each request prefills on one worker and decodes on another (the default).

D is the ``decode`` worker with the most free KV blocks (then the fewest active requests); P the
``prefill`` worker with the lowest prefill cost (queued prefill tokens plus the prompt tokens it
does not hold cached, ``prefill_cost``). D reserves the request's blocks, P its prompt tokens.

With conditional disaggregation on (``PolicyOptions.disagg``), D is the decode worker with the
lowest ``mixed_cost`` (so a conversation's next turn finds the D that holds its history), and a
request whose uncached prompt is short on D, or that finds every prefill worker busy, prefills on
D itself: one ``mixed`` task there (``splitbus.placement.disagg``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.records import Reserved
from splitbus.bus.registry import WorkerInfo
from splitbus.bus.roles import Phase, Role
from splitbus.placement.costs import blocks_needed
from splitbus.placement.decision import Decision, NoPlacement, Placed, Placement, no_room
from splitbus.placement.disagg import split
from splitbus.placement.ledger import Local
from splitbus.placement.policies import register
from splitbus.placement.policies.base import Policy, PolicyOptions
from splitbus.placement.prefixes import NO_PREFIXES, Prefixes

if TYPE_CHECKING:
    from splitbus.placement.columns import Loads, LoadTable


@register("splitwise")
class SplitwisePolicy(Policy):
    def __init__(self, options: PolicyOptions | None = None, prefixes: Prefixes = NO_PREFIXES) -> None:
        super().__init__(options, prefixes)
        from splitbus.placement import columns  # numpy: when a policy is made, not when the CLI lists them

        self.columns = columns
        self.tables = columns.Tables()

    def place(self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> Decision:
        prefills = self.tables(workers, request.model, Role.PREFILL)
        decodes = self.tables(workers, request.model, Role.DECODE)
        cached = {**self.cached(request, prefills.candidates), **self.cached(request, decodes.candidates)}
        p_loads, d_loads = prefills.loads(local), decodes.loads(local)
        row = self._decode(request, decodes, d_loads, cached)
        if row is None:
            missing = Role.PREFILL if not len(prefills) else Role.DECODE
            return NoPlacement(f"no live {missing} worker with room serves model '{request.model}'")
        decode = decodes.workers[row]
        tokens = len(request.prompt_token_ids)
        blocks = blocks_needed(request, decode.record.block_size)
        queues = p_loads.queued.tolist() if self.options.disagg.enabled else []
        where = split(self.options.disagg, request, decode, cached.get(decode.record.worker_id, 0), queues, local)
        if where.count().local:
            uncached = tokens - cached.get(decode.record.worker_id, 0)
            return Placed((Placement(decode, Phase.MIXED, "", Reserved(uncached, 1, blocks)),))
        bound = self.options.max_queued_prefill_tokens
        every = prefills.open_queues(prefills.every(), p_loads, bound, request.priority)
        costs = self.columns.prefill_costs(prefills, p_loads, every, request, cached, self.options.cost)
        chosen = self.columns.pick(every, costs, self.rng)
        if chosen is None:
            # with disaggregation off, whether P has room does not depend on the request
            return no_room(request.model, Role.PREFILL, len(prefills), model_wide=not self.options.disagg.enabled)
        prefill = prefills.workers[chosen]
        return Placed(
            (
                Placement(
                    decode,
                    Phase.DECODE,
                    prefill.record.worker_id,
                    Reserved(reserved_requests=1, reserved_kv_blocks=blocks),
                ),
                Placement(
                    prefill,
                    Phase.PREFILL,
                    decode.record.worker_id,
                    Reserved(reserved_prefill_tokens=tokens - cached.get(prefill.record.worker_id, 0)),
                ),
            )
        )

    def _decode(self, request: GenerateRequest, decodes: LoadTable, loads: Loads, cached: dict[str, int]) -> int | None:
        """By free KV blocks; by ``mixed_cost`` when D may prefill (its cache then counts)."""
        if not self.options.disagg.enabled:
            return self.columns.decode_row(decodes, loads, request, self.rng)
        rows = decodes.roomy(request, loads)
        costs = self.columns.mixed_costs(decodes, loads, rows, request, cached, self.options.cost)
        return self.columns.pick(rows, costs, self.rng)
