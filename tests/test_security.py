"""Who may talk to a daemon and what they may do: TCP only with CURVE (loopback included),
segments owned by the daemon's uid, one engine per instance, admin ops for the registered
engine or an operator, unique client ids, tenants kept apart, and a client that shrinks its own
segment fails its own tasks only. Hostile processes run as a second uid where the test machine
allows it (root), else those tests skip with the reason."""
from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import posix_ipc
import pytest
import torch
from conftest import free_port, small_kv, wait_until

from kvcached_client import BlockHasher, Client, DaemonUnavailable, launch, make_namespace
from kvcached_client.kv_alloc import describe_kv_cache
from kvcached_proto import ErrorCode, Op, RequestError, TaskFailed
from kvcached_proto.paths import lock_path, socket_paths

OTHER_UID = 65534  # nobody


def _other_uid():
    if os.getuid() != 0:
        pytest.skip("a second uid needs root to setuid (this test runs as uid %d)" % os.getuid())
    return OTHER_UID


def run_as_other_uid(fn, *args, timeout: float = 30) -> str:
    """fn(*args) in a forked child that dropped to another uid; returns what it returned, as
    text ("error: ..." when it raised). Forked, not exec'd: that uid may not be able to read
    this interpreter's files."""
    uid = _other_uid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(w, str(fn(*args)).encode())
            code = 0
        except BaseException as exc:  # reported to the parent through the pipe
            os.write(w, f"error: {type(exc).__name__}: {exc}".encode())
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    chunks = []
    with os.fdopen(r, "rb") as f:
        while True:
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                break
            if select.select([f], [], [], 0.1)[0]:
                chunk = f.read1(4096)
                if not chunk:
                    break
                chunks.append(chunk)
    os.waitpid(pid, 0)
    return b"".join(chunks).decode()


def keygen(directory, name) -> tuple[str, str]:
    subprocess.run([sys.executable, "-m", "kvcached", "keygen", str(directory), "--name", name],
                   check=True, capture_output=True)
    return os.path.join(directory, f"{name}.key"), os.path.join(directory, f"{name}.key_secret")


@contextlib.contextmanager
def curve_launch(run_dir, instance, tmp_path, extra_args=()):
    server_pub, server_secret = keygen(tmp_path / "server", "daemon")
    allowed_pub, allowed_secret = keygen(tmp_path / "clients", "engine")
    _, stranger_secret = keygen(tmp_path / "strangers", "other")
    allow = tmp_path / "allow"
    allow.mkdir()
    shutil.copy(allowed_pub, allow)
    port = free_port()
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05, extra_args=[
            "--listen", f"tcp://0.0.0.0:{port}", "--curve-secret-key-file", server_secret,
            "--curve-allow-dir", str(allow), *extra_args]) as d:
        yield d, f"tcp://127.0.0.1:{port}", server_pub, allowed_secret, stranger_secret


@pytest.fixture
def curve_daemon(run_dir, instance, tmp_path):
    with curve_launch(run_dir, instance, tmp_path) as parts:
        yield parts


def test_keygen_writes_a_private_secret_key(tmp_path):
    _, secret = keygen(tmp_path, "k")
    assert os.stat(secret).st_mode & 0o077 == 0


def test_a_client_with_an_allowed_key_is_served_over_curve(curve_daemon):
    d, endpoint, server_pub, allowed_secret, _ = curve_daemon
    with Client.connect(d.instance, d.run_dir, timeout=3, endpoint=endpoint,
                        curve_server_key_file=server_pub, curve_client_key_file=allowed_secret) as c:
        assert c.ping() < 1.0
        assert c.status()["instance"] == d.instance


