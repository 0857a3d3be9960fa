"""Operating the daemon: status, metrics, configuration sources, logging."""
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port, small_kv, unique_instance, wait_until
from kvcached_client import BlockHasher, launch


def _serve(*args, env=None, timeout=30):
    return subprocess.run([sys.executable, "-m", "kvcached", "serve", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def _config(*args, env=None):
    out = _serve(*args, "--print-config", env=env)
    assert out.returncode == 0, out.stderr
    return tomllib.loads(out.stdout)


def test_print_config_shows_the_defaults():
    cfg = _config()
    assert cfg["host_cache_gb"] == 1.0 and cfg["eviction"] == "lru" and cfg["storage"] == []


def test_flags_beat_env_beat_file_beat_defaults(tmp_path):
    f = tmp_path / "kvcached.toml"
    f.write_text('host_cache_gb = 2.0\neviction = "s2lru"\nstorage = ["disk:///tmp/a"]\n'
                 'selective_hits = 5\n')
    env = {"KVCACHED_HOST_CACHE_GB": "3", "KVCACHED_SELECTIVE_HITS": "7"}
    cfg = _config("--config", str(f), "--host-cache-gb", "4", env=env)
    assert cfg["host_cache_gb"] == 4.0  # flag
    assert cfg["selective_hits"] == 7  # env over file
    assert cfg["eviction"] == "s2lru" and cfg["storage"] == ["disk:///tmp/a"]  # file
    assert cfg["prefetch_max_share"] == 0.5  # default
    assert _config(env={"KVCACHED_STORAGE": "disk:///x,redis://h:1/0",
                        "KVCACHED_STORAGE_WRITER": "false"})["storage_writer"] is False


@pytest.mark.parametrize("content, needle", [
    ("hots_cache_gb = 2\n", "hots_cache_gb"),  # unknown key
    ('host_cache_gb = "lots"\n', "host_cache_gb"),  # wrong type
    ("eviction = 'fifo'\n", "eviction"),  # bad value
    ("host_cache_gb = = 2\n", "not valid TOML"),
])
def test_a_bad_config_file_is_refused_with_a_message_that_names_it(tmp_path, content, needle):
    f = tmp_path / "bad.toml"
    f.write_text(content)
    out = _serve("--config", str(f), "--print-config")
    assert out.returncode == 1 and needle in out.stderr


def test_a_bad_environment_value_is_refused():
    out = _serve("--print-config", env={"KVCACHED_MAX_QUEUED_TASKS": "many"})
    assert out.returncode == 1 and "KVCACHED_MAX_QUEUED_TASKS" in out.stderr


@pytest.fixture
def busy_daemon(run_dir):
    port = free_port()
    h = launch(instance=unique_instance("o"), run_dir=run_dir, host_cache_gb=0.05,
               extra_args=["--metrics-port", str(port), "--log-format", "json",
                           "--stats-interval-s", "0.2", "--log-level", "DEBUG"])
    h.metrics_port = port
    kv = small_kv(block_shape=(16, 2, 64))
    with h.connect() as c:
        c.register_kv_cache(kv)
        keys = BlockHasher("ops").hash_blocks(list(range(16 * 8)), 16)
        c.offload(list(range(8)), keys).wait(10)
        c.load(keys, list(range(10, 18))).wait(10)
        c.lookup(keys)
    yield h
    h.stop()


def test_status_json_has_the_contract_keys_and_the_operator_figures(busy_daemon):
    out = subprocess.run([sys.executable, "-m", "kvcached", "status", "--instance",
                          busy_daemon.instance, "--run-dir", busy_daemon.run_dir, "--json"],
                         capture_output=True, text=True, timeout=30)
    s = json.loads(out.stdout)
    assert {"instance", "pid", "epoch", "state", "protocol_version", "host", "kv", "storage",
            "clients", "tasks", "uptime_s", "bytes", "lookups"} <= s.keys()
    assert {"capacity_bytes", "used_bytes", "evictions"} <= s["host"].keys()
    assert s["bytes"]["d2h"] > 0 and s["bytes"]["h2d"] > 0
    assert s["lookups"]["host_hits"] == 8
    phases = s["tasks"]["copy_phases"]  # one offload and one load ran, each timed in three phases
    assert {k: p["tasks"] for k, p in phases.items()} == {"offload": 1, "load": 1}
    assert all(p[f"{phase}_s"] >= 0 for p in phases.values() for phase in ("wait", "queue", "land"))
    assert all(p["queue_s"] + p["land_s"] > 0 for p in phases.values())
    assert phases["load"]["first_layer_s"] > 0 and "first_layer_s" not in phases["offload"]
    assert 0 <= phases["load"]["prepare_s"] <= phases["load"]["queue_s"]
    assert "prepare_s" not in phases["offload"]
    table = subprocess.run([sys.executable, "-m", "kvcached", "status", "--instance",
                            busy_daemon.instance, "--run-dir", busy_daemon.run_dir],
                           capture_output=True, text=True, timeout=30).stdout
    copies = next(line for line in table.splitlines() if line.startswith("copies"))
    assert "load (1): first layer " in copies and "offload (1): wait " in copies, table
    assert "(plan and fence " in copies.split("offload")[0], table


def test_metrics_parse_and_carry_the_expected_names(busy_daemon):
    body = urllib.request.urlopen(f"http://127.0.0.1:{busy_daemon.metrics_port}/metrics",
                                  timeout=10).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    for name in ("kvcached_bytes_moved", "kvcached_task_duration_seconds", "kvcached_tasks",
                 "kvcached_hit_blocks", "kvcached_evictions", "kvcached_storage_errors",
                 "kvcached_queue_depth", "kvcached_host_bytes_used", "kvcached_host_bytes_capacity"):
        assert name in families, name
    samples = [s for s in families["kvcached_bytes_moved"].samples if s.labels["direction"] == "d2h"]
    assert samples and samples[0].labels["instance"] == busy_daemon.instance and samples[0].value > 0
    ops = {s.labels["op"] for s in families["kvcached_task_duration_seconds"].samples}
    assert {"load", "offload"} <= ops
    phase = {(s.labels["op"], s.labels["phase"]) for s in families["kvcached_copy_phase_seconds"].samples}
    assert phase == {(op, p) for op in ("load", "offload") for p in ("wait", "queue", "land")}
    assert {s.labels["op"]: s.value for s in families["kvcached_copy_tasks"].samples} == \
        {"load": 1, "offload": 1}
    first = families["kvcached_load_first_layer_seconds"].samples
    assert len(first) == 1 and first[0].value > 0


def test_json_logs_with_task_lines_and_periodic_stats(busy_daemon):
    def lines():
        return [json.loads(line) for line in open(busy_daemon.log_path) if line.startswith("{")]

    wait_until(lambda: any(line["msg"].startswith("[stats]") for line in lines()), 10,
               "a [stats] line in the log")
    lines = lines()
    assert lines and all({"ts", "level", "logger", "msg"} <= line.keys() for line in lines)
    assert any(line["msg"].startswith("[stats]") for line in lines)
    assert any(line["msg"].startswith("[task]") for line in lines)


def test_status_watch_refreshes_until_interrupted(busy_daemon):
    proc = subprocess.Popen([sys.executable, "-m", "kvcached", "status", "--instance",
                             busy_daemon.instance, "--run-dir", busy_daemon.run_dir, "--watch", "0.2"],
                            stdout=subprocess.PIPE, text=True)
    seen = []
    while sum("instance" in line for line in seen) < 2:  # two refreshes (one every 0.2 s)
        line = proc.stdout.readline()
        assert line, "the watch ended by itself:\n" + "".join(seen)
        seen.append(line)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=10)
    assert proc.returncode == 0


def test_a_metrics_port_in_use_fails_the_start_clearly(run_dir):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(Exception, match="metrics-port"):
            launch(instance=unique_instance("m"), run_dir=run_dir, host_cache_gb=0.05,
                   extra_args=["--metrics-port", str(port)])


def test_every_reply_and_task_event_carries_the_fields_its_type_names(daemon):
    """The replies of a real daemon against kvcached_proto.replies (which the PROTOCOL.md
    test holds to the document): no required field missing, none the type does not name."""
    from kvcached_proto import Op, pack_block_ids, pack_keys
    from kvcached_proto.replies import EVENT_RESULTS, REPLIES, TaskEvent, missing_fields, reply_fields

    kv = small_kv(num_layers=2, num_blocks=16)
    keys = BlockHasher("typed-replies").hash_blocks(list(range(16 * 4)), 16)
    seen = set()

    def check(op, reply):
        body = {k: v for k, v in reply.items() if k not in ("rid", "ok")}
        assert not missing_fields(op, body), (op, body)
        assert set(body) <= reply_fields(op), (op, set(body) - reply_fields(op))
        seen.add(op)
        return body

    def check_event(c, op, task):
        event = c.wait_event(task, 10)
        assert set(event) == set(TaskEvent.__annotations__), event
        assert set(EVENT_RESULTS[op]) <= set(event["result"]), (op, event)

    with daemon.connect() as c:
        check(Op.HELLO, c.info)
        check(Op.PING, c._request(Op.PING))
        check(Op.STATUS, c._request(Op.STATUS, check=True))
        check(Op.REGISTER_KV, c._request(Op.REGISTER_KV, layout=_layout_with_order(c, kv)))
        blocks = pack_block_ids([0, 1, 2, 3])
        off = check(Op.OFFLOAD, c._request(Op.OFFLOAD, keys=pack_keys(keys), blocks=blocks,
                                           **c.order.fence(None)))
        check_event(c, Op.OFFLOAD, off["task"])
        check(Op.LOOKUP, c._request(Op.LOOKUP, keys=pack_keys(keys)))
        check(Op.LOOKUP_NOTES, c._request(Op.LOOKUP_NOTES, keys=pack_keys(keys),
                                          counts=pack_block_ids([len(keys)])))
        events = check(Op.KEY_EVENTS, c._request(Op.KEY_EVENTS, after=0))
        assert events["gap"] is False and events["newest"] == 0  # kept from this request on
        load = check(Op.LOAD, c._request(Op.LOAD, keys=pack_keys(keys), blocks=pack_block_ids([8, 9, 10, 11])))
        check_event(c, Op.LOAD, load["task"])
        check(Op.PREFETCH, c._request(Op.PREFETCH, keys=pack_keys(keys)))
        flush = check(Op.FLUSH, c._request(Op.FLUSH))
        c.wait_event(flush["task"], 10)
        check(Op.DELETE, c._request(Op.DELETE, keys=pack_keys(keys[:1])))
        check(Op.PAUSE, c._request(Op.PAUSE))  # new tasks are held queued: one to cancel
        more = BlockHasher("typed-replies-2").hash_blocks(list(range(16 * 2)), 16)
        held = c._request(Op.OFFLOAD, keys=pack_keys(more), blocks=pack_block_ids([4, 5]),
                          **c.order.fence(None))
        assert check(Op.CANCEL, c._request(Op.CANCEL, task=held["task"]))["state"] == "cancelled"
        check(Op.RESUME, c._request(Op.RESUME))
        c.wait_event(held["task"], 10)
        check(Op.CLEAR, c._request(Op.CLEAR))
        check(Op.UNREGISTER_KV, c._request(Op.UNREGISTER_KV))
    assert seen == set(REPLIES) - {Op.SHUTDOWN, Op.BYE}  # those two end the connection


def _layout_with_order(c, kv):
    """What register_kv_cache sends, with the client's own order words set up."""
    from kvcached_client.cuda_order import EngineOrder
    from kvcached_client.kv_alloc import describe_kv_cache

    layout = describe_kv_cache(kv)
    c.order = EngineOrder(layout["device"], layout["num_layers"], c._daemon_lost)
    layout["order_segment"] = c.order.name
    return layout


def test_a_clients_own_words_reach_the_status_table_escaped(run_dir):
    """A client's name and its layout's kv_layout are its own strings: `kvcached status --json`
    gives them as they are, the table escapes what a terminal would act on (an escape sequence
    must not drive the operator's terminal)."""
    from kvcached_client import Client
    from kvcached_client.kv_alloc import describe_kv_cache

    h = launch(instance=unique_instance("o"), run_dir=run_dir, host_cache_gb=0.05)
    try:
        kv = small_kv()
        layout = dict(describe_kv_cache(kv), kv_layout="engine\x1b[2J:pool")
        with Client.connect(instance=h.instance, run_dir=run_dir, name="eng\x1b]0;owned\x07") as c:
            c.register_layout(layout)
            args = [sys.executable, "-m", "kvcached", "status", "--instance", h.instance, "--run-dir", run_dir]
            s = json.loads(subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=30).stdout)
            assert s["kv"]["kv_layout"] == "engine\x1b[2J:pool"
            table = subprocess.run(args, capture_output=True, text=True, timeout=30).stdout
        assert "\x1b" not in table and "\x07" not in table
        assert "layout engine\\x1b[2J:pool" in table and "eng\\x1b]0;owned\\x07" in table, table
    finally:
        h.stop()


