"""The stable hashes, the rows made from ids, and the hash index against a dict (hypothesis)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardvar import ShardvarTypeError, ShardvarValueError
from shardvar.dynamic import IdInitializer, as_keys, hash_strings, mix64, shard_of
from shardvar.dynamic._index import HashIndex

MASK = (1 << 64) - 1


def _splitmix64(state: int) -> int:
    """The C reference's first output for ``state``, in Python integers."""
    z = (state + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _signed(u: int) -> int:
    return u - (1 << 64) if u >> 63 else u


def test_mix64_is_splitmix64() -> None:
    assert _splitmix64(0) == 0xE220A8397B1DCDAF  # splitmix64's published first output for seed 0
    assert int(mix64(torch.tensor(0))) == _signed(0xE220A8397B1DCDAF)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=20))
def test_mix64_matches_the_reference_on_any_int64(values: list[int]) -> None:
    assert mix64(torch.tensor(values)).tolist() == [_signed(_splitmix64(v & MASK)) for v in values]


def test_strings_hash_by_blake2b() -> None:
    digest = hashlib.blake2b(b"user:42", digest_size=8).digest()
    assert hash_strings(["user:42"]).tolist() == [int.from_bytes(digest, "little", signed=True)]
    assert as_keys([["a", "b"], ["c", "d"]]).shape == (2, 2)
    assert as_keys("é").shape == () and as_keys("é").item() == hash_strings(["é"]).item()
    with pytest.raises(ShardvarTypeError, match="mix strings"):
        as_keys(["a", 1])
    with pytest.raises(ShardvarValueError, match="rectangular"):
        as_keys([["a"], ["b", "c"]])


def test_rows_from_ids_do_not_depend_on_batch_or_width() -> None:
    init = IdInitializer(seed=3)
    keys = torch.tensor([5, -1, 2**62])
    rows = init(keys, 7, torch.float64)
    assert torch.equal(init(keys[[2, 0]], 7, torch.float64), rows[[2, 0]])
    assert torch.equal(init(keys, 4, torch.float64), rows[:, :4])
    assert not torch.equal(IdInitializer(seed=4)(keys, 7, torch.float64), rows)
    big = IdInitializer()(torch.arange(20000), 16, torch.float64)
    assert abs(big.mean()) < 0.01 and abs(big.std() - 1) < 0.01
    uniform = IdInitializer("uniform", bound=0.5)(torch.arange(20000), 4, torch.float64)
    assert uniform.abs().max() <= 0.5 and abs(uniform.std() - 0.5 / 3**0.5) < 0.01


def test_shards_spread_evenly() -> None:
    counts = torch.bincount(shard_of(torch.arange(80000) * 1024, 8), minlength=8)
    assert counts.min() > 9500 and counts.max() < 10500


@settings(max_examples=40, deadline=None)
@given(
    shards=st.integers(1, 3),
    ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(-5, 40), max_size=12)), min_size=1, max_size=10),
)
def test_index_against_a_dict(shards: int, ops: list[tuple[bool, list[int]]]) -> None:
    """Inserts and removals keep find equal to a dict, with forced collisions (8 buckets per shard)."""
    index = HashIndex(HashIndex.allocate(shards, 4), shards)
    index.start = lambda h, s: s * index.buckets + (h & 3)  # 4 homes in 8 buckets: keys collide and wrap
    truth: dict[int, int] = {}
    for insert, keys in ops:
        keys = sorted(set(keys))
        if insert:
            keys = [k for k in keys if k not in truth]
            room = {s: 4 - sum(1 for t in truth if t % shards == s) for s in range(shards)}
            keys = [k for k in keys if (room.__setitem__(k % shards, room[k % shards] - 1) or room[k % shards] >= 0)]
            slots = [i for i in range(64) if i not in truth.values()][: len(keys)]
            t = torch.tensor(keys, dtype=torch.int64)
            index.insert(t, index.start(mix64(t), t % shards), torch.tensor(slots, dtype=torch.int64))
            truth.update(zip(keys, slots, strict=True))
        else:
            gone = [k for k in keys if k in truth]
            t = torch.tensor(gone, dtype=torch.int64)
            _, where = index.find(t, index.start(mix64(t), t % shards))
            index.remove(where)
            for k in gone:
                del truth[k]
        probe = torch.arange(-5, 41)
        found, _ = index.find(probe, index.start(mix64(probe), probe % shards))
        assert found.tolist() == [truth.get(k, -1) for k in probe.tolist()]