def test_a_tcp_client_is_not_shown_the_hosts_other_clients_paths_or_storage(run_dir, instance, tmp_path):
    """A CURVE client's status has the counts, not the names of the host's other clients, the
    run dir, the registered engine's id or where the storage tiers are; the ipc socket's has."""
    disk = tmp_path / "tier-path-of-the-host"
    with curve_launch(run_dir, instance, tmp_path, ["--storage", f"disk://{disk}"]) as parts:
        d, endpoint, server_pub, allowed_secret, _ = parts
        with d.connect(name="tenant-alice-engine") as engine:
            engine.register_kv_cache(small_kv(num_layers=2, num_blocks=8, block_shape=(16, 2, 8)))
            with Client.connect(d.instance, d.run_dir, timeout=3, endpoint=endpoint, name="bob",
                                curve_server_key_file=server_pub,
                                curve_client_key_file=allowed_secret) as remote:
                local, seen = engine.status(), remote.status()
    shown = json.dumps(local)  # the control: the ipc socket's status names all of it
    secrets = ("tenant-alice-engine", str(run_dir), str(disk), engine.client_id)
    assert all(s in shown for s in secrets), shown
    assert not [s for s in secrets if s in json.dumps(seen)], seen
    assert seen["clients"] == local["clients"] == 2 and seen["kv"]["registered"] is True
    assert [t["uri"] for t in seen["storage"]] == ["disk://(not shown over tcp)"]
    assert seen["storage"][0]["healthy"] is True


def test_the_tcp_view_of_a_sentinel_tier_hides_its_primary_and_keeps_its_health():
    from kvcached.server.status_report import TCP_HIDDEN, degraded, for_tcp_peer

    tier = {"uri": "redis+sentinel://s1:26379,s2:26379/0?service=kv", "healthy": False,
            "primary": "10.0.0.7:6379", "last_error": "ConnectionError: 10.0.0.7:6379 refused",
            "puts": 3}
    seen = for_tcp_peer({"run_dir": "/run/x", "client_names": ["a"], "clients": 1,
                         "kv": {"owner": None, "registered": False}, "storage": [tier]})
    assert seen["storage"] == [{**tier, "uri": f"redis+sentinel://{TCP_HIDDEN}", "primary": TCP_HIDDEN,
                                "last_error": TCP_HIDDEN}]
    assert "10.0.0.7" not in str(seen) and "s1" not in str(seen) and "/run/x" not in str(seen)
    assert seen["clients"] == 1 and seen["kv"] == {"owner": None, "registered": False}
    seen["stalled"] = False
    assert degraded(seen, 0.0) == [f"storage redis+sentinel://{TCP_HIDDEN} unhealthy: {TCP_HIDDEN}"]


def test_a_tcp_client_without_the_daemons_status_segment_is_told_tcp_is_same_host_only(curve_daemon):
    """Before, the client died on the missing segment with no word of why (it reads liveness
    and layer progress from the daemon's shared memory: a client on another host cannot)."""
    d, endpoint, server_pub, allowed_secret, _ = curve_daemon
    with pytest.raises(DaemonUnavailable, match="serves engines on its own host"):
        Client.connect("elsewhere", d.run_dir, timeout=2, endpoint=endpoint,
                       curve_server_key_file=server_pub, curve_client_key_file=allowed_secret)


def test_clients_without_an_allowed_key_cannot_connect(curve_daemon):
    d, endpoint, server_pub, _, stranger_secret = curve_daemon
    with pytest.raises(DaemonUnavailable, match="cannot reach"):
        Client.connect(d.instance, d.run_dir, timeout=2, endpoint=endpoint)  # no CURVE at all
    with pytest.raises(DaemonUnavailable, match="cannot reach"):
        Client.connect(d.instance, d.run_dir, timeout=2, endpoint=endpoint,
                       curve_server_key_file=server_pub, curve_client_key_file=stranger_secret)
    with d.connect() as local:  # the private ipc socket in the run dir is unaffected
        assert local.ping() < 1.0


