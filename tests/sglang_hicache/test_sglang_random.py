"""kvcached as SGLang HiCache's storage backend under random work: two SGLang instances of one
model attached to one daemon, each with a backup thread (batch_set_v1) and a prefetch thread
(batch_get_v1, batch_exists) over chained pages of shared documents, a daemon host tier too small
for them (evictions, the disk tier behind it), and an operator clearing the host tier now and
then. A page's bytes are a function of its key, so every page a get says it loaded is compared
with its key's, and no page of a get may change after the get returned (SGLang reuses them):
a late copy. Also with the daemon killed (-9), or stopped gracefully (SIGTERM), and restarted
on its disk tier, frozen past the hang threshold or paused past the calls' timeout, often with
its copies queued; and with the
second instance a process of its own (random_instance.py), killed in its calls. Seeded;
KVCACHED_SOAK_OPS scales it, KVCACHED_SOAK_SEED moves its seeds. Runs in .venv-sglang."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("sglang", reason="SGLang is installed in .venv-sglang: ./scripts/test.sh --with-sglang")
pytestmark = pytest.mark.timeout(300)

import sglang_pools as sp  # noqa: E402
from conftest import disk_uri, no_tasks, sweep_crashed, wait_until  # noqa: E402

from kvcached.bench import process_stop  # noqa: E402
from kvcached_client import launch  # noqa: E402
from random_instance import DOCS, HOST_PAGES, PAGE_BYTES, Instance, docs_of, page_content  # noqa: E402


@pytest.mark.parametrize("layout,seed", [("page_first", 1), ("layer_first", 2)])
def test_random_backups_and_prefetches_of_two_instances_load_only_their_keys_bytes(run_dir, tmp_path,
                                                                                   layout, seed):
    ops = int(os.environ.get("KVCACHED_SOAK_OPS", "2000")) // 8
    seed += int(os.environ.get("KVCACHED_SOAK_SEED", "0"))
    docs = docs_of(seed)
    assert page_content(docs[0][0], 64) != page_content(docs[0][1], 64)  # the check can tell pages apart
    host_gb = HOST_PAGES * PAGE_BYTES / 2**30
    with launch(instance=f"sgr{os.getpid()}-{seed}", run_dir=run_dir, host_cache_gb=host_gb,
                extra_args=["--storage", disk_uri(str(tmp_path / "disk")), "--host-layout",
                            "layer_first" if layout == "layer_first" else "page_first"],
                wait_storage=True) as d:
        extra = sp.extra_config(d.instance, d.run_dir)
        instances = [Instance(layout, extra, docs, seed * 10 + i, ops) for i in range(2)]
        threads = [t for inst in instances for t in inst.run()]
        with d.connect(role="operator") as op:
            while any(t.is_alive() for t in threads):
                op.clear(tier="host")
                threads[0].join(0.3)
            for t in threads:
                t.join(120)
            status, check = op.status(), op.check()
        for inst in instances:
            inst.backend.close()
    errors = [e for inst in instances for e in inst.errors]
    assert not errors, errors[:5]
    assert check == "ok"
    counts = [inst.counts for inst in instances]
    assert all(c["set"] > 0 and c["got"] > 0 and c["exists"] > 0 for c in counts), counts
    assert status["host"]["evictions"] > 0 and status["lookups"]["loaded_from_storage"] > 0, status


class Faults:
    """The daemon under the instances and what befalls it as their calls go on. kills: killed
    (-9) three times, a successor started on the same disk tier 0.1-0.4 s later; stops: the same
    with a graceful stop (SIGTERM: it drains what is queued). freezes: stopped
    (SIGSTOP) eight times for 0.4-0.8 s against the backends' hang threshold of 0.3 s. 3 times in 4
    the daemon is paused (its operator's pause) 10-60 ms first, so the calls' copies are queued
    when the fault comes (CPU copies of a few pages end within microseconds of their reply).
    pauses: paused eight times for 0.6-1.0 s against the calls' timeout of 0.5 s."""

    def __init__(self, kind, start, rng):
        self.kind, self.start, self.rng = kind, start, rng
        self.daemon = start()
        self.op = self.daemon.connect(role="operator")
        self.came = 0

    def run(self, instances, calls_between: int) -> None:
        """Each fault, and the run's end, once `calls_between` calls were made since the last
        fault and each instance was served since (a page stored or loaded: attached again)."""
        n = 3 if self.kind in ("kills", "stops") else 8
        for fault in [getattr(self, "_" + self.kind[:-1])] * n:
            self._wait(instances, calls_between)
            fault()
            self.came += 1
        self._wait(instances, calls_between)
        for inst in instances:
            inst.stop.set()

    def _wait(self, instances, calls: int) -> None:
        mark = sum(inst.done for inst in instances) + calls
        served = [inst.served() for inst in instances]
        deadline = time.monotonic() + 60
        while sum(inst.done for inst in instances) < mark or any(
                inst.served() == was for inst, was in zip(instances, served)):
            assert time.monotonic() < deadline, f"no call served within 60 s of fault {self.came}"
            assert not any(inst.errors for inst in instances), [i.errors[:3] for i in instances]
            self.op.clear(tier="host")
            time.sleep(0.05)

    def _paused(self) -> bool:
        if self.rng.random() < 0.75:
            self.op.pause()
            time.sleep(self.rng.uniform(0.01, 0.06))
            return True
        return False

    def _kill(self, how=signal.SIGKILL) -> None:
        self._paused()
        os.kill(self.daemon.pid, how)
        self.daemon.proc.wait(60)
        self.op.close()
        sweep_crashed(self.daemon.instance)
        time.sleep(self.rng.uniform(0.1, 0.4))  # misses meanwhile
        self.daemon = self.start()
        self.op = self.daemon.connect(role="operator")

    def _stop(self) -> None:
        """A graceful stop (SIGTERM: it drains what is queued, paused or not), then a successor."""
        self._kill(signal.SIGTERM)

    def _freeze(self) -> None:
        paused = self._paused()
        with process_stop.stopped(self.daemon.pid, "the daemon"):
            time.sleep(self.rng.uniform(0.4, 0.8))
        if paused:
            self.op.resume()

    def _pause(self) -> None:
        """Paused past the calls' timeout: slow, not hung (no drop): what a timed-out offload
        read from pages SGLang reuses is discarded (revoked), a timed-out load is cancelled."""
        self.op.pause()
        time.sleep(self.rng.uniform(0.6, 1.0))
        self.op.resume()

    def close(self) -> None:
        process_stop.go_on(self.daemon.pid, "the daemon")
        self.op.close()
        self.daemon.stop()
        sweep_crashed(self.daemon.instance)


@pytest.mark.faults
@pytest.mark.parametrize("kind,layout,seed", [("kills", "page_first", 3), ("freezes", "layer_first", 4),
                                              ("pauses", "page_first", 5), ("stops", "layer_first", 6)])
def test_random_calls_with_the_daemon_killed_frozen_or_paused_load_only_their_keys_bytes(
        run_dir, tmp_path, kind, layout, seed):
    """Every call returns (a miss, never an exception), a page a get says it loaded is its key's,
    no page changes after its get returned, and the backends attach to each successor."""
    calls = int(os.environ.get("KVCACHED_SOAK_OPS", "2000")) // 10
    seed += int(os.environ.get("KVCACHED_SOAK_SEED", "0"))
    docs = docs_of(seed)
    start = lambda: launch(  # noqa: E731
        instance=f"sgf{os.getpid()}-{seed}", run_dir=run_dir, host_cache_gb=HOST_PAGES * PAGE_BYTES / 2**30,
        extra_args=["--storage", disk_uri(str(tmp_path / "disk")), "--host-layout", layout],
        wait_storage=True)
    fx, instances = Faults(kind, start, random.Random(seed)), []
    try:
        extra = sp.extra_config(fx.daemon.instance, run_dir, timeout_s=0.5, hang_s=0.3)
        instances += [Instance(layout, extra, docs, seed * 10 + i, ops=100 * calls) for i in range(2)]
        threads = [t for inst in instances for t in inst.run()]
        try:
            fx.run(instances, calls)
        finally:
            for inst in instances:
                inst.stop.set()
            for t in threads:
                t.join(20)
        stuck = [t.name for t in threads if t.is_alive()]
        assert not stuck, f"{stuck} still in a call 20 s after the run's end (the daemon running)"
        wait_until(lambda: no_tasks(fx.op), 10, "the daemon idle")
        for inst in instances:
            inst.check_settled()
        status, check = fx.op.status(), fx.op.check()
    finally:
        for inst in instances:
            inst.backend.close()
        fx.close()
    errors = [e for inst in instances for e in inst.errors]
    assert not errors, errors[:5]
    assert check == "ok"
    stats = [inst.backend.stats for inst in instances]
    assert all(s["errors"] + s["no_daemon"] > 0 for s in stats), stats  # the faults cost misses
    if kind == "kills":
        assert status["lookups"]["loaded_from_storage"] > 0, status["lookups"]


@pytest.mark.faults
def test_an_instance_killed_in_its_calls_costs_the_other_no_wrong_page(run_dir, tmp_path):
    """A second SGLang instance on the daemon, a process of its own backing up half the
    documents, is killed (-9) four times in the middle of its calls, 3 times in 4 with the
    daemon paused so its copies are queued, and started again. The instance that stays backs up
    the other half and loads every document: only its keys' bytes, many of them stored by the
    killed ones; the daemon's invariants hold and nothing the dead held stays pinned."""
    rng, docs = random.Random(7), docs_of(7)
    instance = f"sgk{os.getpid()}"
    with launch(instance=instance, run_dir=run_dir, host_cache_gb=HOST_PAGES * PAGE_BYTES / 2**30,
                extra_args=["--storage", disk_uri(str(tmp_path / "disk"))], wait_storage=True) as d, \
            d.connect(role="operator") as op:
        extra = sp.extra_config(instance, run_dir, timeout_s=2.0)
        stays = Instance("page_first", extra, docs, 70, ops=10**9, backed_up=docs[:DOCS // 2])
        threads, killed_said = stays.run(), []
        try:
            for k in range(4):
                killed_said += _killed_in_its_calls(op, rng, extra, k)
        finally:
            stays.stop.set()
            for t in threads:
                t.join(20)
        wait_until(lambda: no_tasks(op), 10, "the daemon idle")
        stays.check_settled()
        status, check = op.status(), op.check()
        stays.backend.close()
    assert not stays.errors and not killed_said, (stays.errors[:5], killed_said[:5])
    assert check == "ok"
    assert status["host"]["pinned_blocks"] == 0, status["host"]
    assert stays.counts["theirs"] > 0 and stays.counts["set"] > 0, stays.counts


def _killed_in_its_calls(op, rng, extra, k: int) -> list[str]:
    """One instance process started, killed (-9) 0.2-0.6 s into its calls: what it said (errors
    it found in its own loads) and, once the daemon dropped its connection, nothing more."""
    args = dict(layout="page_first", extra=extra, docs_seed=7, seed=80 + k,
                backed_up=list(range(DOCS // 2, DOCS)))
    proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "random_instance.py"),
                             json.dumps(args)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        clients = op.status()["clients"]
        time.sleep(rng.uniform(0.2, 0.6))
        paused = rng.random() < 0.75
        if paused:
            op.pause()
            time.sleep(rng.uniform(0.01, 0.05))
        proc.kill()
        proc.wait(10)
        if paused:
            op.resume()
        wait_until(lambda: op.status()["clients"] < clients, 10, "the killed instance's connection dropped")
        return [line for line in proc.stdout.read().splitlines() if line]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
