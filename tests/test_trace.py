"""Trace loading, the synthetic trace, and hit-rate replay through a real master and storage process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool import Store
from kvpool.errors import InvalidArgument, StoreError
from kvpool.store.trace import (
    block_key,
    block_value,
    find_shared_trace,
    ideal_hit_rate,
    load_trace,
    replay,
    run_hit_rate_study,
    synthetic_trace,
)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_trace_reads_hash_ids_and_skips_blank_lines(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 5, "input_length": 1600, "output_length": 3, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 9, "input_length": 0, "output_length": 1, "hash_ids": []},
    ]
    path = _write(
        tmp_path / "t.jsonl", [json.dumps(rows[0]), "", "   ", json.dumps(rows[1]), json.dumps(rows[2])]
    )
    assert load_trace(path) == [[0, 1], [0, 1, 2, 3], []]
    assert load_trace(str(path)) == [[0, 1], [0, 1, 2, 3], []]


@pytest.mark.parametrize(
    "bad",
    [
        '{"hash_ids": [0, 1',  # truncated JSON
        "[0, 1, 2]",  # not an object
        '{"timestamp": 3}',  # no hash_ids
        '{"hash_ids": "0,1"}',  # not a list
        '{"hash_ids": [0, "1"]}',  # not integers
        '{"hash_ids": [0, -1]}',  # negative
        '{"hash_ids": [true]}',  # bool is not an id
    ],
)
def test_load_trace_rejects_malformed_lines_with_line_number(tmp_path: Path, bad: str) -> None:
    path = _write(tmp_path / "t.jsonl", ['{"hash_ids": [0]}', "", bad, '{"hash_ids": [0, 1]}'])
    with pytest.raises(InvalidArgument, match=r":3:"):
        load_trace(path)


def test_find_shared_trace_searches_parents_of_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "shared" / "traces" / "conversation_trace.jsonl"
    trace.parent.mkdir(parents=True)
    _write(trace, ['{"hash_ids": [0]}'])
    deep = tmp_path / "repo" / "sub"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    assert find_shared_trace() == trace.resolve()


def test_find_shared_trace_result_is_a_file_or_none() -> None:
    found = find_shared_trace()
    assert found is None or (found.is_file() and found.name == "conversation_trace.jsonl")


def test_synthetic_trace_is_deterministic_and_multi_turn() -> None:
    a = synthetic_trace(500, 40, seed=7)
    assert a == synthetic_trace(500, 40, seed=7)
    assert a != synthetic_trace(500, 40, seed=8)
    assert len(a) == 500
    earlier: set[tuple[int, ...]] = set()
    seen: set[int] = set()
    first_turns = 0
    for ids in a:
        assert ids[0] == 0 and 2 <= len(ids) <= 64  # shared system prompt, bounded conversations
        assert len(set(ids)) == len(ids)
        # The longest earlier request that is a prefix of this one is the conversation's last turn.
        prefix = max((k for k in range(1, len(ids)) if tuple(ids[:k]) in earlier), default=1)
        if prefix == 1:  # a first turn: nothing but block 0 was seen before
            first_turns += 1
            assert not seen.intersection(ids[1:])
        else:  # a later turn: extends the previous turn by 1-4 new blocks
            assert 1 <= len(ids) - prefix <= 4
            assert not seen.intersection(ids[prefix:])
        earlier.add(tuple(ids))
        seen.update(ids)
    assert 40 <= first_turns < 250  # every slot starts once; most requests continue a conversation
    # Zipf-ish popularity: some conversations run for many turns.
    assert max(len(ids) for ids in a) >= 30


def test_ideal_hit_rate_counts_only_the_leading_run() -> None:
    assert ideal_hit_rate([]) == 0.0
    # [0,1] cold; [0,1,2]: 2 hits; [5,0]: 5 is new so the leading run is empty; [0,9]: 1 hit.
    assert ideal_hit_rate([[0, 1], [0, 1, 2], [5, 0], [0, 9]]) == pytest.approx(3 / 9)


def test_block_value_is_deterministic_and_distinct() -> None:
    assert block_value(1, 16) == b"\x01" + bytes(7) + b"\x01" + bytes(7)
    assert len(block_value(3, 100)) == 100
    assert block_value(2, 64) != block_value(3, 64)
    assert block_key(42) == "blk:42" and block_key(42, "x") == "x:42"


def test_replay_counts_hits_and_verifies_bytes() -> None:
    trace = [[0, 1, 2], [0, 1, 3], [0, 1, 2, 4], [7, 1], [0, 1, 2, 4]]
    with Store.connect(master=None, segment_size=4 << 20) as st:
        fractions: list[float] = []
        res = replay(st, trace, block_bytes=256, key_prefix="r", progress=fractions.append)
        assert res["requests"] == 5 and res["blocks"] == 16
        assert res["hit_blocks"] == 0 + 2 + 3 + 0 + 4
        assert res["hit_rate"] == pytest.approx(9 / 16) == pytest.approx(ideal_hit_rate(trace))
        assert res["prefix_hit_requests"] == 3
        assert res["failed_puts"] == 0 and res["evictions"] == 0 and res["lost_blocks"] == 0
        assert fractions[-1] == 1.0
        assert st.get("r:4") == block_value(4, 256)
        # A second pass finds everything.
        assert replay(st, trace, block_bytes=256, key_prefix="r")["hit_rate"] == 1.0
        # A block holding other bytes than its id's is a hard error.
        assert st.batch_put(["bad:0"], [block_value(1, 256)]) == [None]
        with pytest.raises(StoreError, match="differ"):
            replay(st, [[0, 5]], block_bytes=256, key_prefix="bad")
        with pytest.raises(InvalidArgument):
            replay(st, trace, block_bytes=0)


# The team's trace is used when ../shared is there (CI has it); the project never requires it.
_SOURCES = ["synthetic"] + (["shared"] if find_shared_trace() is not None else [])


@pytest.mark.parametrize("source", _SOURCES)
def test_hit_rate_study_through_master_and_storage_process(source: str) -> None:
    if source == "shared":
        shared = find_shared_trace()
        assert shared is not None
        trace = load_trace(shared)[:1500]
    else:
        trace = synthetic_trace(2000, 200, seed=0)
    unique = len({h for ids in trace for h in ids})
    big = 1 << (2 * unique - 1).bit_length()  # at least twice the distinct blocks: never evicts
    small = 256
    rows = run_hit_rate_study(trace, pool_blocks=(small, big), block_bytes=1024)
    assert [r["pool_blocks"] for r in rows] == [small, big]
    lo, hi = rows
    ideal = ideal_hit_rate(trace)
    for r in rows:
        assert r["ideal_hit_rate"] == pytest.approx(ideal)
        assert r["requests"] == len(trace) and r["blocks"] == sum(map(len, trace))
        assert r["pool_bytes"] == r["pool_blocks"] * 1024
        assert 0.0 <= r["hit_rate"] <= ideal + 1e-12
        assert r["hit_blocks"] <= r["blocks"] and r["prefix_hit_requests"] <= r["requests"]
    assert lo["evictions"] > 0
    assert lo["hit_rate"] < ideal
    # The big pool holds every block: nothing evicted, nothing refused, an infinite pool's hit rate.
    assert hi["evictions"] == 0 and hi["failed_puts"] == 0 and hi["lost_blocks"] == 0
    assert hi["hit_rate"] == pytest.approx(ideal)
    assert hi["hit_rate"] > lo["hit_rate"]
