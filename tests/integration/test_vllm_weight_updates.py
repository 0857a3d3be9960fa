"""vLLM's weights changed in place (its RL API, `reload_weights`, an RL framework's worker
extension) and the daemon's blocks: with a real vLLM engine (CPU), real random weights and a
real daemon. vLLM does not reset the connector for an update, and an RL loop resets vLLM's own
prefix cache only (`reset_prefix_cache()`): nothing stored before an update may be a hit after
it. Runs in .venv-vllm (./scripts/test.sh --with-vllm)."""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm: ./scripts/test.sh --with-vllm")
pytestmark = pytest.mark.timeout(600)

from conftest import sweep_crashed  # noqa: E402

from kvcached_client import launch  # noqa: E402
from kvcached_client.vllm import weight_updates  # noqa: E402
from kvcached_client.vllm.weight_updates import changes_weights  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import vllm_driver  # noqa: E402

from vllm_configs import scheduler_connector  # noqa: E402
from vllm_model import write_model  # noqa: E402

vllm_driver.overlap_engines()  # engine after engine: each starts warm and stops behind


def test_which_collective_rpcs_may_change_the_weights():
    """vLLM's RL calls and RL frameworks' worker extensions change weights; reads of them and
    other RPCs do not; a function may do anything, so it counts as a change."""
    for method in ("start_weight_update", "update_weights", "finish_weight_update",
                   "start_draft_weight_update", "reload_weights", "update_weights_from_ipc",
                   "update_weight", "load_model", "update_config", "reset_weights", print):
        assert changes_weights(method), method
    for method in ("compute_weight_checksums", "get_weight_version", "init_weight_transfer_engine",
                   "shutdown_weight_transfer_engine", "check_weights_changed", "synchronize_device",
                   "update_max_model_len", "reset_encoder_cache"):
        assert not changes_weights(method), method


def test_after_weights_change_in_place_nothing_stored_before_is_a_hit(tmp_path, run_dir, instance):
    """A stored the shared prefix; then the weights were loaded again in place
    (`collective_rpc("reload_weights")`) and vLLM's own cache reset as an RL loop resets it:
    B found none of it in kvcached (448 tokens before). What B stored after the update is a hit
    (A: 448), and B's output from a 448-token hit equals the one before the update (the same
    weights were loaded: the control of a connector still serving). Then a weight version set
    (`update_weight_version`): again nothing stored before is a hit, and what is stored under
    it is."""
    daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.2)
    eng = vllm_driver.EngineProcess(str(tmp_path / "model"), "--connector", "kvcached",
                                    "--instance", instance, "--run-dir", run_dir).saves_go_to(daemon)
    hit = vllm_driver.PREFIX_BLOCKS * vllm_driver.BLOCK
    try:
        vllm_driver.wait_attached(daemon)
        assert eng.gen("A")["num_cached_tokens"] == 0
        before = eng.gen("B")
        assert before["reset"] and before["num_cached_tokens"] == hit, before  # the control
        assert eng.step("rpc", "reload_weights")["rpc"] == "reload_weights"
        after = eng.gen("B")
        assert after["reset"] and after["num_cached_tokens"] == 0, after
        assert eng.gen("A")["num_cached_tokens"] == hit  # B stored the prefix after the update
        again = eng.gen("B")
        assert again["num_cached_tokens"] == hit and again["tokens"] == before["tokens"], again
        assert eng.step("version", "step-1")["version"] == "step-1"
        assert eng.gen("B")["num_cached_tokens"] == 0
        assert eng.gen("A")["num_cached_tokens"] == hit
    finally:
        eng.close()
        daemon.stop()
        sweep_crashed(instance)


