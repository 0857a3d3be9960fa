"""vLLM's OpenAI server with the connector, started as README says, checked over HTTP: a host hit,
a disk hit after the daemon restarts, outputs equal to vLLM's own without the connector (an
engine with its CPU threads pinned alike) while a one-token-changed control differs, both cache
resets vLLM has (`/reset_prefix_cache?reset_external=true`, `/pause` with clear_cache) leaving no
hit behind, and nothing left in /dev/shm once the server stops. A Llama with real random
weights."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm: ./scripts/test.sh --with-vllm")
# each test starts real engines (a minute each on 2 cores) and the first builds its reference:
# the suite-wide 120 s per test is too short for them
pytestmark = pytest.mark.timeout(600)

from conftest import disk_uri, free_port, no_tasks, sweep_crashed, wait_until  # noqa: E402

from kvcached_client import launch  # noqa: E402
from kvcached_proto.liveness import pid_alive  # noqa: E402

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
sys.path.insert(0, SCRIPTS)
import vllm_driver  # noqa: E402
from vllm_model import write_model  # noqa: E402

vllm_driver.overlap_engines()  # engine after engine: each starts warm and stops behind

BLOCK = vllm_driver.BLOCK
PROMPTS = vllm_driver.prompts()
PREFIX = len(vllm_driver.PREFIX)
# alike with and without the connector: vLLM CPU reserves one more core when one is configured
ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_SERVER_DEV_MODE": "1"}


class Server:
    """`python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs; in a vllm-cpu
    venv `vllm serve` fails: its distribution is named vllm-cpu)."""

    def __init__(self, model: str, log_path: str, kv_config: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model
        args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--port", str(self.port), "--host", "127.0.0.1", "--skip-tokenizer-init",
                "--block-size", str(BLOCK), "--enforce-eager", "--dtype", "bfloat16",
                "--max-model-len", "1024", "--seed", "0", "--gpu-memory-utilization", "0.1",
                "--enable-prompt-tokens-details"]
        if kv_config is not None:
            args += ["--kv-transfer-config", json.dumps(kv_config)]
        self.log_path = log_path
        self.proc = subprocess.Popen(args, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **ENV}, start_new_session=True)
        deadline = time.monotonic() + 300
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start:\n" + self.log()[-4000:])
            time.sleep(1)

    def log(self) -> str:
        return open(self.log_path, errors="replace").read()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def post(self, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(),
                                     headers={"content-type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
        return json.loads(text) if text.strip().startswith(("{", "[")) else {}

    def complete(self, name: str) -> tuple[list[int], int]:
        """Greedy tokens for prompt `name` and its cached prompt tokens. vLLM's own prefix cache
        is reset first, so every cached token came through the connector."""
        self.post("/reset_prefix_cache")
        out = self.post("/v1/completions", {"model": self.model, "prompt": PROMPTS[name],
                                            "max_tokens": 8, "temperature": 0,
                                            "return_token_ids": True})
        details = out["usage"].get("prompt_tokens_details") or {}
        return out["choices"][0]["token_ids"], details.get("cached_tokens") or 0

    def metric(self, name: str, **labels) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        want = "".join(f'(?=[^}}]*{k}="{v}")' for k, v in labels.items())
        total = 0.0
        for m in re.finditer(rf"^{re.escape(name)}(?:_total)?{{{want}[^}}]*}} ([0-9.e+]+)$", text, re.M):
            total += float(m.group(1))
        return total

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def _kv_segments() -> set[str]:
    """KV segments of other processes than this one whose maker is gone (this test process's
    own, from the in-process references, go when their tensors are collected; a live maker's
    is another test's, run beside this one, still in use)."""
    ours, prefix = f"kvcached.{os.getuid()}.kv.{os.getpid()}.", f"kvcached.{os.getuid()}.kv."
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix) and not n.startswith(ours)
            and not pid_alive(int(n[len(prefix):].split(".")[0]))}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(str(tmp_path_factory.mktemp("srv") / "model"))


@pytest.fixture(scope="module")
def reference(model):
    """vLLM's own greedy outputs of this model (an engine without the connector, one reserved
    CPU as the servers'): A, B and X whole, and B and X after a hit of their first 14 and 3
    blocks in vLLM's own prefix cache (a hit from the connector must give these). Its engine
    core runs in a process of its own, as a server's does: on some CPUs vLLM's two modes give
    other bf16 results (with AMX: A 735, 467, 732, ... against 735, 467, 678, ... in process)."""
    eng = vllm_driver.EngineProcess(model, "--connector", "none")
    try:
        out = {name: eng.gen(name)["tokens"] for name in ("A", "B", "X")}
        for key, name, blocks in (("B@hit", "B", PREFIX // BLOCK), ("X@3", "X", 3)):
            hit = eng.step("genk", f"{name} {blocks}")
            assert hit["num_cached_tokens"] == blocks * BLOCK, hit
            out[key] = hit["tokens"]
    finally:
        eng.close()
    assert out["X"] != out["B"], "the control must differ: the weights ignore the prompt"
    return out


def _wait_attached(daemon):
    vllm_driver.wait_attached(daemon)


def _where(server: Server, daemon) -> dict:
    """What a missed hit needs to be read: the connector's counters (were A's blocks saved,
    skipped, refused?) and the daemon's tasks, host tier and lookups."""
    names = ("saved_blocks", "save_skipped_blocks", "daemon_errors", "loaded_blocks", "load_errors")
    out = {}
    try:  # (a server or daemon gone: the failure's message says so instead of raising)
        out.update({n: server.metric(f"vllm:kvcached_{n}") for n in names})
        with daemon.connect() as c:
            s = c.status()
        out.update({k: s.get(k) for k in ("tasks", "host", "lookups", "clients")})
    except Exception as exc:  # noqa: BLE001 - a diagnostic: say why it is missing
        out["unread"] = repr(exc)
    out["log"] = [ln for ln in server.log().splitlines() if "kvcached" in ln][-20:]
    return out


def test_the_openai_server_as_the_readme_runs_it(model, reference, tmp_path, run_dir, instance):
    disk = str(tmp_path / "disk")
    storage = disk_uri(disk, 0.2)
    daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.2,
                    extra_args=["--storage", storage], wait_storage=True)
    before = _kv_segments()
    server = Server(model, str(tmp_path / "server.log"), {
        "kv_connector": "KvcachedConnector", "kv_connector_module_path": "kvcached_client.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"instance": instance, "run_dir": run_dir}})
    try:
        _wait_attached(daemon)
        assert server.complete("A") == (reference["A"], 0)
        tokens, cached = server.complete("B")  # the shared prefix from the daemon's host tier
        assert tokens == reference["B@hit"] and cached == PREFIX, (cached, _where(server, daemon))
        tokens, cached = server.complete("X")  # the control: the blocks past its change miss
        assert cached == 3 * BLOCK and tokens == reference["X@3"] != reference["B@hit"]
        assert server.metric("vllm:prompt_tokens_cached_by_source", source="host") >= PREFIX
        # the connector's own counters (stats.py): B's and X's hits loaded, none recomputed
        assert server.metric("vllm:kvcached_loaded_blocks") == PREFIX // BLOCK + 3
        assert server.metric("vllm:kvcached_saved_blocks") >= PREFIX // BLOCK
        assert server.metric("vllm:kvcached_load_errors") == 0
        with daemon.connect() as c:
            c.flush().wait(30)
        daemon.stop()
        daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.2,
                        extra_args=["--storage", storage], wait_storage=True)
        _wait_attached(daemon)
        tokens, cached = server.complete("B")  # from disk: prefetched while the request waited
        assert tokens == reference["B@hit"] and cached == PREFIX, cached
        assert server.metric("vllm:prompt_tokens_cached_by_source", source="disk") >= PREFIX
        with daemon.connect() as c:
            loaded = c.status()["lookups"]
        assert loaded["loaded_from_storage"] >= PREFIX // BLOCK, loaded
        server.post("/reset_prefix_cache?reset_external=true")  # a weight update's reset
        assert server.complete("B") == (reference["B"], 0)
        with daemon.connect() as c:  # its save lands after the reply (under load: after the next
            wait_until(lambda: no_tasks(c), 30, "B's save in the host tier")  # request's lookup)
        tokens, cached = server.complete("B")  # stored again since, under the new salt
        assert cached >= PREFIX
        server.post("/pause?clear_cache=true")
        server.post("/resume")
        assert server.complete("B") == (reference["B"], 0)
    finally:
        code = server.stop()
        daemon.stop()
        sweep_crashed(instance)
    assert code is not None
    assert _kv_segments() <= before, "the server left its staging segment in /dev/shm"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ours = [line for line in server.log().splitlines()  # a traceback through kvcached's code
            if f'File "{root}/client/' in line or f'File "{root}/kvcached/' in line]
    assert not ours, ours


def test_inside_vllms_multiconnector_the_server_keeps_serving_and_hits_come_from_kvcached(
        model, reference, tmp_path, run_dir, instance):
    """kvcached, configured as README says, beside vLLM's ExampleConnector in a MultiConnector.
    Before, the API server could not rebuild the connector's stats by name (vLLM registers no
    name for a connector given by module path): the first request got a 500 and the server
    died. Now B's prefix comes from kvcached with vLLM's own hit's output, the connector's
    counters reach /metrics, and a warning at start names the MultiConnector's
    kv_load_failure_policy, which only the MultiConnector's own config sets."""
    daemon = launch(instance=instance, run_dir=run_dir, host_cache_gb=0.2)
    server = None
    try:
        server = Server(model, str(tmp_path / "server.log"), {
            "kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
                "connectors": [
                    {"kv_connector": "KvcachedConnector", "kv_connector_module_path": "kvcached_client.vllm",
                     "kv_role": "kv_both",
                     "kv_connector_extra_config": {"instance": instance, "run_dir": run_dir}},
                    {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config":
                        {"shared_storage_path": str(tmp_path / "example")}}]}})
        _wait_attached(daemon)
        assert "runs inside a MultiConnector whose kv_load_failure_policy is 'fail'" in server.log()
        assert server.complete("A") == (reference["A"], 0)
        for _ in range(2):  # the first reply's stats reached the server's stat loggers meanwhile
            tokens, cached = server.complete("B")
            assert tokens == reference["B@hit"] and cached == PREFIX, (cached, server.log()[-3000:])
        assert server.metric("vllm:kvcached_loaded_blocks") == 2 * PREFIX // BLOCK
        assert server.metric("vllm:kvcached_load_errors") == 0
        assert server._healthy()
    finally:
        code = server.stop() if server is not None else None
        daemon.stop()
        sweep_crashed(instance)
    assert code is not None
    # no error while it served (at SIGTERM vLLM's own teardown may log an EngineDeadError: it
    # kills the engine core at once, under the API server's output handler)
    serving = server.log().split("[shutdown]", 1)[0]
    errors = [line for line in serving.splitlines() if " ERROR " in line]
    assert not errors, errors[:20]


def test_vllms_plugin_loading_names_the_connector_in_its_factory():
    """Each vLLM process loads the vllm.general_plugins entry points: KvcachedConnector is then
    a name vLLM knows (a fresh process that never imported kvcached_client)."""
    code = ("import sys\n"
            "from vllm.plugins import load_general_plugins\n"
            "load_general_plugins()\n"
            "assert 'kvcached_client.vllm.connector' not in sys.modules\n"
            "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
            "print(KVConnectorFactory.get_connector_class_by_name('KvcachedConnector').__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "kvcached_client.vllm.connector", out.stderr
