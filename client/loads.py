"""Client's loads (a mixin of Client: it uses the client's `_send`, `_reply`, `_checked`,
`_fence`, `_hold_unanswered` and `timeout`): one load, or several sent at once whose replies are
collected after, so a step that loads for many requests waits one round trip, not one each."""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from kvcached_proto import DaemonUnavailable, KvcachedError, KvcachedTimeout, Op, pack_block_ids, pack_keys

from .tasks import LoadTask


class SendsLoads:
    def load(self, keys: Sequence[bytes], device_blocks: Sequence[int] | np.ndarray,
             priority: int = 0, timeout: float | None = None, stream=None,
             host_only: bool = False) -> LoadTask:
        """Copy the host blocks of the leading keys found into `device_blocks`. CUDA KV: the
        daemon's copies wait (on the GPU) for the work queued so far on `stream` (default: the
        current stream; e.g. the engine zeroing newly allocated blocks). host_only: plan the
        host tier's leading blocks only, never a storage read. A load sent whose reply does
        not come (KvcachedTimeout, DaemonUnavailable, an interrupt while waiting) may still be
        taken by a daemon that only hung: its device blocks are held (the error's
        `.held_blocks`, `held_blocks()`) until the daemon's late reply refuses it, the load it
        made ends, or the daemon is gone."""
        got = self.load_batch([(keys, device_blocks)], priority, timeout, stream, host_only)[0]
        if isinstance(got, BaseException):
            raise got
        return got

    def load_batch(self, loads: Sequence[tuple[Sequence[bytes], Sequence[int] | np.ndarray]],
                   priority: int = 0, timeout: float | None = None, stream=None,
                   host_only: bool = False) -> list[LoadTask | KvcachedError]:
        """Several loads, each (keys, device_blocks) as load() takes them, sent before any
        reply is awaited: one round trip for all of them. Returns, in order, each one's
        LoadTask or the KvcachedError it got (nothing is raised for one load; an unanswered one
        holds its blocks as load() says; keys or blocks that cannot be sent are a ProtocolError,
        and that load is not sent). `timeout` bounds the wait for all the replies together; all the loads
        are ordered after the same point of `stream`."""
        extra = {"host_only": True} if host_only else {}
        frames: list[dict | KvcachedError] = []
        for keys, blocks in loads:
            try:
                frames.append(dict(keys=pack_keys(keys), blocks=pack_block_ids(blocks),
                                   priority=priority, **extra))
            except KvcachedError as exc:  # this one cannot be sent: its answer (ProtocolError)
                frames.append(exc)
        fence = self._fence(stream) if any(isinstance(f, dict) for f in frames) else {}
        sent: list[int | KvcachedError] = []
        out: list[LoadTask | KvcachedError] = []
        try:
            unreachable: KvcachedError | None = None
            for fields in frames:
                if isinstance(fields, KvcachedError) or unreachable is not None:
                    sent.append(fields if isinstance(fields, KvcachedError) else unreachable)
                    continue
                try:
                    sent.append(self._send(Op.LOAD, dict(fields, **fence)))
                except KvcachedError as exc:  # not sent (the daemon is unreachable): nor the rest
                    unreachable = exc
                    sent.append(exc)
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            down = False  # once the daemon is seen down, the rest take what already came only
            for rid, (_, blocks) in zip(sent, loads):
                out.append(self._load_reply(rid, blocks, time.monotonic() if down else deadline,
                                            fence.get("fence", 0)))
                down = down or isinstance(out[-1], DaemonUnavailable)
        except BaseException:  # interrupted (KeyboardInterrupt, a signal handler's SystemExit)
            # while loads were out: those sent and not answered may still be taken and copied
            # into their blocks, which stay held as for a reply that did not come
            for rid, (_, blocks) in list(zip(sent, loads))[len(out):]:
                if not isinstance(rid, KvcachedError):
                    self._hold_unanswered(rid, blocks, KvcachedTimeout("interrupted"), fence.get("fence", 0))
            raise
        return out

    def _load_reply(self, rid: int | KvcachedError, blocks, deadline: float,
                    fence: int = 0) -> LoadTask | KvcachedError:
        if isinstance(rid, KvcachedError):
            return rid
        try:
            reply = self._checked(self._reply(rid, Op.LOAD, max(0.0, deadline - time.monotonic()),
                                              forget=False))
        except (KvcachedTimeout, DaemonUnavailable) as exc:  # sent, and no reply came
            return self._hold_unanswered(rid, blocks, exc, fence)
        except KvcachedError as exc:  # the daemon refused it
            return exc
        reply["device_blocks"] = np.asarray(blocks)[: reply["blocks"]].astype(np.int64).tolist()
        reply["fence"] = fence  # (what revoke() writes for it)
        return LoadTask(self, reply["task"], reply)
