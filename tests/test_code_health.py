"""Structure checks over the source (AST, no imports executed): no import cycle among the
project's modules, function-level imports included; the client never imports the daemon
package; the daemon's core never imports the client's; the daemon's layer folders and the
engine side's integration folders import only in the allowed directions."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"kvcached": "kvcached", "kvcached_client": "client", "kvcached_proto": "proto"}
# daemon modules that drive a daemon as a client would (tools), allowed to import the client
DAEMON_TOOLS = ("kvcached.cli", "kvcached.tools", "kvcached.bench")


def _modules() -> dict[str, str]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    rel = os.path.relpath(path, os.path.join(ROOT, folder))[:-3].replace(os.sep, ".")
                    name = pkg if rel == "__init__" else f"{pkg}.{rel.removesuffix('.__init__')}"
                    mods[name] = path
    return mods


def _imports(name: str, path: str, mods: dict[str, str]) -> set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in candidates if c in mods and c != name}
        found |= {c for c in candidates if c.split(".")[0] in PACKAGES and c not in mods}
    return found


@pytest.fixture(scope="module")
def graph():
    mods = _modules()
    return mods, {m: _imports(m, p, mods) for m, p in mods.items()}


def _cycles(mods, edges) -> list[list[str]]:
    """Strongly connected components of more than one module, package __init__s left out
    (their re-exports import their own submodules by design)."""
    nodes = [m for m in mods if not mods[m].endswith("__init__.py")]
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in mods or mods[w].endswith("__init__.py"):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in nodes:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle(graph):
    mods, edges = graph
    assert _cycles(mods, edges) == []


def test_the_checker_sees_a_cycle():
    mods = {"a.x": "x.py", "a.y": "y.py", "a.z": "z.py"}
    edges = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}}
    assert _cycles(mods, edges) == [["a.x", "a.y", "a.z"]]


def test_the_client_never_imports_the_daemon_nor_the_daemon_core_the_client(graph):
    mods, edges = graph
    for m, targets in edges.items():
        if m.startswith("kvcached_client"):
            assert not any(t.split(".")[0] == "kvcached" for t in targets), (m, targets)
        if m.startswith("kvcached.") and not m.startswith(DAEMON_TOOLS):
            assert not any(t.split(".")[0] == "kvcached_client" for t in targets), (m, targets)


# The daemon's parts, top to bottom, and what each may import (itself always). The server runs the
# service, the service drives copies, the host tier and storage; config names what the lower layers
# define (and checks flags without importing torch), so copy may read its names and it may read
# theirs. Tools and benchmarks drive the parts from outside; only the CLI imports everything.
DAEMON_PARTS = {
    "cli": None,  # anything
    "bench": {"tools", "server", "service", "copy", "host", "storage", "config", "base"},
    "tools": {"host", "config", "base"},
    "server": {"service", "copy", "host", "storage", "config", "base"},
    "service": {"copy", "host", "storage", "config", "base"},
    "copy": {"host", "config", "base"},
    "host": {"base"},
    "storage": {"base"},
    "config": {"host", "storage", "base"},
    "base": set(),
}
BASE = {"kvcached", "kvcached.errors", "kvcached.logs"}
CONFIG = {"kvcached.config", "kvcached.config_sources"}
CLI = {"kvcached.cli", "kvcached.cli_status", "kvcached.cli_stop", "kvcached.__main__"}
# engine side: integrations sit over the shared core and beside each other, never under it
CLIENT_INTEGRATIONS = ("prefix", "vllm")


def daemon_part(module: str) -> str:
    if module in BASE:
        return "base"
    if module in CONFIG:
        return "config"
    if module in CLI:
        return "cli"
    folder = module.split(".")[1]
    assert folder in DAEMON_PARTS, f"{module}: not in a layer folder (tests/test_code_health.py)"
    return folder


def client_part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in CLIENT_INTEGRATIONS else "core"


def _module_of(name: str, mods) -> str:
    """A name imported from a package (`from kvcached import __version__`) belongs to it."""
    while name not in mods and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def layer_violations(edges: dict[str, set[str]], mods) -> list[str]:
    bad = []
    for m, targets in edges.items():
        top = m.split(".")[0]
        for t in sorted({_module_of(t, mods) for t in targets}):
            if top == "kvcached" and t.split(".")[0] == "kvcached":
                src, dst = daemon_part(m), daemon_part(t)
                allowed = DAEMON_PARTS[src]
                if src != dst and allowed is not None and dst not in allowed:
                    bad.append(f"{m} ({src}) imports {t} ({dst})")
            elif top == "kvcached_client" and t.split(".")[0] == "kvcached_client" \
                    and m != "kvcached_client":
                src, dst = client_part(m), client_part(t)
                if src != dst and dst != "core":
                    bad.append(f"{m} ({src}) imports {t} ({dst})")
            elif top == "kvcached_proto" and t.split(".")[0] != "kvcached_proto":
                bad.append(f"{m} (proto) imports {t}")
    return sorted(bad)


def test_imports_follow_the_layers(graph):
    mods, edges = graph
    assert layer_violations(edges, mods) == []


def test_the_checker_sees_a_layer_crossed():
    edges = {"kvcached.host.pool": {"kvcached.copy.transfer"},           # host under copy
             "kvcached.service.report": {"kvcached.server.metrics"},     # service under server
             "kvcached.copy.transfer": {"kvcached.host.pool"},           # allowed
             "kvcached_client.kv_worker": {"kvcached_client.vllm.connector"},  # core under vllm
             "kvcached_client.vllm.connector": {"kvcached_client.prefix.manager"},  # side by side
             "kvcached_client.prefix.manager": {"kvcached_client.hashing"},  # allowed
             "kvcached_proto.codec": {"kvcached_client.client"}}
    mods = set(edges) | {t for ts in edges.values() for t in ts}
    assert layer_violations(edges, mods) == [
        "kvcached.host.pool (host) imports kvcached.copy.transfer (copy)",
        "kvcached.service.report (service) imports kvcached.server.metrics (server)",
        "kvcached_client.kv_worker (core) imports kvcached_client.vllm.connector (vllm)",
        "kvcached_client.vllm.connector (vllm) imports kvcached_client.prefix.manager (prefix)",
        "kvcached_proto.codec (proto) imports kvcached_client.client",
    ]


def test_every_daemon_module_is_in_a_layer(graph):
    mods, _ = graph
    for m in mods:
        if m.startswith("kvcached.") or m == "kvcached":
            daemon_part(m)


SOURCE_FOLDERS = ("kvcached", "client", "proto", "scripts")
FLAG_TABLES = {("kvcached/cli.py", "build_parser")}  # argparse tables: long, and flat


def _sources(exts=(".py",)):
    for folder in SOURCE_FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(exts):
                    yield os.path.join(dirpath, f)


def test_no_source_file_over_500_lines():
    """The design's cap for a module of the layers (C sources too)."""
    long = {os.path.relpath(p, ROOT): n for p in _sources((".py", ".c", ".h"))
            if (n := len(open(p, encoding="utf-8").read().splitlines())) > 500}
    assert long == {}


def test_no_function_over_60_lines_outside_flag_tables():
    long = []
    for path in _sources():
        rel = os.path.relpath(path, ROOT)
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.end_lineno - node.lineno + 1 > 60 and (rel, node.name) not in FLAG_TABLES:
                long.append(f"{rel}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []
