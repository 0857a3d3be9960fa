"""Structure checks over the source (AST, no imports executed): no import cycle among the
project's modules, function-level imports included; the client never imports the daemon
package; the daemon's core never imports the client's."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"kvcached": "kvcached", "kvcached_client": "client", "kvcached_proto": "proto"}
# daemon modules that drive a daemon as a client would (tools), allowed to import the client
DAEMON_TOOLS = ("kvcached.cli", "kvcached.replay", "kvcached.bench")


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


SOURCE_FOLDERS = ("kvcached", "client", "proto", "scripts")
FLAG_TABLES = {("kvcached/cli.py", "build_parser")}  # argparse tables: long, and flat


def _sources():
    for folder in SOURCE_FOLDERS:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    yield os.path.join(dirpath, f)


def test_no_source_file_over_600_lines():
    long = {os.path.relpath(p, ROOT): n for p in _sources()
            if (n := len(open(p, encoding="utf-8").read().splitlines())) > 600}
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
