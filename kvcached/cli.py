"""The `kvcached` command: serve, status, stop, bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import zmq

from kvcached_proto import DaemonUnavailable, KvcachedError, Op, decode, encode, make_request
from kvcached_proto.liveness import pid_alive
from kvcached_proto.paths import DEFAULT_INSTANCE, resolve_run_dir, status_endpoint

from .config import HOST_LAYOUTS, DaemonConfig
from .errors import StartupError
from .policies import POLICIES

log = logging.getLogger("kvcached")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instance", default=DEFAULT_INSTANCE,
                   help="instance name; one daemon per GPU (default: %(default)s)")
    p.add_argument("--run-dir", default=None,
                   help="socket/lock dir, 0700 (default: $XDG_RUNTIME_DIR/kvcached or /tmp/kvcached-$UID)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcached", description="Per-GPU KV-cache sidecar daemon.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    _common(serve)
    serve.add_argument("--device", default="cpu", help="cpu or cuda:N (default: %(default)s)")
    serve.add_argument("--host-cache-gb", type=float, default=1.0,
                       help="host tier size in GiB (default: %(default)s)")
    serve.add_argument("--host-layout", choices=HOST_LAYOUTS, default="layer_first",
                       help="host block layout (default: %(default)s)")
    serve.add_argument("--eviction", choices=sorted(POLICIES), default="lru",
                       help="host eviction policy (default: %(default)s)")
    serve.add_argument("--numa", default="auto", help="auto, off or a NUMA node (CUDA pinning)")
    serve.add_argument("--listen", action="append", default=[], metavar="tcp://127.0.0.1:PORT",
                       help="extra loopback TCP endpoint (repeatable)")
    serve.add_argument("--max-queued-tasks", type=int, default=4096,
                       help="queued copy tasks before requests get BUSY (default: %(default)s)")
    serve.add_argument("--storage", action="append", default=[], metavar="URI",
                       help="storage tier, repeatable, searched in order: disk:///abs/path?capacity_gb=F, "
                            "redis://host:port/db, redis+cluster://host:port")
    serve.add_argument("--storage-write-policy", default="write_through",
                       choices=["write_through", "write_through_selective", "write_back"],
                       help="when host blocks go to storage (default: %(default)s)")
    serve.add_argument("--storage-writer", action=argparse.BooleanOptionalAction, default=True,
                       help="write to storage (off on all but one rank for MLA models)")
    serve.add_argument("--selective-hits", type=int, default=2,
                       help="hits before write_through_selective backs a block up (default: %(default)s)")
    serve.add_argument("--prefetch-threshold-tokens", type=int, default=256,
                       help="smallest storage hit worth a prefetch (default: %(default)s)")
    serve.add_argument("--prefetch-max-share", type=float, default=0.5,
                       help="share of the host pool prefetches may fill (default: %(default)s)")
    serve.add_argument("--copy-threads", type=int, default=0,
                       help="CPU threads for copies; 0 = half the cores, 1..4 (default: %(default)s)")
    serve.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default: %(default)s)")

    status = sub.add_parser("status", help="show a running daemon's status")
    _common(status)
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument("--timeout", type=float, default=2.0, help="seconds (default: %(default)s)")

    stop = sub.add_parser("stop", help="stop a running daemon gracefully")
    _common(stop)
    stop.add_argument("--timeout", type=float, default=30.0,
                      help="seconds to wait for the exit (default: %(default)s)")

    replay = sub.add_parser("replay", help="replay a Mooncake-format request trace against the host tier")
    replay.add_argument("trace", nargs="?", help="TRACE.jsonl (timestamp, input_length, output_length, hash_ids)")
    replay.add_argument("--capacity-tokens", type=int, nargs="+", default=[1_000_000, 3_000_000, 10_000_000],
                        help="host tier capacities in tokens (default: 1e6 3e6 1e7)")
    replay.add_argument("--policy", default="lru",
                        help="eviction policy, or a comma-separated list (see --list-policies)")
    replay.add_argument("--block-tokens", type=int, default=512, help="tokens per hash id (default: 512)")
    replay.add_argument("--through-daemon", action="store_true",
                        help="send the lookups and offloads to a real daemon over the real client")
    replay.add_argument("--json", action="store_true", help="print results as JSON")
    replay.add_argument("--list-policies", action="store_true", help="print the policy names and exit")

    bench = sub.add_parser("bench", help="benchmarks against raw baselines in the same run")
    bench.add_argument("what", choices=["ipc", "transfer", "storage", "disk-index"],
                       help="which benchmark")
    bench.add_argument("--files", type=int, default=0,
                       help="disk-index: block files to create (default 200000; --quick 20000)")
    bench.add_argument("--json", action="store_true", help="print results as JSON")
    bench.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    bench.add_argument("--device", default="cpu", help="cpu or cuda:N (transfer)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"serve": cmd_serve, "status": cmd_status, "stop": cmd_stop,
                "bench": cmd_bench, "replay": cmd_replay}[args.command](args)
    except (StartupError, KvcachedError) as exc:
        print(f"kvcached {args.command}: {exc}", file=sys.stderr)
        return 1


def cmd_serve(args) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = DaemonConfig(instance=args.instance, run_dir=args.run_dir or "", device=args.device,
                       host_cache_gb=args.host_cache_gb, host_layout=args.host_layout,
                       eviction=args.eviction, numa=args.numa, listen=args.listen,
                       max_queued_tasks=args.max_queued_tasks, copy_threads=args.copy_threads,
                       storage=args.storage, storage_write_policy=args.storage_write_policy,
                       storage_writer=args.storage_writer, selective_hits=args.selective_hits,
                       prefetch_threshold_tokens=args.prefetch_threshold_tokens,
                       prefetch_max_share=args.prefetch_max_share,
                       log_level=args.log_level)
    cfg.validate()
    from .server import Daemon  # imports torch; keep `status`/`stop` fast

    return Daemon(cfg).serve()


def fetch_status(instance: str, run_dir: str | None, timeout: float) -> dict:
    """Ask the status socket. Raises DaemonUnavailable when nobody answers in time."""
    endpoint = status_endpoint(resolve_run_dir(run_dir), instance)
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(encode(make_request(Op.STATUS, 1, "kvcached-cli")))
        if not sock.poll(int(timeout * 1000)):
            raise DaemonUnavailable(f"no daemon {instance!r} answered at {endpoint} within {timeout} s")
        reply = decode(sock.recv())
    finally:
        sock.close(linger=0)
    if not reply.get("ok"):
        raise KvcachedError(f"status failed: {reply.get('error')}")
    return reply["status"]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_status(s: dict) -> str:
    host, tasks = s["host"], s["tasks"]
    rows = [
        ("instance", s["instance"]), ("pid", s["pid"]), ("epoch", f"{s['epoch']:x}"),
        ("state", s["state"]), ("protocol", ".".join(map(str, s["protocol_version"]))),
        ("device", s.get("device", "?")), ("uptime", f"{s.get('uptime_s', 0):.1f} s"),
        ("clients", s["clients"]),
        ("kv registered", "yes" if s["kv"]["registered"] else "no"),
        ("host tier", f"{_gib(host['used_bytes'])} / {_gib(host['capacity_bytes'])} "
                      f"({host.get('blocks', 0)} blocks)"),
        ("tasks", f"queued {tasks['queued']}  inflight {tasks['inflight']}  "
                  f"completed {tasks['completed']}  failed {tasks['failed']}"),
    ]
    for st in s["storage"]:
        rows.append(("storage", f"{st['uri']}  {'healthy' if st['healthy'] else 'UNHEALTHY'}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def cmd_status(args) -> int:
    try:
        s = fetch_status(args.instance, args.run_dir, args.timeout)
    except DaemonUnavailable as exc:
        print(f"kvcached status: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(s, indent=2, sort_keys=True) if args.json else format_status(s))
    return 0


def cmd_stop(args) -> int:
    from kvcached_client import Client

    with Client.connect(instance=args.instance, run_dir=args.run_dir, name="kvcached-cli") as c:
        pid = c.info["pid"]
        c.shutdown()
    deadline = time.monotonic() + args.timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            print(f"kvcached stop: pid {pid} still running after {args.timeout} s (--timeout)",
                  file=sys.stderr)
            return 1
        time.sleep(0.05)
    print(f"stopped instance {args.instance} (pid {pid})")
    return 0


def cmd_bench(args) -> int:
    from . import bench

    result = bench.run(args.what.replace("-", "_"), quick=args.quick, device=args.device,
                       files=args.files)
    print(json.dumps(result, indent=2) if args.json else bench.format_result(result))
    return 0


def cmd_replay(args) -> int:
    if args.list_policies:
        print("\n".join(sorted(POLICIES)))
        return 0
    if not args.trace:
        print("kvcached replay: a TRACE.jsonl is required", file=sys.stderr)
        return 2
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or any(c <= 0 for c in args.capacity_tokens) or args.block_tokens <= 0:
        print(f"kvcached replay: unknown policy {unknown} (known: {', '.join(sorted(POLICIES))}) "
              "or a capacity / block size that is not positive", file=sys.stderr)
        return 2
    from . import replay

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        results = replay.run(args.trace, args.capacity_tokens, policies, args.block_tokens,
                             args.through_daemon, progress)
    except (OSError, ValueError) as exc:
        print(f"kvcached replay: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"trace": args.trace, "block_tokens": args.block_tokens,
                          "through_daemon": args.through_daemon,
                          "results": [r.as_dict() for r in results]}, indent=2))
        return 0
    print(f"{'capacity tokens':>16} {'policy':>8} {'hit rate':>9} {'ops/s':>10} {'evictions':>10}")
    for r in results:
        print(f"{r.capacity_tokens:>16,} {r.policy:>8} {100 * r.hit_rate:>8.2f}% {r.ops_per_s:>10,.0f} "
              f"{r.evictions:>10,}")
    return 0
