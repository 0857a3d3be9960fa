"""Who may send what: the daemon's record of a client, and the checks of the ops that touch the
registered engine's memory (its client only) or change the daemon for every engine (that
engine, or an operator on the ipc socket)."""
from __future__ import annotations

from dataclasses import dataclass

from kvcached_proto import ErrorCode, Op

from ..errors import OpError


@dataclass
class ClientInfo:
    client_id: str
    routing_id: bytes
    pid: int
    name: str
    connected_ns: int
    pid_visible: bool = True  # False across pid namespaces: no pid-based reaping then
    fd: int = -1              # the connection's socket fd: its close means the client is gone
    role: str = "engine"      # "operator": may send the admin ops (ipc socket only)


def check_kv_owner(kv, client: ClientInfo, op: Op) -> None:
    """offload and load read and write the registered engine's memory: its client only."""
    if kv is None:
        raise OpError(ErrorCode.NOT_REGISTERED, f"{op.name.lower()} before register_kv")
    if kv.owner != client.client_id:
        raise OpError(ErrorCode.FORBIDDEN,
                      f"{op.name.lower()} copies into or out of the registered KV cache, which "
                      f"belongs to client {kv.owner}: only that client may send it")


def check_admin(kv, client: ClientInfo, op: Op) -> None:
    """Ops that change the daemon for every engine: the registered engine or an operator."""
    if client.role == "operator":
        return
    if kv is not None and kv.owner == client.client_id and not kv.retired:
        return
    owner = f"the registered engine (client {kv.owner})" if kv is not None else \
        "the registered engine (none is registered)"
    raise OpError(ErrorCode.FORBIDDEN,
                  f"{op.name.lower()} changes the daemon for every engine: only {owner} or an "
                  "operator may send it (Client.connect(role='operator') on the ipc socket, "
                  "as `kvcached stop` does)")
