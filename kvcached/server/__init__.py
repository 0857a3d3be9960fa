"""The daemon's top layer: sockets, dispatch and lifecycle (daemon.py), the control worker, the
status socket and status block, task events, metrics, and sweeps of dead engines' segments."""
