"""Registering KV that lives in host memory the engine can hand over only as fds (SGLang's
HiCache host pool, made with memfd_create): the fds go to the daemon's fd socket
(kvcached_proto.fd_pass), then the layout is registered under the token they were sent under.
"""
from __future__ import annotations

from typing import Sequence

from kvcached_proto import KvcachedError
from kvcached_proto.fd_pass import fd_socket_path, send_fds


def register_host_memory(client, layout: dict, fds: Sequence[int], timeout: float | None = None) -> dict:
    """`layout`: a register_kv layout on "cpu" whose allocations are {"kind": "fd", "index": i,
    "size": bytes}, indexing `fds`. Order words come with it as with register_kv_cache (on the CPU:
    an offload the engine gives up on is revoked, so a late copy is discarded). The fds stay the
    caller's; the daemon maps the memory until the KV is unregistered or `client` goes."""
    if "fd_pool" not in client.info.get("capabilities", ()):
        raise KvcachedError(f"the daemon {client.instance} takes no fds (it serves "
                            f"{client.info.get('device')}: run it with --device cpu, or upgrade it)")
    token = send_fds(fd_socket_path(client.run_dir, client.instance), list(fds),
                     client.timeout if timeout is None else timeout)
    return client.register_layout(
        dict(layout, allocations=[dict(h, token=token) for h in layout["allocations"]]), timeout)