def test_a_connector_that_cannot_re_key_serves_and_stores_nothing(tmp_path, daemon, monkeypatch):
    """Re-keying raised after an update (here: its own method): the connector is closed - no
    hit, no save - rather than keep the old weights' keys, and the error stays out of vLLM's
    call. Another connector in the process re-keys as before."""
    from types import SimpleNamespace

    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    model = write_model(str(tmp_path / "model"))
    broken = scheduler_connector(model, daemon.instance, daemon.run_dir)
    other = scheduler_connector(model, daemon.instance, daemon.run_dir)
    try:
        def cannot(*_args):
            raise RuntimeError("no keys")

        monkeypatch.setattr(broken, "weights_replaced", cannot)
        namespace = other.key_scheme.hasher.namespace
        weight_updates._after_rpc(None, "update_weights")
        assert broken.disabled and not other.disabled
        assert other.key_scheme.hasher.namespace != namespace
        saves = {}
        for name, conn in (("broken", broken), ("other", other)):
            request = Request("r", list(range(100, 180)), SamplingParams(max_tokens=1), None)
            assert conn.get_num_new_matched_tokens(request, 0) == (0, False)
            state = conn._reqs["r"]
            state.block_ids = list(range(5))
            meta = SimpleNamespace(saves=[])
            conn._add_save(meta, state, 80)
            saves[name] = meta.saves
        assert saves["broken"] == []  # nothing stored under keys that may be the old weights'
        assert len(saves["other"]) == 1  # the control: the same request's 5 blocks to save
    finally:
        for conn in (broken, other):
            conn.link.close()


def test_what_a_request_computes_on_the_old_weights_kv_is_not_stored(tmp_path, run_dir, instance):
    """A's prefill ran on the checkpoint; other weights were loaded in place while A ran
    (`reload_weights(weights_path=...)`, as an RL loop with `pause(mode="keep")` leaves a request
    running on its old KV); A's blocks completed after the update were computed on the old
    weights' KV and are not stored under the new weights' keys. After the update `gen A` stores
    the prompt's 15 blocks; A's prompt followed by its output then finds those 15 and no more
    (before the fix: 21, six of them from A's run across the update), and its output equals
    vLLM's own 15-block hit. The control that the weights changed: A's output differs."""
    write_model(str(tmp_path / "other"), seed=1)
    daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.2)
    eng = vllm_driver.EngineProcess(str(tmp_path / "model"), "--connector", "kvcached", "--inproc",
                                    "--instance", instance, "--run-dir", run_dir).saves_go_to(daemon)
    prompt = 15 * vllm_driver.BLOCK  # A's whole blocks (488 tokens)
    try:
        vllm_driver.wait_attached(daemon)
        before = eng.gen("A")
        assert eng.step("start", "A 200")["started"] == "A"  # A's prefill: its 15 blocks stored
        assert eng.step("rpc", f"reload_weights {tmp_path / 'other'}")["rpc"] == "reload_weights"
        assert len(eng.step("finish", "")["outputs"]["A"]) == 200  # A+: 688 tokens, 21 blocks
        after = eng.gen("A")
        assert after["reset"] and after["num_cached_tokens"] == 0, after
        assert after["tokens"] != before["tokens"]  # the control: other weights
        turn = eng.gen("A+")
        assert turn["reset"] and turn["num_cached_tokens"] == prompt, turn
        assert turn["tokens"] == eng.step("genk", "A+ 15")["tokens"]
    finally:
        eng.close()
        daemon.stop()
        sweep_crashed(instance)


def _saves(conn, name: str, local_tokens: int = 0, lora=None, then=None) -> int:
    """A request of 80 tokens (5 blocks of 16) scheduled from waiting with `local_tokens` hit in
    vLLM's own cache, computed in two steps (one block, then the rest; `then` done in between):
    how many blocks the connector sends to be stored."""
    from types import SimpleNamespace

    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    request = Request(name, list(range(100, 180)), SamplingParams(max_tokens=1), None,
                      lora_request=lora)
    conn.get_num_new_matched_tokens(request, local_tokens)
    first = local_tokens + 16
    new = SimpleNamespace(req_id=name, block_ids=(list(range(5)),), num_computed_tokens=local_tokens)
    none = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
    steps = [SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=none,
                             num_scheduled_tokens={name: 16}, preempted_req_ids=set()),
             SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={name: 80 - first},
                             scheduled_cached_reqs=SimpleNamespace(
                                 req_ids=[name], new_block_ids=[None], num_computed_tokens=[first],
                                 resumed_req_ids=set()), preempted_req_ids=set())]
    saved = 0
    for i, out in enumerate(steps):
        saved += sum(len(t.keys) for t in conn.build_connector_meta(out).saves)
        if i == 0 and then is not None:
            then()
    return saved


