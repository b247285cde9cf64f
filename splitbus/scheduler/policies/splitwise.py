"""splitwise: each request prefills on one worker and decodes on another (the default).

D is the ``decode`` worker with the most free KV blocks (then the fewest active requests); P the
``prefill`` worker with the lowest prefill cost (queued prefill tokens plus the prompt tokens it
does not hold cached, ``prefill_cost``). D reserves the request's blocks, P its prompt tokens.

With conditional disaggregation on (``PolicyOptions.disagg``), D is the decode worker with the
lowest ``mixed_cost`` (so a conversation's next turn finds the D that holds its history), and a
request whose uncached prompt is short on D, or that finds every prefill worker busy, prefills on
D itself: one ``mixed`` task there (``splitbus.scheduler.disagg``).
"""

from __future__ import annotations

from collections.abc import Sequence

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.registry import Reserved, WorkerInfo
from splitbus.scheduler.disagg import split
from splitbus.scheduler.placement import (
    Eligible,
    Local,
    Placement,
    blocks_needed,
    choose,
    decode_worker,
    mixed_cost,
    prefill_cost,
    queued_prefill,
    reserved,
    roomy,
)
from splitbus.scheduler.policies import register
from splitbus.scheduler.policies.base import Decision, NoPlacement, Placed, Policy, PolicyOptions
from splitbus.scheduler.prefixes import NO_PREFIXES, Prefixes


@register("splitwise")
class SplitwisePolicy(Policy):
    def __init__(self, options: PolicyOptions | None = None, prefixes: Prefixes = NO_PREFIXES) -> None:
        super().__init__(options, prefixes)
        self.eligible = Eligible()

    def place(self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> Decision:
        prefills = self.eligible(workers, request.model, "prefill")
        decodes = self.eligible(workers, request.model, "decode")
        cached = self.cached(request, [*prefills, *decodes])
        decode = self._decode(request, decodes, cached, local)
        if decode is None:
            missing = "prefill" if not prefills else "decode"
            return NoPlacement(f"no live {missing} worker with room serves model '{request.model}'")
        queues = [queued_prefill(w, reserved(local, w)) for w in prefills]
        tokens = len(request.prompt_token_ids)
        blocks = blocks_needed(request, decode.record.block_size)
        where = split(self.options.disagg, request, decode, cached.get(decode.record.worker_id, 0), queues, local)
        if where.count().local:
            uncached = tokens - cached.get(decode.record.worker_id, 0)
            return Placed((Placement(decode, "mixed", "", Reserved(uncached, 1, blocks)),))
        prefill = choose(prefills, prefill_cost(prefills, request, cached, local, self.options.cost), self.rng)
        if prefill is None:
            return NoPlacement(f"no live prefill worker with room serves model '{request.model}'")
        return Placed(
            (
                Placement(
                    decode, "decode", prefill.record.worker_id, Reserved(reserved_requests=1, reserved_kv_blocks=blocks)
                ),
                Placement(
                    prefill,
                    "prefill",
                    decode.record.worker_id,
                    Reserved(reserved_prefill_tokens=tokens - cached.get(prefill.record.worker_id, 0)),
                ),
            )
        )

    def _decode(
        self, request: GenerateRequest, decodes: list[WorkerInfo], cached: dict[str, int], local: Local
    ) -> WorkerInfo | None:
        """By free KV blocks; by ``mixed_cost`` when D may prefill (its cache then counts)."""
        if not self.options.disagg.enabled:
            return decode_worker(request, decodes, local, self.rng)
        candidates = roomy(request, decodes, local)
        return choose(candidates, mixed_cost(candidates, request, cached, local, self.options.cost), self.rng)
