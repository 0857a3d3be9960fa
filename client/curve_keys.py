"""A TCP client's CURVE keys: the daemon's public key and this client's key pair, from the files
`kvcached keygen` writes."""
from __future__ import annotations

import zmq


def set_curve(sock: zmq.Socket, server_key_file: str | None, client_key_file: str | None) -> None:
    import zmq.auth

    if not (server_key_file and client_key_file):
        raise ValueError("CURVE needs both curve_server_key_file and curve_client_key_file")
    server_public, _ = zmq.auth.load_certificate(server_key_file)
    public, secret = zmq.auth.load_certificate(client_key_file)
    if not secret:
        raise ValueError(f"{client_key_file} holds no secret key (use NAME.key_secret)")
    sock.curve_serverkey = server_public
    sock.curve_publickey, sock.curve_secretkey = public, secret
