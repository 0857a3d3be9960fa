"""vLLM weights changed in place, and the keys of what is stored after.

vLLM updates its weights in place through its engine core's `collective_rpc`: its RL API
(`start_weight_update`, `update_weights`, `finish_weight_update`, `reload_weights`) and the
worker extensions RL frameworks add (`update_weights_from_ipc`, `update_weight`, ...). vLLM
does not reset the connector for it: an RL loop resets vLLM's own prefix cache after each sync
(`reset_prefix_cache()`, whose default leaves the connector out) or pauses with `mode="keep"`.
The connector's keys stayed those of the checkpoint, so the daemon served the old weights' KV
to the next rollouts, and what the new weights computed was stored under the checkpoint's keys,
where an engine later started on the checkpoint itself would be served it.

So the calls are watched: `EngineCore.collective_rpc` and `EngineCore.set_weight_version` are
wrapped once, when the first scheduler-side connector starts (it lives in the engine core's
process). After an RPC that may change weights (its name has "weight" in it and is not a read,
or it is `load_model`, `update_config`, or a function), every connector keys its blocks under a
new random salt, as at a cache reset; after a weight version is set (`finish_weight_update(
weight_version=...)`, `update_weight_version`), under that version, which every engine updated
to it shares. A connector that cannot re-key is closed (it serves nothing more); the error
never reaches vLLM's call.

What vLLM computed before an update stays in its own prefix cache until that is emptied, and
`pause(mode="keep")` keeps requests running on it: blocks computed on the old weights' KV are
not stored under the new keys. `EngineCore.reset_prefix_cache` is watched too: once one takes,
vLLM's cache holds only what the current weights computed (`local_cache_emptied`). So is
`EngineCore.add_lora`: an adapter loaded again in place keys its blocks anew
(`adapter_loaded`, freshness.py).
"""
from __future__ import annotations

import functools
import importlib
import logging
import weakref

log = logging.getLogger("kvcached_client.vllm.connector")
ENGINE_CORE = "vllm.v1.engine.core"
READS = ("compute_", "get_", "check", "init_", "shutdown_", "is_")  # weight RPCs that change none
CHANGES = ("load_model", "update_config", "reset_weights")

_connectors: "weakref.WeakSet" = weakref.WeakSet()
_watching: bool | None = None  # None: not tried yet in this process


def watch(connector) -> bool:
    """Tell `connector` (its `weights_replaced(version)`) of vLLM's weight changes from now on.
    False where this vLLM has no engine core to watch."""
    global _watching
    _connectors.add(connector)
    if _watching is None:
        _watching = _install()
    return _watching


def changes_weights(method) -> bool:
    """Whether a collective RPC may change the weights (a function: it may)."""
    if not isinstance(method, str):
        return True
    return method in CHANGES or ("weight" in method and not method.startswith(READS))


def _install() -> bool:
    try:
        cls = importlib.import_module(ENGINE_CORE).EngineCore
    except Exception as exc:  # another vLLM: its engine core is elsewhere
        log.info("[vllm] engine core not found (%s: %s): weight updates are not watched",
                 type(exc).__name__, exc)
        return False
    for name, after in (("collective_rpc", _after_rpc), ("set_weight_version", _after_version),
                        ("reset_prefix_cache", _after_reset), ("add_lora", _after_add_lora)):
        fn = getattr(cls, name, None)
        if fn is not None and not getattr(fn, "_kvcached_watched", False):
            setattr(cls, name, _watched(fn, after))
    return True


def _watched(fn, after):
    """fn, then `after` with what it returned (None where it raised) and its arguments, whether
    fn returned or raised (a failed update may have loaded part of the weights)."""
    @functools.wraps(fn)  # vLLM reads the signature of a utility call's method: fn's
    def watched(self, *args, **kwargs):
        result = None
        try:
            result = fn(self, *args, **kwargs)
            return result
        finally:
            after(result, *args, **kwargs)

    watched._kvcached_watched = True
    return watched


def _after_rpc(_result, method=None, *_args, **_kwargs) -> None:
    if changes_weights(method):
        what = getattr(method, "__name__", str(method))
        _tell_all(what, lambda connector: connector.weights_replaced(None, what))


def _after_version(_result, weight_version=None, *_args, **_kwargs) -> None:
    _tell_all("set_weight_version",
              lambda connector: connector.weights_replaced(str(weight_version), "set_weight_version"))


def _after_reset(result, *_args, **_kwargs) -> None:
    """vLLM's reset_prefix_cache: True once its own cache is empty (False: blocks still in use,
    nothing was dropped)."""
    if result is True:
        _tell_all("reset_prefix_cache", lambda connector: connector.local_cache_emptied())


def _after_add_lora(result, lora_request=None, *_args, **_kwargs) -> None:
    """vLLM's add_lora (the server's /v1/load_lora_adapter, LLM.llm_engine.add_lora): an adapter
    loaded again in place changes its blocks' KV (one that raised may have)."""
    if lora_request is not None and result is not False:
        _tell_all(f"add_lora({lora_request.lora_name!r})",
                  lambda connector: connector.adapter_loaded(lora_request))


def _tell_all(what: str, call) -> None:
    """call(connector) for every connector; one that raises is closed, and the error never
    reaches the vLLM call watched (it runs in that call's `finally`)."""
    for connector in list(_connectors):
        try:
            call(connector)
        except Exception as exc:
            log.error("[vllm] re-keying after %s failed (%s: %s): the connector is closed, so it "
                      "serves no block of the old weights", what, type(exc).__name__, exc)
            try:
                connector.close_link()
            except Exception as err:
                log.error("[vllm] closing the connector's link: %s: %s", type(err).__name__, err)
