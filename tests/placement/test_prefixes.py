"""The prefix view a policy reads (pure logic): cached tokens from the KV index, by block size,
and where a routed request's siblings find its prompt before the worker's events arrive."""

from __future__ import annotations

import random
import weakref
from collections import Counter

from splitbus.bus.blocks import block_hashes, chain_hex, root_of, split_hex
from splitbus.bus.messages import GenerateRequest, SamplingParams
from splitbus.bus.messages.kv_events import BlockStored, KvEventBatch, block_hash
from splitbus.bus.records import WorkerLoad
from splitbus.bus.registry import WorkerInfo, WorkerRecord
from splitbus.placement.decision import Placed
from splitbus.placement.kv_index import KvIndex
from splitbus.placement.ledger import Ledger, Local
from splitbus.placement.policies import create
from splitbus.placement.policies.base import PolicyOptions
from splitbus.placement.prefixes import Candidates, IndexPrefixes


def _worker(wid: str, block_size: int = 16) -> WorkerInfo:
    load = WorkerLoad(free_kv_blocks=1000, total_kv_blocks=1000)
    return WorkerInfo(WorkerRecord(worker_id=wid, role="prefill", model="m", block_size=block_size, load=load), 0, 3000)


def _request(tokens: list[int], rid: str = "r") -> GenerateRequest:
    return GenerateRequest(rid, "m", tokens, SamplingParams(max_tokens=8), "api", 0)


def _stores(index: KvIndex, worker: str, tokens: list[int], block_size: int = 16) -> None:
    chain = [block_hash(h) for h in block_hashes(tokens, block_size)]
    index.apply(worker, "1-0", KvEventBatch(worker, "i", 1, [BlockStored(chain, "", block_size)]))


def test_cached_tokens_are_the_leading_blocks_held_less_the_last_prompt_token() -> None:
    rng = random.Random(1)
    prefix = [rng.randrange(1000) for _ in range(64)]
    index = KvIndex()
    _stores(index, "w0", prefix)  # 4 blocks
    _stores(index, "w1", prefix[:32])
    _stores(index, "w2", prefix, block_size=32)  # its own block size: its own chain
    prefixes = IndexPrefixes(index)
    workers = Candidates.of([_worker("w0"), _worker("w1"), _worker("w2", 32), _worker("w3")])
    assert prefixes.cached(_request(prefix + [7, 8]), workers) == {"w0": 64, "w1": 32, "w2": 64}
    # the engine computes a prompt's last token itself: a prompt of exactly 4 blocks reuses 3
    assert prefixes.cached(_request(prefix, "r2"), workers) == {"w0": 48, "w1": 32, "w2": 32}
    assert prefixes.cached(_request([5] * 64, "r3"), workers) == {}


def test_a_routed_request_is_predicted_on_its_worker_for_its_siblings() -> None:
    index = KvIndex()
    prefixes = IndexPrefixes(index, predict_s=5.0)
    first, sibling = _request(list(range(100)) + [1], "a"), _request(list(range(100)) + [2], "b")
    w0 = _worker("w0")
    prefixes.routed(first, w0)
    assert prefixes.cached(sibling, Candidates.of([w0, _worker("w1")])) == {"w0": 96}


def test_a_routed_request_is_not_kept_alive() -> None:
    """Its chain is kept while it waits (a waiting request is asked about at every decision) and
    dropped once it is routed: kept, the last CHAINS_KEPT decided requests would live on into the
    garbage collector's oldest generation."""
    prefixes = IndexPrefixes(KvIndex())
    request, w0 = _request(list(range(100)), "a"), _worker("w0")
    assert prefixes.cached(request, Candidates.of([w0, _worker("w1", 32)])) == {}  # a chain per block size
    assert prefixes.chain(request, 16) is prefixes.chain(request, 16)  # kept while it waits
    alive = weakref.ref(request)
    prefixes.routed(request, w0)
    del request
    assert alive() is None


def test_a_burst_of_siblings_mostly_lands_on_one_worker() -> None:
    """16 requests sharing a 1,500-token prefix arrive before any worker's events: each decision
    sees the earlier ones' predictions (and their reservations, as the scheduler keeps them)."""
    rng = random.Random(3)
    prefix = [rng.randrange(1000) for _ in range(1500)]
    workers = [_worker(f"p{i}") for i in range(8)]
    prefixes = IndexPrefixes(KvIndex())
    policy = create("splitwise", PolicyOptions(rng=random.Random(0)), prefixes)
    decode = WorkerInfo(
        WorkerRecord(worker_id="d", role="decode", model="m", load=WorkerLoad(free_kv_blocks=10**6)), 0, 3000
    )
    local: Local = {}
    ledger = Ledger(local)
    chosen = []
    for i in range(16):
        request = _request(prefix + [rng.randrange(1000) for _ in range(300)], f"r{i}")
        plan = policy.place(request, [*workers, decode], local)
        assert isinstance(plan, Placed)
        for placement in plan.placements:
            ledger.reserve(placement)
            if placement.phase == "prefill":
                prefixes.routed(request, placement.worker)
                chosen.append(placement.worker.record.worker_id)
    assert Counter(chosen).most_common(1)[0][1] >= 12


def test_the_chain_the_api_sent_is_the_one_hashed_here() -> None:
    tokens = list(range(1000, 1100))
    sent = _request(tokens)
    sent.prefix_hashes, sent.prefix_block_size = chain_hex(tokens[:-1], 16), 16
    here = IndexPrefixes(KvIndex())
    assert here.chain(sent, 16) == here.chain(_request(tokens, "other"), 16) == split_hex(sent.prefix_hashes)
    assert len(here.chain(sent, 16)) == 6 and here.chain(sent, 32) == here.chain(_request(tokens, "x"), 32)


def test_routing_follows_a_salted_chain_only_to_its_own_salts_blocks() -> None:
    """A worker stores a salted prompt (its events carry the salted chain); a request with the
    same salt finds it there, by the API's chain or by the one hashed here for another block
    size, and one with another salt or none does not."""
    tokens, salt = list(range(2000, 2100)), "3c" * 16
    index = KvIndex()
    for worker, size in (("w16", 16), ("w32", 32)):
        chain = [block_hash(h) for h in block_hashes(tokens, size, parent=root_of(salt))]
        index.apply(worker, "1-0", KvEventBatch(worker, "i", 1, [BlockStored(chain, "", size)]))
    prefixes = IndexPrefixes(index)
    workers = Candidates.of([_worker("w16"), _worker("w32", 32)])
    sent = _request(tokens + [1], "salted")
    sent.cache_salt, sent.prefix_hashes, sent.prefix_block_size = salt, chain_hex(tokens, 16, salt=salt), 16
    assert prefixes.cached(sent, workers) == {"w16": 96, "w32": 96}
    other = _request(tokens + [1], "other")
    other.cache_salt = "c3" * 16
    assert prefixes.cached(other, workers) == {} == prefixes.cached(_request(tokens + [1], "plain"), workers)