def test_after_an_update_blocks_on_vllms_own_old_blocks_wait_for_its_reset(tmp_path, daemon):
    """Blocks computed since vLLM's cache was last emptied may be the old weights': after an
    update, a request that hits vLLM's own cache is not stored (a request without such a hit is),
    until a reset_prefix_cache takes (through vLLM's EngineCore, watched); one that does not
    take changes nothing. An update with nothing computed since the last reset stales nothing."""
    from types import SimpleNamespace

    from vllm.v1.engine.core import EngineCore

    conn = scheduler_connector(write_model(str(tmp_path / "model")), daemon.instance, daemon.run_dir)

    def reset(took: bool):
        core = SimpleNamespace(scheduler=SimpleNamespace(reset_prefix_cache=lambda *a: took))
        assert EngineCore.reset_prefix_cache(core) is took

    try:
        assert _saves(conn, "r0") == 5
        weight_updates._after_rpc(None, "update_weights")
        assert _saves(conn, "r1", 32) == 0 and _saves(conn, "r2") == 5  # a hit on vLLM's own blocks; none
        reset(False)
        assert _saves(conn, "r3", 32) == 0  # the reset did not take: vLLM's old blocks are still there
        reset(True)
        assert _saves(conn, "r4", 32) == 3  # the control: the same hit once vLLM's cache was emptied
        reset(True)
        weight_updates._after_rpc(None, "update_weights")  # nothing computed since the reset
        assert _saves(conn, "r5", 32) == 3
        assert conn.counters["stale_blocks"] == 6
    finally:
        conn.link.close()


def test_an_adapter_loaded_again_in_place_keys_its_blocks_anew(tmp_path, daemon):
    """vLLM's add_lora (watched on its EngineCore) of a name it had, or with load_inplace: a
    directory's files are read again (rewritten: other keys; the same files: the same keys, so
    engines share them), an adapter that is no directory gets a new salt, and a request running
    with it stores nothing after it (1 block of 5) while one with another adapter does (the
    control). A request whose adapter vLLM reloads at every step (load_inplace) stores nothing
    once its files change under it. A first add_lora keeps the keys."""
    from types import SimpleNamespace

    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.core import EngineCore

    from kvcached_client import hashing

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(b"\x01" * 64)
    hashing.path_identity.cache_clear()
    conn = scheduler_connector(write_model(str(tmp_path / "model")), daemon.instance, daemon.run_dir)
    core = SimpleNamespace(model_executor=SimpleNamespace(add_lora=lambda lora: True))
    on_disk, in_memory = (lambda inplace=False: LoRARequest("a", 1, str(adapter), load_inplace=inplace),
                          lambda: LoRARequest("m", 2, "/nonexistent/held-in-memory"))

    def keys(lora) -> list[bytes]:
        return _saves_keys(conn, lora)

    try:
        first, memory = keys(on_disk()), keys(in_memory())
        EngineCore.add_lora(core, on_disk())
        EngineCore.add_lora(core, in_memory())
        assert keys(on_disk()) == first and keys(in_memory()) == memory  # first loads
        os.utime(weights, ns=(1, 1))  # retrained and written where it was
        assert keys(on_disk()) == first  # vLLM has not loaded it again
        EngineCore.add_lora(core, on_disk(inplace=True))
        second = keys(on_disk())
        assert second != first
        EngineCore.add_lora(core, on_disk(inplace=True))
        assert keys(on_disk()) == second  # the same files again: the same keys
        EngineCore.add_lora(core, in_memory())
        assert keys(in_memory()) != memory
        reload = lambda: EngineCore.add_lora(core, on_disk(inplace=True))  # noqa: E731
        assert _saves(conn, "x", lora=on_disk(), then=reload) == 1  # ran across the reload
        other = LoRARequest("b", 3, "/nonexistent/b")
        assert _saves(conn, "y", lora=other, then=reload) == 5  # the control: another adapter
        rewrite = lambda: os.utime(weights, ns=(2, 2))  # noqa: E731
        assert _saves(conn, "z", lora=on_disk(inplace=True), then=rewrite) == 1
        at_two = keys(on_disk(inplace=True))
        assert _saves(conn, "w", lora=on_disk(inplace=True)) == 5  # the control: files unchanged
        os.utime(weights, ns=(3, 3))  # rewritten while the engine idles after that step
        assert keys(on_disk(inplace=True)) != at_two  # the next request keys the new files
    finally:
        conn.link.close()
        hashing.path_identity.cache_clear()


def _saves_keys(conn, lora) -> list[bytes]:
    """The keys the scheduler connector makes for an 80-token request with adapter `lora`."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from kvcached_client.vllm.connector import _ReqState

    return conn._keys(_ReqState(Request("k", list(range(100, 180)), SamplingParams(max_tokens=1),
                                        None, lora_request=lora)), 5)
