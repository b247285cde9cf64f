"""splitwise: each request prefills on one worker and decodes on another (the default).

P is the ``prefill`` worker with the fewest queued prefill tokens, D the ``decode`` worker with the
most free KV blocks (then the fewest active requests); D reserves the request's blocks, P its
prompt tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitbus.bus.messages import GenerateRequest
from splitbus.bus.registry import Reserved, WorkerInfo
from splitbus.scheduler.placement import (
    Eligible,
    Local,
    Placement,
    blocks_needed,
    choose,
    decode_worker,
    queued_prefill,
    reserved,
)
from splitbus.scheduler.policies import register
from splitbus.scheduler.policies.base import Decision, NoPlacement, Placed, Policy, PolicyOptions


@register("splitwise")
class SplitwisePolicy(Policy):
    def __init__(self, options: PolicyOptions | None = None) -> None:
        super().__init__(options)
        self.eligible = Eligible()

    def place(self, request: GenerateRequest, workers: Sequence[WorkerInfo], local: Local) -> Decision:
        decode = decode_worker(request, self.eligible(workers, request.model, "decode"), local, self.rng)
        prefill = choose(
            self.eligible(workers, request.model, "prefill"), lambda w: queued_prefill(w, reserved(local, w)), self.rng
        )
        if prefill is None or decode is None:
            missing = "prefill" if prefill is None else "decode"
            return NoPlacement(f"no live {missing} worker with room serves model '{request.model}'")
        tokens = len(request.prompt_token_ids)
        blocks = blocks_needed(request, decode.record.block_size)
        return Placed(
            (
                Placement(
                    decode, "decode", prefill.record.worker_id, Reserved(reserved_requests=1, reserved_kv_blocks=blocks)
                ),
                Placement(prefill, "prefill", decode.record.worker_id, Reserved(reserved_prefill_tokens=tokens)),
            )
        )
