"""Offline tools that drive the daemon's parts as a client would: trace replay, trace generation,
offline reference policies."""
