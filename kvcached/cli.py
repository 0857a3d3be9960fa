"""The `kvcached` command: serve, status, stop, clear, bench."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from kvcached_client.kv_views import BLOCK_CONTIGUOUS
from kvcached_proto import KvcachedError
from kvcached_proto.paths import DEFAULT_INSTANCE

from .cli_status import cmd_status
from .cli_stop import cmd_stop
from .config import COPY_STRATEGIES, HOST_LAYOUTS
from .errors import StartupError
from .host.policies import POLICIES
from .tools.offline_policies import OFFLINE_POLICIES


def replay_policies() -> list[str]:
    """The daemon's eviction policies, then the offline references replay alone can run."""
    return sorted(POLICIES) + sorted(OFFLINE_POLICIES)


log = logging.getLogger("kvcached")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instance", default=DEFAULT_INSTANCE,
                   help="instance name; one daemon per GPU (default: %(default)s)")
    p.add_argument("--run-dir", default=None,
                   help="socket/lock dir, 0700 (default: $XDG_RUNTIME_DIR/kvcached or /tmp/kvcached-$UID)")


def build_parser() -> argparse.ArgumentParser:
    from kvcached_proto.version import PROTOCOL_VERSION

    from . import __version__

    parser = argparse.ArgumentParser(prog="kvcached", description="Per-GPU KV-cache sidecar daemon.")
    parser.add_argument("--version", action="version",
                        version=f"kvcached {__version__} (protocol {PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]})")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve", help="run the daemon in the foreground",
        description="Run the daemon. Settings come from defaults < --config FILE (TOML) < "
                    "KVCACHED_<KEY> environment variables < these flags.")
    S = argparse.SUPPRESS  # only flags given on the command line override the other sources
    serve.add_argument("--config", default=None, help="TOML file with any of the keys below")
    serve.add_argument("--print-config", action="store_true",
                       help="print the resolved configuration as TOML and exit")
    serve.add_argument("--instance", default=S, help="instance name; one daemon per GPU (default: default)")
    serve.add_argument("--run-dir", default=S,
                       help="socket/lock dir, 0700 (default: $XDG_RUNTIME_DIR/kvcached or /tmp/kvcached-$UID)")
    serve.add_argument("--device", default=S, help="cpu or cuda:N (default: cpu)")
    serve.add_argument("--host-cache-gb", type=float, default=S, help="host tier size in GiB (default: 1)")
    serve.add_argument("--host-layout", choices=HOST_LAYOUTS, default=S,
                       help="host block layout (default: layer_first)")
    serve.add_argument("--eviction", choices=sorted(POLICIES), default=S,
                       help="host eviction policy (default: lru)")
    serve.add_argument("--numa", default=S, help="auto, off or a NUMA node (CUDA pinning; default: auto)")
    serve.add_argument("--listen", action="append", default=S, metavar="tcp://ADDR:PORT",
                       help="extra TCP endpoint (repeatable); needs CURVE keys "
                            "(--curve-secret-key-file, --curve-allow-dir), loopback included")
    serve.add_argument("--curve-secret-key-file", default=S, metavar="FILE",
                       help="the daemon's CURVE key pair (a zmq certificate, `kvcached keygen`)")
    serve.add_argument("--curve-allow-dir", default=S, metavar="DIR",
                       help="public keys (*.key) of the clients allowed over TCP, read at start; "
                            "its keys (and it, unless sticky) must be the daemon user's or root's "
                            "and not group/world-writable")
    serve.add_argument("--max-queued-tasks", type=int, default=S,
                       help="waiting tasks (copies queued or parked on another task's fetch, "
                            "flushes not ended) before requests get BUSY; clients with no KV "
                            "registered may hold half of them together (default: 4096)")
    serve.add_argument("--max-connections", type=int, default=S,
                       help="connections per request socket; more are refused, with a logged "
                            "reason (default: 1024; every socket's together, the status "
                            "socket's 64 included, at most half the open-files limit)")
    serve.add_argument("--max-connections-per-peer", type=int, default=S,
                       help="connections per process (ipc) or address (TCP) (default: 64)")
    serve.add_argument("--storage", action="append", default=S, metavar="URI",
                       help="storage tier, repeatable, searched in order: "
                            "disk:///abs/path?capacity_gb=F[&io_timeout_s=F][&fsync=1], "
                            "redis://host:port/db, redis+cluster://host:port, "
                            "redis+sentinel://host:port[,host:port...]/db?service=NAME, "
                            "mooncake://master_host:port[?segment_gb=F&host=ADDR&protocol=tcp|rdma]. "
                            "A password here is every local user's to read (ps): give such a URI "
                            "in $KVCACHED_STORAGE or a --config file of mode 0600")
    serve.add_argument("--storage-write-policy", default=S,
                       choices=["write_through", "write_through_selective", "write_back"],
                       help="when host blocks go to storage (default: write_through)")
    serve.add_argument("--storage-writer", action=argparse.BooleanOptionalAction, default=S,
                       help="write to storage (off on all but one rank for MLA models; default: on)")
    serve.add_argument("--selective-hits", type=int, default=S,
                       help="hits before write_through_selective backs a block up (default: 2)")
    serve.add_argument("--prefetch-threshold-tokens", type=int, default=S,
                       help="smallest storage hit worth a prefetch (default: 256)")
    serve.add_argument("--prefetch-max-share", type=float, default=S,
                       help="share of the host pool prefetches may fill (default: 0.5)")
    serve.add_argument("--copy-threads", type=int, default=S,
                       help="CPU threads for copies; 0 = half the cores, 1..4 (default: 0)")
    serve.add_argument("--copy-strategy", default=S,
                       choices=list(COPY_STRATEGIES),
                       help="how blocks move: auto (CPU: native - one C loop of memcpys, "
                            "streaming stores for offloads - where it is built, else numpy row "
                            "copies; CUDA: runs when ids come in long runs, else gather), "
                            "numpy or native (CPU), one of runs, gather, zero_copy "
                            "(torch ops, on CPU too), or dma (copy engines only, no kernel: one "
                            "batched cudaMemcpy per layer; memmove on CPU) (default: auto)")
    serve.add_argument("--dma-threads", type=int, default=S,
                       help="--copy-strategy dma: threads that queue each layer's copies, each "
                            "its share on a stream of its own, 1..8 (default: 1; where the "
                            "runtime takes copies from several threads at once this divides "
                            "the CPU time a layer takes to queue; not yet run on a GPU; refused "
                            "above 1 with another strategy)")
    serve.add_argument("--metrics-port", type=int, default=S,
                       help="serve Prometheus /metrics and a /health check on this port "
                            "(default: 0 = off)")
    serve.add_argument("--metrics-addr", default=S, help="address for /metrics (default: 127.0.0.1)")
    serve.add_argument("--log-level", default=S, help="DEBUG, INFO, WARNING, ERROR (default: INFO)")
    serve.add_argument("--log-format", choices=["text", "json"], default=S,
                       help="text lines or one JSON object per line (default: text)")
    serve.add_argument("--stats-interval-s", type=float, default=S,
                       help="seconds between [stats] summary lines at INFO (default: 60)")

    status = sub.add_parser(
        "status", help="show a running daemon's status",
        description="Exit status: 0 the daemon answered; 3 no daemon answered; 4 it answered "
                    "but its request loop is stalled (it serves no requests); 5 it is starting "
                    "(its host pool is being pinned: --watch waits it out). Other trouble "
                    "(a storage tier down or stuck) is listed under `degraded` with exit 0.")
    _common(status)
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument("--timeout", type=float, default=2.0, help="seconds (default: %(default)s)")
    status.add_argument("--watch", type=float, default=0, metavar="N",
                        help="refresh every N seconds until Ctrl-C")

    stop = sub.add_parser(
        "stop", help="stop a running daemon gracefully",
        description="Asks the daemon to stop (the shutdown op: it finishes the tasks and backups "
                    "queued, then exits) and waits for its exit. A daemon that cannot "
                    "take the op (hung, still starting) is sent SIGTERM, the same way out once "
                    "it runs again; one already stopping is waited for.")
    _common(stop)
    stop.add_argument("--timeout", type=float, default=30.0,
                      help="seconds to wait for the exit (default: %(default)s)")

    clear = sub.add_parser(
        "clear", help="drop the blocks a running daemon holds (after a weight update)",
        description="Drops every block of the host tier, the storage tiers or both, as the "
                    "registered engine's clear does. Nothing stored before is read after: a "
                    "storage tier that is down owes the clear and serves nothing until it is "
                    "done (said here, and in status). Exit status 0 once cleared.")
    _common(clear)
    clear.add_argument("--tier", choices=["all", "host", "storage"], default="all",
                       help="which tiers (default: %(default)s)")
    clear.add_argument("--weights-update", action="store_true",
                       help="a weight update: every tier is cleared (whatever --tier says), and "
                            "the daemon's state goes CLEARING, then CLEARED (status shows it)")
    clear.add_argument("--timeout", type=float, default=60.0,
                       help="seconds to wait for the daemon (default: %(default)s)")

    replay = sub.add_parser("replay", help="replay a Mooncake-format request trace against the host tier")
    replay.add_argument("trace", nargs="?", help="TRACE.jsonl (timestamp, input_length, output_length, hash_ids)")
    replay.add_argument("--capacity-tokens", type=int, nargs="+", default=[1_000_000, 3_000_000, 10_000_000],
                        help="host tier capacities in tokens (default: 1e6 3e6 1e7)")
    replay.add_argument("--policy", default="lru",
                        help="eviction policy, or a comma-separated list (see --list-policies); "
                             "belady, oracle-reuse and oracle-features are offline references "
                             "that read the whole trace first (in process only)")
    replay.add_argument("--block-tokens", type=int, default=512, help="tokens per hash id (default: 512)")
    replay.add_argument("--through-daemon", action="store_true",
                        help="send the lookups and offloads to a real daemon over the real client")
    replay.add_argument("--save-blocks", type=int, default=0, metavar="N",
                        help="the engine offloads what follows a hit in parts of at most N blocks, "
                             "as vLLM saves a chunked prefill (default: 0, one offload)")
    replay.add_argument("--unlinked-saves", action="store_true",
                        help="those offloads name no parent block (an engine before protocol 1.15): "
                             "the comparison for what naming it wins")
    replay.add_argument("--json", action="store_true", help="print results as JSON")
    replay.add_argument("--list-policies", action="store_true", help="print the policy names and exit")

    keygen = sub.add_parser("keygen", help="write a CURVE key pair (for --listen: TCP needs CURVE)")
    keygen.add_argument("dir", help="directory for NAME.key (public) and NAME.key_secret (0600)")
    keygen.add_argument("--name", default="kvcached", help="file name stem (default: %(default)s)")

    bench = sub.add_parser("bench", help="benchmarks against raw baselines in the same run")
    bench.add_argument("what", choices=["ipc", "transfer", "storage", "disk-index", "faults", "all"],
                       help="which benchmark (all: every one, one JSON; faults: injected failures, "
                            "lost and wrong counts)")
    bench.add_argument("--trace", default=None,
                       help="all: trace for the replay part (default: tests/data/mooncake_synthetic_trace.jsonl of a checkout)")
    bench.add_argument("--out", default=None, help="also write the JSON result to this file")
    bench.add_argument("--files", type=int, default=0,
                       help="disk-index: block files to create (default 200000; --quick 20000)")
    bench.add_argument("--json", action="store_true", help="print results as JSON")
    bench.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    bench.add_argument("--device", default="cpu",
                       help="cpu or cuda:N (transfer; cuda:N measures the copy strategies, the "
                            "daemon, layer-wise overlap and pinning, scripts/gpu_check.sh)")
    bench.add_argument("--copy-strategy", default="auto",
                       choices=list(COPY_STRATEGIES),
                       help="transfer on CPU: the daemon's --copy-strategy (default: auto)")
    bench.add_argument("--dma-threads", type=int, default=4,
                       help="transfer on CUDA: also run the daemon with --copy-strategy dma "
                            "--dma-threads N (1: not; default 4)")
    bench.add_argument("--kv-layout", default="kvcached", choices=["kvcached", *BLOCK_CONTIGUOUS],
                       help="transfer on CPU: the engine's KV layout: kvcached's allocate_kv_cache "
                            "or a vLLM 0.32 one-allocation layout (strided per-layer views)")
    bench.add_argument("--pin-gb", type=float, default=None,
                       help="transfer on CUDA: pin this much host memory and report the time "
                            "(default: 32, 2 with --quick)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"serve": cmd_serve, "status": cmd_status, "stop": cmd_stop, "clear": cmd_clear,
                "bench": cmd_bench, "replay": cmd_replay, "keygen": cmd_keygen}[args.command](args)
    except (StartupError, KvcachedError) as exc:
        print(f"kvcached {args.command}: {exc}", file=sys.stderr)
        return 1


