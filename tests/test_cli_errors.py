"""A newcomer's mistakes get one clear line, not a traceback; the CLI's small promises hold."""
import os
import socket
import subprocess
import sys

import pytest
import torch

from kvcached_client import launch


def _kvcached(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "kvcached", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def _one_line_error(out, *fragments):
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("kvcached serve:")]
    assert len(lines) == 1, out.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def curve_keys(tmp_path):
    import zmq.auth

    _, secret = zmq.auth.create_certificates(str(tmp_path), "daemon")
    os.chmod(secret, 0o600)
    allow = tmp_path / "allow"
    allow.mkdir()
    zmq.auth.create_certificates(str(allow), "engine")  # a client key (and its secret: unread)
    return ["--curve-secret-key-file", secret, "--curve-allow-dir", str(allow)]


@pytest.mark.parametrize("args, fragments", [
    (["--run-dir", "/dev/null/run"], ["--run-dir /dev/null/run", "cannot create it"]),
    (["--storage", "disk:///dev/null/disk"], ["cannot use /dev/null/disk as the disk tier"]),
    (["--storage", "disk:///tmp/kv-x?capacity_gb=abc"], ["capacity_gb='abc' is not a number"]),
    (["--storage", "redis://localhost:6379/x"], ["must be integers"]),
    (["--host-cache-gb", "4000"], ["--host-cache-gb 4000", "this machine can give"]),
    (["--listen", "tcp://127.0.0.1:notaport"], ["port number"]),
    (["--storage", "disk:///tmp/kv-x?capacity_gb=inf"], ["capacity_gb must be a positive, finite"]),
    (["--storage", "redis://:pw@localhost:notaport/0"], ["port must be an integer", ":***@"]),
], ids=["run-dir", "disk-path", "capacity", "redis-db", "host-cache", "listen-port",
        "capacity-inf", "redis-port"])
def test_bad_settings_get_one_clear_line(run_dir, instance, args, fragments):
    base = ["serve", "--instance", instance] + ([] if "--run-dir" in args else ["--run-dir", run_dir])
    _one_line_error(_kvcached(*base, *args), *fragments)


def test_a_binary_config_file_gets_one_clear_line(run_dir, instance, tmp_path):
    config = tmp_path / "kvcached.toml"
    config.write_bytes(bytes(range(256)))
    _one_line_error(_kvcached("serve", "--instance", instance, "--run-dir", run_dir,
                              "--config", str(config)), "not a text file")


def test_keygen_into_a_missing_directory_makes_it_or_says_why(tmp_path):
    out = _kvcached("keygen", str(tmp_path / "no" / "such"))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert (tmp_path / "no" / "such" / "kvcached.key_secret").exists()
    blocked = tmp_path / "file"
    blocked.write_text("x")
    out = _kvcached("keygen", str(blocked / "sub"))
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr


def test_a_cuda_device_without_a_gpu_gets_one_clear_line(run_dir, instance):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _one_line_error(_kvcached("serve", "--instance", instance, "--run-dir", run_dir,
                              "--device", "cuda:0"), "--device cuda:0", "no CUDA device")


def test_a_listen_port_in_use_gets_one_clear_line(run_dir, instance, curve_keys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        _one_line_error(_kvcached("serve", "--instance", instance, "--run-dir", run_dir,
                                  "--listen", f"tcp://127.0.0.1:{port}", *curve_keys),
                        f"--listen tcp://127.0.0.1:{port}", "cannot listen there")


def test_version():
    out = _kvcached("--version")
    assert out.returncode == 0 and out.stdout.startswith("kvcached 0.") and "protocol 1.15" in out.stdout


def test_status_says_no_daemon_at_once(run_dir, instance):
    """Without waiting out --timeout (30 s here; the test gives it 20)."""
    out = _kvcached("status", "--instance", instance, "--run-dir", run_dir, "--timeout", "30",
                    timeout=20)
    assert out.returncode == 3 and "no daemon" in out.stderr


def test_status_of_a_killed_daemon_says_no_daemon_at_once(run_dir, instance):
    h = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05)
    h.kill()  # its socket files and segment stay behind
    try:
        out = _kvcached("status", "--instance", instance, "--run-dir", run_dir, "--timeout", "30",
                        timeout=20)
        assert out.returncode == 3 and "process is gone" in out.stderr, out.stderr
    finally:
        from conftest import sweep_crashed

        sweep_crashed(instance)


def test_status_watch_into_head_ends_quietly(daemon):
    cmd = (f"set -o pipefail; {sys.executable} -m kvcached status --instance {daemon.instance} "
           f"--run-dir {daemon.run_dir} --watch 0.05 | head -n 3")
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_an_unknown_kvcached_variable_is_warned_about(run_dir, instance):
    env = {**os.environ, "KVCACHED_HOST_CACHE_G": "2"}
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=0.05, env=env) as h:
        h.connect().close()
        with open(h.log_path) as f:
            log = f.read()
    assert "KVCACHED_HOST_CACHE_G is not a kvcached setting" in log
    assert "did you mean KVCACHED_HOST_CACHE_GB" in log


def test_a_refused_second_daemon_says_nothing_of_the_running_one_stopping(daemon):
    out = _kvcached("serve", "--instance", daemon.instance, "--run-dir", daemon.run_dir)
    _one_line_error(out, "already running")
    assert "stopped" not in out.stderr
    with daemon.connect() as c:
        assert c.ping() < 5


def test_the_distribution_is_kvcached_sidecar_and_the_names_users_type_stay():
    """`kvcached` on the package index is another project: this one installs as
    kvcached-sidecar, with the import names and the command unchanged."""
    from importlib.metadata import distribution

    dist = distribution("kvcached-sidecar")
    scripts = [ep.value for ep in dist.entry_points if ep.group == "console_scripts"]
    assert scripts == ["kvcached.cli:main"]
    # and vLLM's plugin group (client/vllm/plugin.py): the connector's name in vLLM's factory
    assert [ep.value for ep in dist.entry_points if ep.group == "vllm.general_plugins"] == \
        ["kvcached_client.vllm.plugin:register"]
    import kvcached
    import kvcached_client
    import kvcached_proto

    assert kvcached.__version__ == dist.version
    assert kvcached_client.Client and kvcached_proto.PROTOCOL_VERSION
