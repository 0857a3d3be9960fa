"""Which of a vLLM request's blocks the connector may store: only KV computed wholly under the
weights and LoRA adapter its keys name.

vLLM changes both in place. After a weight update (weight_updates.py) or an adapter loaded again
(`add_lora` of a name it had, or with `load_inplace`), the keys change, but what vLLM computed
before stays in its own prefix cache until a `reset_prefix_cache` takes, and
`pause(mode="keep")` keeps requests running on it. A request running across the change, or one
that hits vLLM's own cache before it is emptied, computes on the old KV: it is stale, and none
of its blocks is stored (they would be served under the new keys). A request whose adapter
vLLM reloads from disk at every step (`load_inplace`) is stale once that directory's files
change under it.
"""
from __future__ import annotations

import os

from ..hashing import path_identity
from .request_keys import adapter_identity


class Freshness:
    """The scheduler connector's record of what vLLM's own cache may hold, the salts of adapters
    loaded again, and the files of load_inplace adapters as read this step (request_parts takes
    it as `adapters`)."""

    def __init__(self):
        # vLLM's own cache: computed anything since it was last emptied; may hold old KV
        self.local_used = self.local_stale = False
        self.adapter_salts: dict[str, str] = {}
        self.adapters_added: set[str] = set()
        # load_inplace adapters' files as read for this step's saves (None outside them: each
        # lookup reads them, so none keys on a read from before the engine idled)
        self._step_idents: dict[str, str] | None = None

    def identity(self, path: str) -> str:
        """A directory vLLM reloads at every step (`load_inplace`): read once for a step's
        saves (a batch of its requests reads it once), else at each call."""
        if self._step_idents is None:
            return path_identity(path, fresh=True)
        if path not in self._step_idents:
            self._step_idents[path] = path_identity(path, fresh=True)
        return self._step_idents[path]

    def _inplace_identity(self, request) -> str | None:
        """The files of the adapter vLLM reloads at every step (`load_inplace`, a directory)
        this step; None for any other request."""
        lora = getattr(request, "lora_request", None)
        if lora is None or not getattr(lora, "load_inplace", False):
            return None
        return adapter_identity(str(getattr(lora, "lora_path", "") or ""), self.identity) or None

    def scheduled(self, any_tokens: bool) -> None:
        """A step's connector metadata is being built (its saves next): read the load_inplace
        adapters' files anew, once for all of them."""
        self.local_used |= any_tokens
        self._step_idents = {}

    def saves_built(self) -> None:
        """The step's saves are chosen: what was read for them is not kept past the step."""
        self._step_idents = None

    def emptied(self) -> None:
        """A reset_prefix_cache took: all vLLM holds from now on is computed as the keys say."""
        self.local_used = self.local_stale = False

    def at_lookup(self, state, local_tokens: int) -> None:
        """A request scheduled from waiting: stale if it starts on vLLM's own old blocks."""
        state.stale = self.local_stale and local_tokens > 0
        state.adapter_ident = self._inplace_identity(state.request)

    def may_save(self, state) -> bool:
        if not state.stale and state.adapter_ident is not None \
                and self._inplace_identity(state.request) != state.adapter_ident:
            state.stale = True  # its adapter's files changed while vLLM reloaded them
        return not state.stale

    def weights_replaced(self, states) -> None:
        self._changed(states)

    def adapter_loaded(self, lora, running) -> bool:
        """vLLM's add_lora loaded `lora`. Loaded again under a name it had (or in place), its
        keys change: its directory's files are read again, and an adapter that is no directory
        gets a new salt; `running` (the requests with it) are stale. True where it re-keyed."""
        name = lora.lora_name
        again = name in self.adapters_added or bool(getattr(lora, "load_inplace", False))
        self.adapters_added.add(name)
        if not again:
            return False
        path = str(getattr(lora, "lora_path", "") or "")
        if self._step_idents is not None:
            self._step_idents.pop(path, None)
        files = path_identity(path, fresh=True).startswith("files:") if path else False
        self.adapter_salts[name] = "" if files else os.urandom(8).hex()
        self._changed(running)
        return True

    def _changed(self, running) -> None:
        if self.local_used:
            self.local_stale = True
            for state in running:
                state.stale = True