def cmd_serve(args) -> int:
    from .config_sources import resolve

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config", "print_config")}
    cfg = resolve(flags, args.config)
    if args.print_config:  # passwords in storage URIs are not printed
        from .storage.uris import redact

        shown = cfg.as_dict()
        shown["storage"] = [redact(u) for u in shown["storage"]]
        print(config_as_toml(shown))
        return 0
    from .logs import setup_logging

    setup_logging(cfg.log_level, cfg.log_format)
    for warning in unknown_env_warnings(os.environ) + password_warnings(args):
        log.warning("[config] %s", warning)
    from .server.daemon import Daemon  # imports torch; keep `status`/`stop` fast

    rc = Daemon(cfg).serve()
    # The daemon has closed all it owns (sockets, segments, tiers, logs to flush below): the
    # process ends without the interpreter's teardown, whose C++ static destructors (torch's
    # operator registry) took ~2 s here - time every supervisor, and every restart, waits for.
    # (An embedding runs Daemon(cfg).serve() itself and keeps its interpreter.)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def password_warnings(args) -> list[str]:
    """A storage password where others can read it: on the command line (every user of the
    host reads it: ps, /proc/PID/cmdline), or in a config file group or others may read. The
    environment is the process's own (/proc/PID/environ is its user's)."""
    from .config_sources import from_file
    from .storage.uris import redact

    out = [f"the password of storage tier {redact(uri)} is on the command line, where every "
           f"user of this host can read it (ps, /proc/{os.getpid()}/cmdline): give the URI in "
           "$KVCACHED_STORAGE or in a --config file of mode 0600 instead"
           for uri in getattr(args, "storage", None) or () if redact(uri) != uri]
    if args.config and any(redact(u) != u for u in from_file(args.config).get("storage", ())):
        mode = os.stat(args.config).st_mode & 0o777
        if mode & 0o044:
            out.append(f"--config {args.config} holds a storage password and is readable by "
                       f"group or others (mode {mode:o}): chmod 600 it")
    return out