def test_a_clients_name_cannot_forge_a_log_line(run_dir):
    """The daemon logs a client's name at its handshake: a newline in it stays on that line and
    an escape sequence is escaped, in the text log format (the JSON one quotes them)."""
    from kvcached_client import Client

    h = launch(instance=unique_instance("o"), run_dir=run_dir, host_cache_gb=0.05)
    try:
        with Client.connect(instance=h.instance, run_dir=run_dir, name="eng\n2026-01-01 ERROR FORGED\x1b[2J"):
            pass
        wait_until(lambda: "FORGED" in open(h.log_path).read(), 10, "the handshake logged")
        text = open(h.log_path).read()
        line = next(line for line in text.splitlines() if "FORGED" in line)
        assert "[handshake]" in line and "eng\\n2026-01-01 ERROR FORGED\\x1b[2J" in line, line
        assert "\x1b" not in text
    finally:
        h.stop()


def test_what_clients_repeat_is_logged_a_bounded_number_of_times(run_dir):
    """A hello (or a bye, a closed connection, a refused fd message) is logged per occurrence:
    one client saying hello in a loop wrote 250 KB of log a second. Past 20 lines of a kind in
    10 s the rest are counted, and said by the next such line that goes out; the unit part
    checks that count, the daemon part that 300 hellos write at most 20 lines."""
    import logging

    import msgpack
    import zmq

    from kvcached.logs import LineBudget

    budget, said = LineBudget(lines=2, window_s=1.0), []

    class Catch(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logger = logging.getLogger("kvcached.test-budget")
    logger.addHandler(Catch())
    logger.setLevel(logging.INFO)
    for i in range(5):
        budget.log(logger, logging.INFO, "hello", "hello %d", i)
    time.sleep(1.05)  # the next window
    budget.log(logger, logging.INFO, "hello", "hello %d", 5)
    budget.log(logger, logging.INFO, "other", "bye")
    assert said == ["hello 0", "hello 1", "hello 5 (3 more such lines not logged)", "bye"]
    # one kind per peer (a flood's addresses): past MAX_KINDS the quiet ones are forgotten
    per_peer = LineBudget(lines=1, window_s=0.2)
    for i in range(LineBudget.MAX_KINDS):
        per_peer.log(logger, logging.DEBUG, f"peer {i}", "refused")
    time.sleep(0.25)
    per_peer.log(logger, logging.DEBUG, "peer 0", "refused")  # known: kept, not a new kind
    per_peer.log(logger, logging.DEBUG, "a new peer", "refused")
    assert len(per_peer._kinds) == 2

    with launch(instance=unique_instance("hellos"), run_dir=run_dir, host_cache_gb=0.05) as d:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"ipc://{run_dir}/{d.instance}.sock")
        try:
            for n in range(300):
                s.send(msgpack.packb({"proto": [1, 12], "op": 1, "rid": n, "client": f"loop{n}",
                                      "pid": os.getpid(), "name": "loop"}))
                assert s.poll(5000) and msgpack.unpackb(s.recv())["ok"]
        finally:
            s.close()
            ctx.term()
        assert open(d.log_path).read().count("[handshake] client loop") <= 20


