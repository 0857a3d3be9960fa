"""What a `register_kv` must pass before anything of it is mapped: the instance is free (or
already this client's), the layout is valid, on the daemon's kind of device, and one block
fits the host pool; what it left (Registered); and what its block size says of the disk tiers'
indexes (index_memory_said)."""
from __future__ import annotations

import logging

from kvcached_proto import ErrorCode
from kvcached_proto.layout import LayoutSpec, fd_token, parse_layout, require_order_segment

from ..copy.kv_mapping import KVRegistration
from ..copy.transfer import TaskAbort
from ..errors import OpError
from ..host.machine import available_memory
from ..storage.disk_room import INDEX_BYTES_PER_RECORD
from ..storage.uris import redact

log = logging.getLogger(__name__)

INDEX_SHARE = 0.5  # of the memory left: the disk tiers' indexes at capacity may take no more


def index_memory_said(tiers, page_bytes: int) -> str:
    """(A registration's new geometry.) A warning, logged and returned ("" for none), where the
    local disk tiers' indexes, full of records of this geometry, would take more than
    INDEX_SHARE of the memory this machine has left: a tier that fills up gets the daemon killed
    for memory (an index entry a record; 1 TB of 32 KiB blocks is 6 GiB of index)."""
    sizes = tiers.index_bytes(page_bytes)
    need = sum(n for _b, n in sizes)
    avail, source = available_memory()
    if not need or avail is None or need <= avail * INDEX_SHARE:
        return ""
    room = avail * INDEX_SHARE / need  # the share of each capacity that fits
    said = "; ".join(f"{redact(b.uri)}: {n / 2**30:.1f} GiB (capacity_gb at most "
                     f"{b.capacity_bytes * room / 2**30:.4g} here)" for b, n in sizes)
    msg = (f"the disk tiers' indexes at capacity, of {page_bytes >> 10} KiB blocks, would take "
           f"{need / 2**30:.1f} GiB of the daemon's memory ({INDEX_BYTES_PER_RECORD} bytes a "
           f"block; {said}); this machine has {avail / 2**30:.1f} GiB left ({source}): the "
           "daemon would be killed for memory before they are full. Lower capacity_gb, or use "
           "larger blocks")
    log.warning("[disk] %s", msg)
    return msg


def _shares(spec: LayoutSpec) -> bool:
    """Host memory handed over as fds (SGLang's host pools) may be registered beside other such
    registrations of its geometry: they copy on the CPU, with no device of their own to own."""
    return fd_token(spec) is not None


def checked_layout(layout: dict, client_id: str, reg: "Registered", device: str,
                   pool_bytes: int) -> LayoutSpec:
    """The layout's spec, or OpError (KV_IN_USE, KV_MISMATCH) changing nothing."""
    others = [kv for kv in reg.all_kv() if kv.owner != client_id and not kv.retired]
    if any(not _shares(kv.spec) for kv in others):
        raise OpError(ErrorCode.KV_IN_USE,
                      f"this instance already serves the KV cache of client {others[0].owner}: "
                      "one engine per instance (start another with `kvcached serve "
                      "--instance NAME`), or that engine unregisters or exits first")
    spec = parse_layout(layout)
    require_order_segment(spec)
    fd_token(spec)
    if others and not (_shares(spec) and spec.geometry() == others[0].spec.geometry()):
        raise OpError(ErrorCode.KV_IN_USE,
                      f"this instance serves the host pools of {len(others)} engine(s) (client "
                      f"{others[0].owner}); another may join only with a host pool of the same "
                      "geometry (the same model and layout): start another instance for this one")
    if spec.device.split(":")[0] != device.split(":")[0]:
        why = (" (a CPU staging copy of the engine's KV: a CUDA daemon copies into the engine's own "
               "CUDA KV and stages nothing; run this daemon with --device cpu to stage)"
               if spec.device == "cpu" else "")
        raise OpError(ErrorCode.KV_MISMATCH, f"KV on {spec.device} but the daemon serves {device}{why}")
    if spec.page_bytes > pool_bytes:
        raise OpError(ErrorCode.KV_MISMATCH,
                      f"one block across layers is {spec.page_bytes} bytes, more than the "
                      f"host pool ({pool_bytes}); raise --host-cache-gb")
    return spec


def claim_fds(spec: LayoutSpec, inbox) -> list[int]:
    """The fds a layout's fd allocations index, taken from the fd socket's inbox (the caller
    closes them); [] for a layout without any. KV_MISMATCH when none wait under its token."""
    token = fd_token(spec)
    if token is None:
        return []
    fds = inbox.claim(token) if inbox is not None else None
    if fds is None:
        raise OpError(ErrorCode.KV_MISMATCH, "allocations: no fds wait under this token (they are "
                      "claimed by one register_kv, and closed if none comes within 60 s)")
    return fds


class KVLost(TaskAbort):
    """The registered KV memory went away under a copy (a CPU segment truncated by its owner)."""


class Registered:
    """The engines' KV mappings and the copiers over them, by the client that registered each:
    one engine per instance, except host pools handed over as fds (SGLang's), any number of one
    geometry side by side (every rank and replica of a model on a host, one daemon). Changed
    under the host tier's lock, with the workers drained; the flows read them on their worker
    threads, each task through its own client's."""

    def __init__(self):
        self._by_owner: dict[str, tuple[KVRegistration, object]] = {}

    @property
    def kv(self) -> KVRegistration | None:
        """The first registration (None when there is none)."""
        return next(iter(self._by_owner.values()), (None, None))[0]

    def of(self, owner: str) -> KVRegistration | None:
        got = self._by_owner.get(owner)
        return got[0] if got is not None else None

    def copier_of(self, owner: str):
        return self._by_owner[owner][1]

    def all_kv(self) -> list[KVRegistration]:
        return [kv for kv, _ in self._by_owner.values()]

    def put(self, owner: str, kv: KVRegistration, copier) -> None:
        self._by_owner[owner] = (kv, copier)

    def pop(self, owner: str) -> tuple:
        """(kv, copier) of `owner`, no longer registered ((None, None) if it was not)."""
        return self._by_owner.pop(owner, (None, None))

    def pop_all(self) -> list[tuple]:
        gone, self._by_owner = list(self._by_owner.values()), {}
        return gone

    @property
    def num_layers(self) -> int:
        return self.kv.spec.num_layers  # one geometry for every registration

    def lost_owners(self, tasks) -> dict[str, str]:
        """After a batch's copies: the owners among `tasks` whose memory shrank under them (what
        was copied for them is zero pages, not their KV), with why. Their tasks fail; the
        others' stand."""
        lost = {}
        for owner in {t.client_id for t in tasks}:
            kv = self.of(owner)
            why = kv.lost if kv is not None else "its KV cache was unregistered"
            if why:
                lost[owner] = why
        return lost