def cmd_keygen(args) -> int:
    import zmq.auth

    old = os.umask(0o077)
    try:
        os.makedirs(args.dir, mode=0o700, exist_ok=True)
        public, secret = zmq.auth.create_certificates(args.dir, args.name)
    except OSError as exc:
        print(f"kvcached keygen: cannot write keys in {args.dir}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    print(f"public key: {public}\nsecret key: {secret} (keep it private; the public file goes "
          "into the other side's --curve-allow-dir or curve_server_key)")
    return 0


def config_as_toml(d: dict) -> str:
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(json.dumps(x) for x in v) + "]"
        return json.dumps(v)

    return "\n".join(f"{k} = {value(v)}" for k, v in d.items())


def unknown_env_warnings(environ) -> list[str]:
    """KVCACHED_* variables that name no setting (a typo is otherwise silently ignored)."""
    import difflib

    from .config_sources import ENV_PREFIX, known_env_names

    known = known_env_names()
    out = []
    for name in sorted(n for n in environ if n.startswith(ENV_PREFIX) and n not in known):
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        out.append(f"{name} is not a kvcached setting and is ignored{hint}")
    return out


def cmd_clear(args) -> int:
    from kvcached_client import Client

    with Client.connect(instance=args.instance, run_dir=args.run_dir, name="kvcached-cli",
                        role="operator", timeout=args.timeout) as c:
        n = c.clear(args.tier, args.weights_update, timeout=args.timeout)
        owed = [st["uri"] for st in c.status().get("storage", []) if st.get("clear_owed")]
    tier = "all, a weight update" if args.weights_update else args.tier
    print(f"cleared {n} blocks of instance {args.instance} (tier {tier})")
    for uri in owed:
        print(f"kvcached clear: {uri} is down: it owes the clear and serves nothing until it "
              "is done", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from . import bench

    kwargs = {"pin_gb": args.pin_gb} if args.pin_gb is not None else {}
    if args.what == "transfer" and args.device != "cpu":
        kwargs["dma_threads"] = args.dma_threads
    if args.what == "transfer" and args.device == "cpu":
        kwargs["copy_strategy"] = args.copy_strategy
        kwargs["kv_layout"] = args.kv_layout
    result = bench.run(args.what.replace("-", "_"), quick=args.quick, device=args.device,
                       files=args.files, trace=args.trace, **kwargs)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2) if args.json else bench.format_result(result))
    return 0


