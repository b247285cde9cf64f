"""The block pool: prefix reuse, reference counts, LRU eviction only when room is needed."""

from __future__ import annotations

from splitbus.bus.blocks import block_hashes
from splitbus.bus.messages.kv_events import BlockRemoved, BlockStored, block_hash
from splitbus.worker.engines.prefix import BlockPool, PagedBlocks
from splitbus.worker.engines.sim import SimEngine

PROMPT = list(range(40))  # two full blocks of 16 and 8 tokens


def _hex(tokens: list[int]) -> list[str]:
    """The chain of ``tokens``' full blocks as the events carry it."""
    return [block_hash(h) for h in block_hashes(tokens, 16)]


def _finish(pool: BlockPool, tokens: list[int]) -> list[int]:
    got = pool.allocate(-(-len(tokens) // 16), tokens)
    assert got is not None
    pool.store(got.table, tokens)
    pool.release(got.table)
    return got.table


def test_a_second_prompt_takes_the_cached_full_blocks() -> None:
    pool = BlockPool(range(1, 11), 16)
    first = _finish(pool, PROMPT)
    got = pool.allocate(3, PROMPT + [99])
    assert got is not None and got.cached_tokens == 32
    assert got.table[:2] == first[:2] and got.table[2] not in first[:2]


def test_the_last_token_is_always_computed() -> None:
    pool = BlockPool(range(1, 11), 16)
    _finish(pool, PROMPT[:32])
    got = pool.allocate(2, PROMPT[:32])
    assert got is not None and got.cached_tokens == 16


def test_shared_blocks_are_counted_and_stay_held() -> None:
    pool = BlockPool(range(1, 5), 16)
    _finish(pool, PROMPT)
    a, b = pool.allocate(3, PROMPT), pool.allocate(1, PROMPT)
    assert a is not None and b is not None and b.table == a.table[:1]
    pool.release(b.table)
    assert pool.allocate(2) is None  # a still holds its 3 blocks: one is free
    pool.release(a.table)
    assert pool.free == 4


def test_cached_blocks_are_evicted_only_when_needed_and_oldest_first() -> None:
    pool = BlockPool(range(1, 5), 16)
    _finish(pool, PROMPT[:32])  # caches 2 blocks
    got = pool.allocate(2)
    assert got is not None and pool.cached_blocks == 2  # the plain free blocks went first
    pool.release(got.table)
    got = pool.allocate(3)
    assert got is not None and pool.cached_blocks == 1
    assert pool.events.pending()[-1] == BlockRemoved([_hex(PROMPT[:32])[1]])
    # the prefix's later block went first: its first block still matches
    assert len(pool.match(PROMPT)) == 1


def test_a_failed_allocation_takes_nothing() -> None:
    pool = BlockPool(range(1, 4), 16)
    _finish(pool, PROMPT)
    assert pool.allocate(5, PROMPT) is None
    assert pool.free == 3 and pool.cached_blocks == 2


def test_a_stored_chain_is_one_event_and_a_reused_prefix_is_its_parent() -> None:
    pool = BlockPool(range(1, 11), 16)
    _finish(pool, PROMPT)
    chain = _hex(PROMPT[:32] + [7] * 20)
    assert pool.events.pending() == [BlockStored(chain[:2], "", 16)]
    _finish(pool, PROMPT[:32] + [7] * 20)  # its first two blocks came from the cache
    assert pool.events.pending()[1:] == [BlockStored(chain[2:], chain[1], 16)]


def test_a_store_skipping_a_held_hash_records_contiguous_runs_and_evictions_in_order() -> None:
    tokens = list(range(48))
    chain = _hex(tokens)
    pool = BlockPool(range(1, 5), 16)
    got = pool.allocate(2)
    assert got is not None
    pool.store(got.table, tokens[:32])
    pool.release(got.table[:1])  # freed first: evicted first
    pool.release(got.table[1:])
    fresh = pool.allocate(3)  # two plain blocks, then the cached first block
    assert fresh is not None
    pool.store(fresh.table, tokens)  # the second block's hash is still held by the other block
    assert pool.events.pending() == [
        BlockStored(chain[:2], "", 16),
        BlockRemoved(chain[:1]),
        BlockStored(chain[:1], "", 16),
        BlockStored(chain[2:], chain[1], 16),
    ]


def test_only_the_events_sent_are_cleared() -> None:
    pool = BlockPool(range(1, 11), 16)
    _finish(pool, PROMPT)
    sending = pool.events.pending()
    _finish(pool, list(range(100, 140)))  # recorded while the first batch was on its way
    pool.events.sent(len(sending))
    assert pool.events.pending() == [BlockStored(_hex(list(range(100, 140))), "", 16)]
    pool.events.sent(1)
    assert pool.events.pending() == [] and len(pool.events) == 0


def test_a_sibling_reserved_before_the_prefix_was_stored_takes_it_at_its_prefill() -> None:
    pool = BlockPool(range(1, 11), 16)
    first = pool.allocate(3, PROMPT)  # both reserve before either is computed: nothing cached yet
    sibling = pool.allocate(3, PROMPT + [7])
    assert first is not None and sibling is not None and sibling.cached_tokens == 0
    assert pool.first_to_compute(PROMPT, 0) == pool.first_to_compute(PROMPT + [7], 0) == block_hashes(PROMPT, 16)[0]
    pool.store(first.table, PROMPT)  # the first one's prefill
    free = pool.free
    table = list(sibling.table)
    assert pool.rematch(table, PROMPT + [7], 0) == 32
    assert table[:2] == first.table[:2] and table[2] == sibling.table[2]
    assert pool.free == free + 2  # its own two fresh blocks went back
    assert pool.first_to_compute(PROMPT + [7], 32) is None  # the 9 tokens left make no full block to share
    pool.release(first.table)
    pool.release(table)
    assert pool.free == 10


SHARED = {
    "free_blocks",
    "reserve",
    "can_reserve",
    "cached_prefix",
    "release",
    "first_to_compute",
    "fork",
    "share_imported",
    "store_imported",
}
"""The ``Engine`` methods over the block pool, written once in ``PagedBlocks``."""


def keeps_its_blocks_in_the_one_pool(engine: type) -> bool:
    """Whether ``engine`` takes every block method from ``PagedBlocks`` and defines none itself
    (the paddle engine's test asks it too)."""
    return issubclass(engine, PagedBlocks) and not SHARED & set(vars(engine))


def test_the_sim_engine_keeps_its_blocks_in_the_one_block_pool() -> None:
    assert SHARED <= set(vars(PagedBlocks))
    assert keeps_its_blocks_in_the_one_pool(SimEngine)
    assert not keeps_its_blocks_in_the_one_pool(BlockPool)


def test_a_shared_table_goes_back_once_every_holder_released_it() -> None:
    pool = BlockPool(range(10), 16)
    first = pool.allocate(3)
    assert first is not None
    pool.share(first.table)
    pool.share(first.table)
    assert pool.free == 7
    pool.release(first.table)
    pool.release(first.table)
    assert pool.free == 7  # one holder left
    pool.release(first.table)
    assert pool.free == 10
