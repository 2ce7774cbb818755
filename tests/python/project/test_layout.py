"""The package's layout: radixkv's own modules import one another without a
circle (module-level or inside a function alike), and each one imports on its
own, first, in a fresh interpreter."""

import ast
import json
import pathlib
import subprocess
import sys
import textwrap

import radixkv

PACKAGE = pathlib.Path(radixkv.__file__).parent


def modules(package: pathlib.Path):
    """{dotted name: path} of the package's Python modules, and the dotted
    names of its native ones (`_core`, `_cuda`: a .so or a .pyi stub)."""
    found, native = {}, set()
    for path in sorted(package.rglob("*")):
        if "__pycache__" in path.parts or not path.is_file():
            continue
        parts = list(path.relative_to(package.parent).parts)
        stem = path.name.split(".")[0]
        if path.suffix == ".py":
            parts[-1] = stem
            if stem == "__init__":
                parts.pop()
            found[".".join(parts)] = path
        elif path.suffix in (".so", ".pyd", ".pyi"):
            native.add(".".join(parts[:-1] + [stem]))
    return found, native - set(found)


def _imports(tree: ast.AST):
    """The import statements of `tree`, in functions too, less those under
    `if TYPE_CHECKING:` (they never run)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def import_graph(package: pathlib.Path):
    """{module: modules of the package it imports}. `from a.b import c` is an
    edge to `a.b.c` when that is a module, else to `a.b`; a package's
    `__init__` is a node of its own (importing `a.b.c` is not counted as
    importing `a.b`, which Python runs first but which cannot import back
    into a half-made child without naming it)."""
    mods, native = modules(package)
    graph = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        edges = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in mods)
                continue
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in mods:
                    edges.add(sub)
                elif sub not in native and base in mods:
                    edges.add(base)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(graph, comps):
    return "\n".join(
        "circle: " + "; ".join(f"{a} -> {', '.join(sorted(graph[a] & set(c)))}" for a in c)
        for c in comps
    )


def test_radixkv_imports_have_no_circle():
    graph = import_graph(PACKAGE)
    assert "radixkv.kvcache.mha_pool" in graph and "radixkv.replay.replay" in graph
    found = cycles(graph)
    assert not found, _describe(graph, found)


def test_the_check_finds_a_circle(tmp_path):
    """The checker itself: a circle through a function-level import and a
    relative import is found, an import under TYPE_CHECKING is not one."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_ext.pyi").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.a import A\n")
    (pkg / "sub" / "a.py").write_text("from pkg import _ext\n" "def f():\n    from .b import B\n")
    (pkg / "sub" / "b.py").write_text("from pkg.sub import a\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\n" "if TYPE_CHECKING:\n    from pkg.d import D\n"
    )
    (pkg / "d.py").write_text("import pkg.c\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.a"] == {"pkg.sub.b"} and graph["pkg"] == set()
    assert cycles(graph) == [["pkg.sub.a", "pkg.sub.b"]]


_EACH_FIRST = textwrap.dedent("""
    import importlib, json, os, sys, traceback
    import torch  # noqa: F401  (shared by every child: radixkv's modules are not)
    assert not any(m.split(".")[0] == "radixkv" for m in sys.modules)
    status = {}
    for name in json.loads(sys.argv[1]):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                # an optional engine or client radixkv plugs into: not ours to import
                code = 3 if (e.name or "radixkv").split(".")[0] != "radixkv" else 1
                if code == 1:
                    traceback.print_exc()
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        status[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print(json.dumps(status))
""")


def test_each_module_imports_first_in_a_fresh_interpreter():
    """Each module of radixkv imported before any other of them (a fork of one
    fresh interpreter per module): no module leans on another having been
    imported first."""
    names = sorted(modules(PACKAGE)[0])
    out = subprocess.run(
        [sys.executable, "-c", _EACH_FIRST, json.dumps(names)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout.strip().splitlines()[-1])
    failed = [n for n, code in status.items() if code not in (0, 3)]
    assert not failed, f"{failed} fail to import on their own:\n{out.stderr}"
    # Only the bridges into an engine (or its metrics) may need more than radixkv does.
    optional = {
        "radixkv.compat.sglang.hicache_storage",
        "radixkv.compat.vllm_connector",
        "radixkv.compat.vllm.connector",
        "radixkv.compat.vllm.metadata",
        "radixkv.compat.vllm.metrics",
        "radixkv.compat.vllm.scheduler",
        "radixkv.compat.vllm.worker",
        "radixkv.prometheus",
    }
    assert {n for n, code in status.items() if code == 3} <= optional
