"""Speculative decoding and the connector, with vLLM's own VllmConfig and SpeculativeConfig and a
real daemon. A drafter whose layers have KV in the blocks (EAGLE, a draft model) puts its own KV
in every block the connector pages: another drafter's, or none, is other bytes, so each gets a
namespace of its own. EAGLE writes a block's last slot of the drafter's KV with the token after
the block, which another request sharing the block need not have: vLLM's prefix cache drops the
last block of each hit then, and the connector drops the last block of its own hits too.
Runs in .venv-vllm (./scripts/test.sh --with-vllm)."""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm: ./scripts/test.sh --with-vllm")

from conftest import small_kv, sweep_crashed  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvcached_client import launch  # noqa: E402
from kvcached_client.vllm.connector import KvcachedConnector, _ReqState  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import vllm_driver  # noqa: E402

from vllm_configs import scheduler_connector  # noqa: E402
from vllm_model import write_model  # noqa: E402

vllm_driver.overlap_engines()  # engine after engine: each starts warm and stops behind

BS = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target's checkpoint and two drafts (the same shape, other random weights)."""
    root = tmp_path_factory.mktemp("models")
    return [write_model(str(root / name), seed=seed) for seed, name in enumerate(("target", "a", "b"))]


def _connector(models, instance="unused", run_dir="/nonexistent", **spec) -> KvcachedConnector:
    """The connector's scheduler side under vLLM's own config (method and draft as given)."""
    return scheduler_connector(models[0], instance, run_dir, BS, **spec)


def test_a_drafter_with_kv_in_the_blocks_has_a_namespace_of_its_own(models):
    """EAGLE with draft a, EAGLE with draft b, draft a as a draft model, and no drafter page
    other bytes: four namespaces. The same drafter again gives the same one; n-gram proposals
    have no KV and leave the namespace as it is without speculation."""
    _target, a, b = models
    made = []

    def namespace(**spec) -> str:
        made.append(_connector(models, **spec))
        return made[-1].namespace

    try:
        plain, eagle_a = namespace(), namespace(method="eagle", model=a)
        names = {plain, eagle_a, namespace(method="eagle", model=b),
                 namespace(method="draft_model", model=a)}
        assert len(names) == 4
        assert namespace(method="eagle", model=a) == eagle_a
        assert namespace(method="ngram", prompt_lookup_max=3) == plain
        assert "-sd:" in eagle_a and "-sd:" not in plain
    finally:
        for conn in made:
            conn.link.close()


def test_an_eagle_hit_drops_its_last_block_as_vllms_own_hits_do(models, daemon):
    """Four blocks of a request's prompt in the daemon: under EAGLE the connector answers three
    (the fourth block's last drafter slot holds the token after it, which this request need
    not have); with vLLM's block drop turned off (`disable_eagle_block_drop`, the same
    namespace) all four - the control; a draft model (KV of tokens alone) all four too."""
    _target, a, _b = models
    eagle = _connector(models, daemon.instance, daemon.run_dir, method="eagle", model=a)
    kept = _connector(models, daemon.instance, daemon.run_dir, method="eagle", model=a,
                      disable_eagle_block_drop=True)
    draft = _connector(models, daemon.instance, daemon.run_dir, method="draft_model", model=a)
    assert eagle.namespace == kept.namespace and (eagle.drop_last, kept.drop_last) == (1, 0)
    tokens = [(i * 53 + 7) % 900 for i in range(6 * BS + 3)]

    def stored(conn) -> None:
        keys = KvcachedConnector._keys(conn, _ReqState(_request(tokens)), 4)
        kv = small_kv(block_shape=(BS, 2, 8))
        with daemon.connect() as c:
            c.register_kv_cache(kv)
            c.offload(list(range(4)), conn.key_scheme.daemon_keys(keys)).wait(10)

    stored(eagle)
    stored(draft)
    try:
        assert eagle.get_num_new_matched_tokens(_request(tokens), 0) == (3 * BS, False)
        assert kept.get_num_new_matched_tokens(_request(tokens), 0) == (4 * BS, False)
        assert draft.get_num_new_matched_tokens(_request(tokens), 0) == (4 * BS, False)
        # a local hit of one block: the connector's part ends one block short of the stored four
        assert eagle.get_num_new_matched_tokens(_request(tokens), BS) == (2 * BS, False)
    finally:
        for conn in (eagle, kept, draft):
            conn.link.close()


def _request(tokens) -> Request:
    return Request(f"r{len(tokens)}", tokens, SamplingParams(max_tokens=1), None)


@pytest.mark.timeout(600)
def test_an_eagle_engines_hit_is_one_block_short_and_its_output_is_vllms_own(tmp_path, run_dir, instance):
    """A real vLLM engine (CPU) with an EAGLE drafter and real random weights. A stored the
    shared prefix (14 blocks); after vLLM dropped its own cache, B found 13 of them in kvcached:
    the 14th block's last drafter slot was written with A's next token, not B's. B's greedy
    output equals an engine without the connector whose own prefix cache hit B's prefix (vLLM
    drops that block too: 13 blocks), while the one-token-changed control X differs."""
    blocks, block = vllm_driver.PREFIX_BLOCKS, vllm_driver.BLOCK
    draft = str(tmp_path / "eagle")
    ref = vllm_driver.EngineProcess(str(tmp_path / "ref"), "--connector", "none", "--inproc",
                                    "--eagle", draft)
    try:
        own = ref.step("genk", f"B {blocks}")
        control = ref.gen("X")["tokens"]
    finally:
        ref.close()
    assert own["num_cached_tokens"] == (blocks - 1) * block, own  # vLLM's own EAGLE drop
    assert control != own["tokens"]
    daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.2)
    eng = vllm_driver.EngineProcess(str(tmp_path / "model"), "--connector", "kvcached", "--inproc",
                                    "--instance", instance, "--run-dir", run_dir, "--eagle", draft
                                    ).saves_go_to(daemon)
    try:
        vllm_driver.wait_attached(daemon)
        assert eng.gen("A")["num_cached_tokens"] == 0
        b = eng.gen("B")
        assert b["reset"] and b["num_cached_tokens"] == (blocks - 1) * block, b
        assert b["tokens"] == own["tokens"]
        # loaded, not recomputed: the drafter's layer waited for its load too (vLLM defers the
        # connector's end of step until the drafter ran; a layer never waited fails the load)
        counters = eng.step("counters", "")["counters"][0]
        assert counters["loaded_blocks"] == blocks - 1 and counters["load_errors"] == 0, counters
    finally:
        eng.close()
        daemon.stop()
        sweep_crashed(instance)
