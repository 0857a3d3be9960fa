"""Trace replay through the daemon's real index, and the eviction policies it compares."""
import json
import os
import subprocess
import sys

import pytest

from kvcached.tools import tracegen
from kvcached.tools.replay import load_trace, replay_in_process, replay_through_daemon

SHARED_TRACE = os.path.join(os.path.dirname(__file__), "data", "mooncake_synthetic_trace.jsonl")
needs_trace = pytest.mark.skipif(not os.path.exists(SHARED_TRACE), reason="the trace is not in tests/data")


@pytest.fixture(scope="module")
def mooncake():
    return load_trace(SHARED_TRACE)


@needs_trace
@pytest.mark.parametrize("capacity, published", [(100_000, 1.7), (1_000_000, 14.5),
                                                 (3_000_000, 31.5), (10_000_000, 57.7)])
def test_leaf_first_lru_reproduces_the_published_figures(mooncake, capacity, published):
    assert round(100 * replay_in_process(mooncake, capacity, "lru").hit_rate, 1) == published


@needs_trace
@pytest.mark.parametrize("capacity", [1_000_000, 3_000_000, 10_000_000])
def test_s2lru_beats_lru_on_the_mooncake_trace(mooncake, capacity):
    lru = replay_in_process(mooncake, capacity, "lru").hit_rate
    s2 = replay_in_process(mooncake, capacity, "s2lru").hit_rate
    assert s2 > lru + 0.01


@pytest.mark.parametrize("pattern", ["documents", "scan"])
def test_s2lru_beats_lru_on_generated_traces_with_one_time_blocks(tmp_path, pattern):
    path = str(tmp_path / "t.jsonl")
    tracegen.write(path, tracegen.generate(pattern, requests=2000, seed=1))
    trace = load_trace(path)
    capacity = int(sum(len(r.hash_ids) for r in trace) * 0.02) * 512
    assert (replay_in_process(trace, capacity, "s2lru").hit_rate
            > replay_in_process(trace, capacity, "lru").hit_rate)


@needs_trace
def test_offline_references_bound_the_online_policies_on_the_mooncake_trace(mooncake):
    cap = 1_000_000
    got = {p: 100 * replay_in_process(mooncake, cap, p).hit_rate
           for p in ("lru", "s2lru", "oracle-features", "oracle-reuse", "belady")}
    # the traces README lists 38.3 % for the optimum here; ties between blocks requested at
    # the same time next are broken differently, the figure moves by a few tenths
    assert 37.0 < got["belady"] <= 38.3
    assert got["belady"] > got["oracle-reuse"] > got["oracle-features"] > got["s2lru"] > got["lru"]


@pytest.mark.parametrize("pattern", ["documents", "scan", "multiturn"])
def test_belady_is_never_beaten_on_generated_traces(tmp_path, pattern):
    path = str(tmp_path / "t.jsonl")
    tracegen.write(path, tracegen.generate(pattern, requests=1500, seed=4))
    trace = load_trace(path)
    capacity = int(sum(len(r.hash_ids) for r in trace) * 0.02) * 512
    best = replay_in_process(trace, capacity, "belady").hit_rate
    for policy in ("lru", "s2lru", "oracle-reuse", "oracle-features"):
        assert replay_in_process(trace, capacity, policy).hit_rate <= best


def test_hit_is_leading_blocks_capped_at_input_length(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2]},
            {"timestamp": 1, "input_length": 700, "output_length": 1, "hash_ids": [1, 3]},
            {"timestamp": 2, "input_length": 900, "output_length": 1, "hash_ids": [1, 2]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    r = replay_in_process(load_trace(str(path)), 10 * 512, "lru")
    assert r.hit_tokens == 512 + 900 and r.input_tokens == 2600


@pytest.mark.parametrize("parts", [(0, True), (2, True), (2, False)], ids=["whole", "parts", "unlinked"])
def test_through_the_daemon_matches_the_in_process_replay(tmp_path, parts):
    """Offloaded whole, or in parts of 2 blocks naming the block before them (protocol 1.15) or
    not: the daemon evicts as the in-process model of it does."""
    path = str(tmp_path / "t.jsonl")
    tracegen.write(path, tracegen.generate("documents", requests=300, seed=2))
    trace = load_trace(path)
    capacity = 300 * 512
    for policy in ("lru", "s2lru"):
        here = replay_in_process(trace, capacity, policy, part_blocks=parts[0], linked=parts[1])
        there = replay_through_daemon(trace, capacity, policy, part_blocks=parts[0], linked=parts[1])
        assert (there.hit_tokens, there.evictions) == (here.hit_tokens, here.evictions)


@needs_trace
@pytest.mark.parametrize("policy", ["lru", "s2lru"])
def test_saves_in_parts_that_name_their_parent_hit_as_one_offload_does(mooncake, policy):
    """The Mooncake trace at 1e6 tokens, each request's blocks past its hit saved in parts of 16
    (vLLM's chunked prefill of 8,192 tokens): naming the block before each part hits exactly as
    one offload does; unnamed (before protocol 1.15), the parts lose hits (an earlier part's
    tail went before the later part, which no lookup reached after)."""
    whole = replay_in_process(mooncake, 1_000_000, policy)
    linked = replay_in_process(mooncake, 1_000_000, policy, part_blocks=16)
    unlinked = replay_in_process(mooncake, 1_000_000, policy, part_blocks=16, linked=False)
    assert linked.hit_tokens == whole.hit_tokens
    assert unlinked.hit_rate < linked.hit_rate - 0.002


def test_a_bad_trace_line_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_length": 5}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(str(path))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvcached", "replay", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_lists_policies_and_prints_json(tmp_path):
    out = _cli("--list-policies")
    names = out.stdout.split()
    assert out.returncode == 0 and {"lru", "s2lru", "belady", "oracle-reuse", "oracle-features"} <= set(names)
    path = str(tmp_path / "t.jsonl")
    tracegen.write(path, tracegen.generate("scan", requests=200, seed=3))
    out = _cli(path, "--capacity-tokens", "20000", "50000", "--policy", "lru,s2lru", "--json")
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)["results"]
    assert [(r["capacity_tokens"], r["policy"]) for r in results] == [
        (20000, "lru"), (50000, "lru"), (20000, "s2lru"), (50000, "s2lru")]
    assert all(0 <= r["hit_rate"] <= 1 for r in results)
    assert "[replay]" in out.stderr  # progress
    assert _cli(path, "--policy", "nope").returncode == 2
    assert _cli(path, "--save-blocks", "-1").returncode == 2
    parts = _cli(path, "--capacity-tokens", "20000", "--save-blocks", "4", "--unlinked-saves", "--json")
    assert parts.returncode == 0, parts.stderr
    assert (json.loads(parts.stdout)["save_blocks"], json.loads(parts.stdout)["linked_saves"]) == (4, False)
    offline = _cli(path, "--policy", "belady", "--through-daemon")
    assert offline.returncode == 2 and "cannot run them" in offline.stderr
