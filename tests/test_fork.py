"""An engine that forks after connecting (client/forks.py): the child's calls on the Client it
inherited raise DaemonUnavailable at once instead of waiting forever, its close and its exit
leave the parent's KV segments in place, a Client it connects itself works, and the parent goes
on, its bytes intact. The engine is a process of its own (fork_engine.py), as an engine is."""
import json
import os
import subprocess
import sys


ENGINE = os.path.join(os.path.dirname(__file__), "fork_engine.py")


def _run(daemon) -> dict:
    proc = subprocess.run([sys.executable, ENGINE, daemon.instance, daemon.run_dir],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        out.update(json.loads(line))
    return out


def test_a_forked_child_is_told_at_once_and_leaves_its_parents_cache_alone(daemon):
    out = _run(daemon)
    child, parent = out["child"], out["parent"]
    assert parent["child_status"] == 0, out  # (None: hung past 30 s and killed)
    for op in ("lookup", "ping", "load", "offload"):
        assert child[op].get("raised") == "DaemonUnavailable", (op, child[op])
        assert "does not cross a fork" in child[op]["message"] and child[op]["s"] < 1.0, child[op]
    assert child["alive"]["ok"] == "False" and child["close"]["s"] < 1.0, child
    assert child["own_ping"].get("ok") is not None, child["own_ping"]
    assert child["own_lookup"]["ok"] == "(8, 0)", child["own_lookup"]
    # the child's close, its dropped tensors and its exit unlinked none of the parent's segments
    assert parent["segments"] and parent["left"] == parent["segments"], parent
    assert parent["loaded"] == 8 and parent["same"], parent