def test_a_sentinel_uri_in_the_environment_is_one_tier():
    """KVCACHED_STORAGE is comma-separated, and a Sentinel URI lists its sentinels with commas:
    it was cut into 'redis+sentinel://h1:26379' (refused: no service) and 'h2:26379/0?...'."""
    sentinel = "redis+sentinel://:pw@h1:26379,h2:26380/0?service=m"
    cfg = _config(env={"KVCACHED_STORAGE": f"{sentinel}, disk:///tmp/x,"})
    assert cfg["storage"] == ["redis+sentinel://:***@h1:26379,h2:26380/0?service=m", "disk:///tmp/x"]


def _startup_log(*args) -> str:
    """What `kvcached serve` logs up to its ready line (then stopped with SIGTERM)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvcached", "serve", *args],
                            stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if " ready: pid " in line or len(lines) > 200:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        lines.append(proc.communicate(timeout=30)[1])
    return "".join(lines)


def test_a_storage_password_where_others_read_it_is_warned_about(tmp_path, run_dir):
    """On the command line every user of the host reads it (ps); in a config file others may
    read, so do they. The warning names the tier without its password."""
    secret, port = "hunter2-secret", free_port()  # no server there: the tier is down, the daemon up
    conf = tmp_path / "kvcached.toml"
    conf.write_text(f'storage = ["redis://:{secret}@127.0.0.1:{port}/1"]\n')
    conf.chmod(0o644)
    common = ["--instance", unique_instance("pw"), "--run-dir", run_dir, "--host-cache-gb", "0.01",
              "--config", str(conf)]
    log = _startup_log(*common, "--storage", f"redis://:{secret}@127.0.0.1:{port}/0")
    assert " ready: pid " in log and secret not in log
    assert f"storage tier redis://:***@127.0.0.1:{port}/0 is on the command line" in log
    assert f"--config {conf} holds a storage password and is readable by group or others" in log
    conf.chmod(0o600)
    log = _startup_log(*common)  # the file private, nothing on the command line: no warning
    assert " ready: pid " in log and "password" not in log
