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



LAUNCHER = """
import os, sys, time
from kvcached_client import launch
d = launch(instance=sys.argv[1], run_dir=sys.argv[2], host_cache_gb=0.0625)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # through the interpreter: the handle's finalizer is the parent's, not run here
os.waitpid(pid, 0)
print(d.alive(), os.path.exists(d.log_path), flush=True)
print(d.stop(), flush=True)
"""


def test_a_child_of_the_process_that_launched_a_daemon_leaves_it_and_its_log_alone(run_dir, instance):
    """(Before: the child's exit ran the launch handle's finalizer, whose Popen saw a daemon not
    its own as exited with code 0, and deleted the running daemon's log.)"""
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_LOG_DIR"}  # (a log it removes)
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, instance, run_dir], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "True", "0"], proc.stdout