def cmd_replay(args) -> int:
    if args.list_policies:
        print("\n".join(replay_policies()))
        return 0
    if not args.trace:
        print("kvcached replay: a TRACE.jsonl is required", file=sys.stderr)
        return 2
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    known = replay_policies()
    unknown = [p for p in policies if p not in known]
    offline = [p for p in policies if p in OFFLINE_POLICIES]
    if args.through_daemon and offline:
        print(f"kvcached replay: {offline} read the trace's future: a daemon cannot run them "
              "(drop --through-daemon)", file=sys.stderr)
        return 2
    if unknown or any(c <= 0 for c in args.capacity_tokens) or args.block_tokens <= 0 or args.save_blocks < 0:
        print(f"kvcached replay: unknown policy {unknown} (known: {', '.join(known)}) "
              "or a capacity / block size that is not positive / a negative --save-blocks", file=sys.stderr)
        return 2
    from .tools import replay

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        results = replay.run(args.trace, args.capacity_tokens, policies, args.block_tokens,
                             args.through_daemon, progress, args.save_blocks, not args.unlinked_saves)
    except (OSError, ValueError) as exc:
        print(f"kvcached replay: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"trace": args.trace, "block_tokens": args.block_tokens,
                          "through_daemon": args.through_daemon, "save_blocks": args.save_blocks,
                          "linked_saves": not args.unlinked_saves,
                          "results": [r.as_dict() for r in results]}, indent=2))
        return 0
    print(f"{'capacity tokens':>16} {'policy':>15} {'hit rate':>9} {'ops/s':>10} {'evictions':>10}")
    for r in results:
        print(f"{r.capacity_tokens:>16,} {r.policy:>15} {100 * r.hit_rate:>8.2f}% {r.ops_per_s:>10,.0f} "
              f"{r.evictions:>10,}")
    return 0