def test_a_flood_of_stranger_handshakes_is_refused_counted_and_logged_once(curve_daemon):
    """A process starts CURVE handshakes as fast as it can with a key of its own (it needs only
    the daemon's public key): each is refused and counted (`auth_denied`), one line a minute
    says so for its address, and meanwhile the engine on the ipc socket is served and an
    allowed client gets in. (What the flood costs the engine's round trips: bench faults.)"""
    from kvcached.bench.handshake_flood import _STRANGER

    d, endpoint, server_pub, allowed_secret, _ = curve_daemon
    flooder = subprocess.Popen([sys.executable, "-c", _STRANGER, endpoint, server_pub, "3"],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert flooder.stdout.readline().strip() == "ready"
        with d.connect() as engine:
            pings = 0
            while flooder.poll() is None:
                engine.ping(timeout=10)
                pings += 1
                if pings == 50:
                    with Client.connect(d.instance, d.run_dir, timeout=10, endpoint=endpoint,
                                        curve_server_key_file=server_pub,
                                        curve_client_key_file=allowed_secret) as c:
                        assert c.ping() < 10
                time.sleep(0.005)
            tried = int(flooder.stdout.readline())
            denied = engine.status()["connections"]["auth_denied"]
    finally:
        flooder.kill()
        flooder.wait()
    assert pings > 50 and 0 < denied <= tried, (pings, denied, tried)
    log = open(d.log_path).read()
    assert log.count("[auth] refused a CURVE client at 127.0.0.1") == 1, log[-2000:]
    assert d.alive()


def test_an_allowed_tcp_clients_junk_frames_close_its_connection(curve_daemon):
    """Three large frames in a row that are no request close the connection over TCP as over
    ipc: the frame's own peer (its Peer-Address, an IP on TCP) is checked to be the counted
    connection's before a strike counts, and that check must not let TCP floods pass."""
    import zmq
    import zmq.auth

    d, endpoint, server_pub, allowed_secret, _ = curve_daemon
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(allowed_secret)
        sock.curve_serverkey = zmq.auth.load_certificate(server_pub)[0]
        sock.connect(endpoint)
        for _ in range(3):
            sock.send(b"\xff" * (100 << 10))
        wait_until(lambda: "closing the connection of address 127.0.0.1" in open(d.log_path).read(),
                   10, "the TCP connection closed for its junk")
        with d.connect() as c:
            assert c.status()["requests"]["refused"] >= 3
    finally:
        sock.close(linger=0)
        ctx.term()


def test_the_zap_handler_lets_in_the_allowed_keys_only():
    """Its answers (ZAP 1.0, RFC 27): 200 and the key as user id for an allowed CURVE key; 400
    for another key, another mechanism, or a request it cannot read - each counted."""
    import zmq
    from zmq.utils import z85

    from kvcached.server.zap import ZapHandler

    allowed, other = zmq.curve_keypair()[0], zmq.curve_keypair()[0]
    ctx = zmq.Context()
    zap = ZapHandler(ctx, frozenset([allowed]))
    try:
        head = [b"1.0", b"7", b"", b"10.0.0.1", b""]
        assert zap._answer(head + [b"CURVE", z85.decode(allowed)]) == [
            b"1.0", b"7", b"200", b"OK", allowed, b""]
        for msg in (head + [b"CURVE", z85.decode(other)], head + [b"NULL"],
                    head + [b"CURVE", z85.decode(allowed), b"extra"], [b"1.0", b"8"], [b"1.0"]):
            reply = zap._answer(msg)
            assert reply[2] == b"400" and len(reply) == 6, (msg, reply)
        assert zap.denied == 5
    finally:
        zap.stop()
        ctx.term()


@pytest.mark.parametrize("case, needle", [
    ("group_writable_dir", "writable by group or others"),
    ("world_writable_key", "engine.key: anyone who can write it"),
    ("junk_key", "junk.key is not a CURVE public key certificate"),
    ("fifo_key", "fifo.key is not a regular file"),  # and opening it does not hang the start
    ("linked_key", "engine.key: anyone who can write it"),  # a link to a file others may write
    ("empty", "no *.key certificate in it"),
    ("other_owner", "owned by uid"),
])
def test_an_allow_dir_that_others_could_write_or_that_holds_no_usable_key_refuses_the_start(
        run_dir, instance, tmp_path, case, needle):
    """Who can write a key into the allow dir admits a client over TCP; and a file there that is
    no key made pyzmq log it and then admit no client at all, while the daemon said it was
    listening with the allow-list."""
    _, server_secret = keygen(tmp_path / "server", "daemon")
    allowed_pub, _ = keygen(tmp_path / "clients", "engine")
    allow = tmp_path / "allow"
    allow.mkdir(mode=0o755)
    os.chmod(allow, 0o755)
    if case != "empty":
        shutil.copy(allowed_pub, allow)
        os.chmod(allow / "engine.key", 0o644)
    if case == "group_writable_dir":
        os.chmod(allow, 0o775)
    elif case == "world_writable_key":
        os.chmod(allow / "engine.key", 0o666)
    elif case == "fifo_key":
        os.mkfifo(allow / "fifo.key", 0o644)
    elif case == "junk_key":
        (allow / "junk.key").write_text("not a certificate\n")
        os.chmod(allow / "junk.key", 0o644)
    elif case == "linked_key":
        shared = tmp_path / "shared.key"
        shutil.move(allow / "engine.key", shared)
        os.chmod(shared, 0o666)
        os.symlink(shared, allow / "engine.key")
    elif case == "other_owner":
        if os.getuid() != 0:
            pytest.skip("chown to another uid needs root")
        os.chown(allow / "engine.key", OTHER_UID, -1)
        needle = "engine.key: anyone who can write it can admit a client: owned by uid"
    out = subprocess.run([sys.executable, "-m", "kvcached", "serve", "--instance", instance,
                          "--run-dir", run_dir, "--listen", f"tcp://127.0.0.1:{free_port()}",
                          "--curve-secret-key-file", server_secret, "--curve-allow-dir", str(allow)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and needle in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_an_allow_dir_laid_out_as_a_kubernetes_secret_volume_is_taken(run_dir, instance, tmp_path):
    """A Secret volume is a sticky 1777 directory of links into a root-owned `..data`: others
    may add files there (theirs: refused one by one) but not replace ours, so it is taken."""
    server_pub, server_secret = keygen(tmp_path / "server", "daemon")
    allowed_pub, allowed_secret = keygen(tmp_path / "clients", "engine")
    allow = tmp_path / "allow"
    allow.mkdir()
    os.chmod(allow, 0o1777)
    data = allow / "..2026_11_26_00_00_00.1"
    data.mkdir(mode=0o755)
    shutil.copy(allowed_pub, data / "engine.key")
    os.chmod(data / "engine.key", 0o644)
    os.symlink(data.name, allow / "..data")
    os.symlink("..data/engine.key", allow / "engine.key")
    port = free_port()
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05, extra_args=[
            "--listen", f"tcp://127.0.0.1:{port}", "--curve-secret-key-file", server_secret,
            "--curve-allow-dir", str(allow)]) as d:
        with Client.connect(d.instance, d.run_dir, timeout=5, endpoint=f"tcp://127.0.0.1:{port}",
                            curve_server_key_file=server_pub,
                            curve_client_key_file=allowed_secret) as c:
            assert c.ping() < 1.0


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "localhost"])
def test_tcp_without_curve_keys_does_not_start_loopback_included(run_dir, instance, host):
    out = subprocess.run([sys.executable, "-m", "kvcached", "serve", "--instance", instance,
                          "--run-dir", run_dir, "--listen", f"tcp://{host}:{free_port()}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "TCP needs CURVE keys" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_run_dir_another_user_made_first_is_refused_with_the_way_out(tmp_path, instance):
    """/tmp is open to all: another user may make the default run dir first. The daemon never
    uses a run dir it does not own; it says so, and how to give it another one."""
    other = _other_uid()
    path = str(tmp_path / "taken")
    os.mkdir(path, 0o700)
    os.chown(path, other, other)
    out = subprocess.run([sys.executable, "-m", "kvcached", "serve", "--instance", instance,
                          "--run-dir", path], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"belongs to uid {other}" in out.stderr, out.stderr
    assert "--run-dir, $KVCACHED_RUN_DIR, or $XDG_RUNTIME_DIR" in out.stderr
    assert "Traceback" not in out.stderr and os.listdir(path) == []


def test_one_tenants_keys_are_never_served_to_another(daemon):
    kv = small_kv(num_layers=2, num_blocks=16, block_shape=(16, 2, 8))
    tokens = list(range(4 * 16))
    keys_a = BlockHasher(make_namespace("m", "bfloat16", tenant="alice")).hash_blocks(tokens, 16)
    keys_b = BlockHasher(make_namespace("m", "bfloat16", tenant="bob")).hash_blocks(tokens, 16)
    with daemon.connect() as c:
        c.register_kv_cache(kv)
        c.offload(range(4), keys_a).wait(10)
        assert c.lookup(keys_a) == (4, 0)
        assert c.lookup(keys_b) == (0, 0)  # same tokens, same model: another tenant's keys
        assert c.load(keys_b, range(8, 12)).wait(10) == 0


# another uid ---------------------------------------------------------------------------------

def _raw_hello(endpoint: str) -> str:
    import msgpack
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send(msgpack.packb({"proto": [1, 1], "op": 1, "rid": 1, "client": "intruder", "pid": 1}))
    answered = s.poll(1500)
    s.close(0)
    ctx.term()
    return "answered" if answered else "silent"


def _create_segment(name: str, size: int) -> str:
    posix_ipc.SharedMemory(name, posix_ipc.O_CREX, 0o600, size).close_fd()
    return "created"


def test_another_uid_gets_no_answer_on_tcp_or_the_ipc_socket(curve_daemon):
    d, endpoint, *_ = curve_daemon
    for target in (endpoint, f"ipc://{d.run_dir}/{d.instance}.sock"):
        assert run_as_other_uid(_raw_hello, target) == "silent", target
    with d.connect() as c:
        assert c.status()["clients"] == 1  # nobody got in


def test_a_segment_created_by_another_uid_is_refused(daemon):
    kv = small_kv(num_layers=1, num_blocks=4, block_shape=(16, 2, 8))
    layout = describe_kv_cache(kv)
    size = layout["allocations"][0]["size"]
    forged = f"/kvcached.{os.getuid()}.kv.{os.getpid()}.999"  # our uid's name, their file
    assert run_as_other_uid(_create_segment, forged, size) == "created"
    try:
        layout["allocations"][0]["name"] = forged
        with daemon.connect() as c:
            with pytest.raises(RequestError) as e:
                c._request(Op.REGISTER_KV, layout=layout)
            assert e.value.code == ErrorCode.KV_MISMATCH and f"uid {OTHER_UID}" in e.value.message
            assert c.status()["kv"]["registered"] is False
    finally:
        posix_ipc.unlink_shared_memory(forged)


def test_a_segment_writable_by_others_is_refused(daemon):
    kv = small_kv(num_layers=1, num_blocks=4, block_shape=(16, 2, 8))
    name = describe_kv_cache(kv)["allocations"][0]["name"]
    os.chmod(f"/dev/shm{name}", 0o666)
    with daemon.connect() as c:
        with pytest.raises(RequestError, match="writable by group or others"):
            c.register_kv_cache(kv)


def _links(pairs) -> str:
    for target, name in pairs:
        os.symlink(target, name)
    return "planted"


def test_links_planted_in_an_open_run_dir_are_not_followed(run_dir, instance, tmp_path):
    """The run dir was writable by everyone before the daemon started (a Kubernetes emptyDir
    is 0777): another uid put links to a file of ours where the instance lock and the sockets
    go. The daemon takes the lock as a new file of its own, removes the links, and the file they
    named keeps its bytes (it was truncated and given the daemon's pid before)."""
    os.chmod(run_dir, 0o777)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    names = [lock_path(run_dir, instance), *socket_paths(run_dir, instance)]
    assert run_as_other_uid(_links, [(str(victim), n) for n in names]) == "planted"
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05) as d:
        assert victim.read_bytes() == b"precious\n"
        st = os.lstat(names[0])
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
        assert open(names[0]).read().strip() == str(d.pid)
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        with d.connect() as c:
            assert c.ping() >= 0
        assert "(planted?); removed" in open(d.log_path).read()
    assert victim.read_bytes() == b"precious\n"


def test_a_run_dir_that_is_another_users_link_is_refused(instance):
    """/tmp is everyone's: a link another user made where the run dir goes (to a directory of
    ours, which the daemon would make 0700) is refused, not followed."""
    _other_uid()
    shared = tempfile.mkdtemp(prefix="kvshared-", dir="/tmp")  # sticky and open, as /tmp is
    try:
        os.chmod(shared, 0o1777)
        target, link = os.path.join(shared, "ours"), os.path.join(shared, "run")
        os.mkdir(target, 0o755)
        assert run_as_other_uid(_links, [(target, link)]) == "planted"
        out = subprocess.run([sys.executable, "-m", "kvcached", "serve", "--instance", instance,
                              "--run-dir", link], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and f"is a link of uid {OTHER_UID}" in out.stderr, out.stderr
        assert stat.S_IMODE(os.stat(target).st_mode) == 0o755
    finally:
        shutil.rmtree(shared)


# one engine per instance, admin ops -----------------------------------------------------------

KEYS_A = BlockHasher("engine-a").hash_blocks(list(range(4 * 16)), 16)


def _registered_engine(daemon):
    kv = small_kv(num_layers=2, num_blocks=16, block_shape=(16, 2, 8), seed=1)
    c = daemon.connect()
    c.register_kv_cache(kv)
    c.offload(range(4), KEYS_A).wait(10)
    return c, kv


def test_a_second_register_kv_is_refused_and_the_first_engine_keeps_its_bytes(daemon):
    a, kv_a = _registered_engine(daemon)
    kv_b = small_kv(num_layers=2, num_blocks=16, block_shape=(16, 2, 8), seed=2)
    with a, daemon.connect() as b:
        with pytest.raises(RequestError) as e:
            b.register_kv_cache(kv_b)
        assert e.value.code == ErrorCode.KV_IN_USE
        assert a.status()["kv"]["owner"] == a.client_id
        # A's load lands in A's memory, with A's bytes; B's memory is untouched
        b_before = [t.clone() for layer in kv_b for t in layer]
        assert a.load(KEYS_A, range(8, 12)).wait(10) == 4
        for k, v in kv_a:
            assert torch.equal(k[8:12], k[0:4]) and torch.equal(v[8:12], v[0:4])
        assert all(torch.equal(x, y) for x, y in zip(b_before, [t for layer in kv_b for t in layer]))


def test_the_same_engine_may_register_again(daemon):
    a, kv = _registered_engine(daemon)
    with a:
        reply = a.register_kv_cache(kv)
        assert reply["kept_blocks"] == 4


def test_admin_ops_are_forbidden_to_an_engine_that_is_not_the_registered_one(daemon):
    a, _ = _registered_engine(daemon)
    with a, daemon.connect() as b:
        for op in ("clear", "pause", "resume", "unregister_kv_cache", "shutdown"):
            with pytest.raises(RequestError) as e:
                getattr(b, op)()
            assert e.value.code == ErrorCode.FORBIDDEN, op
            s = a.status()
            assert (s["state"], s["kv"]["owner"], s["host"]["blocks"]) == ("normal", a.client_id, 4)
            assert a.lookup(KEYS_A) == (4, 0) and daemon.alive()


def test_admin_ops_are_forbidden_while_no_engine_is_registered(daemon):
    with daemon.connect() as c:
        with pytest.raises(RequestError) as e:
            c.clear()
        assert e.value.code == ErrorCode.FORBIDDEN


def test_the_registered_engine_and_an_operator_may_send_admin_ops(daemon):
    a, _ = _registered_engine(daemon)
    with a, daemon.connect(role="operator") as op:
        a.pause()
        a.resume()
        assert op.clear(tier="host") == 4
        op.pause()
        op.resume()
        assert a.status()["state"] == "normal"
        op.shutdown()
    daemon.proc.wait(30)
    assert daemon.proc.returncode == 0


def test_the_operator_role_is_refused_over_tcp(curve_daemon):
    d, endpoint, server_pub, allowed_secret, _ = curve_daemon
    with pytest.raises(RequestError) as e:
        Client.connect(d.instance, d.run_dir, timeout=3, endpoint=endpoint, role="operator",
                       curve_server_key_file=server_pub, curve_client_key_file=allowed_secret)
    assert e.value.code == ErrorCode.FORBIDDEN


def test_a_client_id_in_use_by_another_connection_is_refused(daemon):
    a, kv = _registered_engine(daemon)
    with a:
        impostor = Client(daemon.instance, daemon.run_dir, timeout=3)
        impostor.client_id = a.client_id  # the id status shows as kv.owner
        with pytest.raises(RequestError) as e:
            impostor._open()
        assert e.value.code == ErrorCode.CLIENT_ID_IN_USE
        impostor.close()
        assert a.status()["kv"]["owner"] == a.client_id
        assert a.load(KEYS_A, range(8, 12)).wait(10) == 4


def test_a_closed_or_killed_engine_leaves_the_instance_to_the_next(daemon):
    a, _ = _registered_engine(daemon)
    a.close()
    with daemon.connect() as b:
        b.register_kv_cache(small_kv(num_layers=2, num_blocks=16, block_shape=(16, 2, 8)))
    engine = subprocess.Popen([sys.executable, "-c", _HOLD_ENGINE, daemon.instance, daemon.run_dir],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline().strip() == "registered"
        engine.kill()
        engine.wait(10)
        with daemon.connect() as c:  # at once: the dead engine is reaped at register_kv
            c.register_kv_cache(small_kv(num_layers=2, num_blocks=16, block_shape=(16, 2, 8)))
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(10)


_HOLD_ENGINE = """
import sys, torch
from kvcached_client import Client, allocate_kv_cache
c = Client.connect(sys.argv[1], sys.argv[2], timeout=10)
c.register_kv_cache(allocate_kv_cache(2, 16, (16, 2, 8), torch.bfloat16))
print("registered", flush=True)
sys.stdin.read() if not sys.stdin.isatty() else None
import time; time.sleep(60)
"""


# a client that shrinks its own segment ------------------------------------------------------

def test_a_truncated_segment_fails_its_clients_tasks_and_the_daemon_lives(daemon):
    a, kv = _registered_engine(daemon)
    with a:
        name = describe_kv_cache(kv)["allocations"][0]["name"]
        shm = posix_ipc.SharedMemory(name, flags=0)
        os.ftruncate(shm.fd, 0)
        shm.close_fd()
        assert a.load(KEYS_A, range(8, 12)).wait(10) == 0  # failed: nothing valid
        assert daemon.alive()
        lost = a.status()["kv"]["lost"]
        assert lost and name in lost
        with pytest.raises(RequestError) as e:
            a.offload(range(4), BlockHasher("after").hash_blocks(list(range(64)), 16))
        assert e.value.code == ErrorCode.KV_MISMATCH
        assert a.check() == "ok" and a.status()["host"]["pinned_blocks"] == 0
    # another engine's memory is served the bytes stored before the truncation, exactly
    fresh = small_kv(num_layers=2, num_blocks=16, block_shape=(16, 2, 8), seed=9)
    reference = small_kv(num_layers=2, num_blocks=16, block_shape=(16, 2, 8), seed=1)
    with daemon.connect() as b:
        b.register_kv_cache(fresh)
        assert b.load(KEYS_A, range(8, 12)).wait(10) == 4
        for (k, v), (rk, rv) in zip(fresh, reference):
            assert torch.equal(k[8:12], rk[0:4]) and torch.equal(v[8:12], rv[0:4])


def test_a_segment_truncated_during_an_offload_stores_nothing(daemon):
    kv = small_kv(num_layers=8, num_blocks=512, block_shape=(16, 8, 64), seed=3)
    keys = BlockHasher("trunc").hash_blocks(list(range(512 * 16)), 16)
    with daemon.connect(timeout=30) as c:
        c.register_kv_cache(kv)
        name = describe_kv_cache(kv)["allocations"][0]["name"]
        c.pause()
        task = c.offload(range(512), keys)
        shm = posix_ipc.SharedMemory(name, flags=0)
        os.ftruncate(shm.fd, 4096)
        shm.close_fd()
        c.resume()
        with pytest.raises(TaskFailed):
            task.wait(30)
        assert daemon.alive() and c.lookup(keys) == (0, 0)
        assert c.check() == "ok"


def test_only_the_registered_engine_may_copy_into_or_out_of_its_kv(daemon):
    a, kv = _registered_engine(daemon)
    with a, daemon.connect() as b:
        before = [t.clone() for layer in kv for t in layer]
        for call in (lambda: b.load(KEYS_A, range(8, 12)),
                     lambda: b.offload(range(4), BlockHasher("b").hash_blocks(list(range(64)), 16))):
            with pytest.raises(RequestError) as e:
                call()
            assert e.value.code == ErrorCode.FORBIDDEN
        assert all(torch.equal(x, y) for x, y in zip(before, [t for layer in kv for t in layer]))
        assert b.lookup(KEYS_A) == (4, 0)  # lookups stay open to every client


def _connect_error(instance: str, run_dir: str) -> str:
    try:
        Client.connect(instance, run_dir, timeout=1).close()
        return "connected"
    except DaemonUnavailable as exc:
        return str(exc)


def test_an_engine_of_another_user_is_told_whose_daemon_has_the_name(daemon):
    """A sidecar container running as root and an engine container as another user (sharing
    the run dir and /dev/shm): the engine was told "no kvcached daemon named X; start one" about
    a running daemon. Now it is told a daemon of which uid has the name, and why it is not its."""
    said = run_as_other_uid(_connect_error, daemon.instance, daemon.run_dir)
    assert f"no kvcached daemon of this user (uid {OTHER_UID}) named {daemon.instance!r}" in said, said
    assert f"a daemon of uid {os.getuid()} has that name" in said and "run the engine as that user" in said
    assert "start one" in _connect_error(daemon.instance + "x", daemon.run_dir)  # no one's: start one
