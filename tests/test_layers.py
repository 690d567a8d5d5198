"""The import rules of DESIGN.md's layers: every import in ferro runs one way, down.

Every ``import`` and ``from ... import`` in every module counts, those inside
functions too (a deferred import is still a dependency), and so do the compiled
core's ``.pyx`` files.
"""

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "ferro"

# Lowest first: one folder per layer (DESIGN.md's table), plus the bottom's three modules and the
# public face. A module may import modules of its own layer or any layer below.
LAYERS = [
    ("bottom", ["ferro.errors", "ferro.types", "ferro._buffers", "ferro._core", "ferro.environment", "ferro._version"]),
    ("rendezvous", ["ferro.rendezvous"]),
    ("rpc", ["ferro.rpc"]),
    ("backend", ["ferro.backend"]),
    ("collectives", ["ferro.collective"]),
    ("parallelism and state", ["ferro.parallel", "ferro.dtensor", "ferro.checkpoint"]),
    ("fault tolerance", ["ferro.elastic"]),
    ("interop", ["ferro.interop"]),
    # ferro.pipeline and ferro.device_mesh: files that put the modules they name in their place, on first use.
    ("the public face", ["ferro", "ferro.pipeline", "ferro.device_mesh"]),
    ("tools", ["ferro.tools", "ferro.launch", "ferro.__main__"]),
]
# ferro.nn is the NumPy reference model: it imports no communication at all.
STANDALONE = {"ferro.nn": {"ferro.nn", "ferro.errors", "ferro.types"}}
# The test harness may import anything; no library module may import it.
HARNESS = "ferro.testing"


def module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module):
    """Index of the layer owning ``module`` (the longest matching prefix)."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            # "ferro" itself is the package's __init__ only, not everything under it.
            matches = module == prefix or (prefix != "ferro" and module.startswith(prefix + "."))
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def imports_of(path, module, *, annotations=True):
    """Every ferro module ``path`` imports, as (imported name, line).

    ``annotations=False`` leaves out the imports under ``if TYPE_CHECKING:``, which
    never run: they name types for annotations only.
    """
    text = path.read_text()
    if path.suffix == ".pyx":
        found = re.findall(r"^\s*(?:from|cimport|import)\s+(ferro[\w.]*)", text, re.M)
        return [(name, 0) for name in found]
    tree = ast.parse(text)
    if not annotations:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                node.body = []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "ferro"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "ferro":
                # `from ferro.x import y` imports the module ferro.x.y where there is one, else ferro.x.
                names = [f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module
                         for a in node.names]
                found += [(name, node.lineno) for name in names]
    return found


def _is_module(name):
    path = PACKAGE.parent.joinpath(*name.split("."))
    suffixes = (".py", ".pyx", ".pxd")
    return any(path.with_suffix(suffix).is_file() for suffix in suffixes) or (path / "__init__.py").is_file()


def import_graph():
    """Every module of the package and the modules it imports when it runs (imports inside functions too)."""
    graph = {}
    for path in all_modules():
        module = module_name(path)
        targets = set()
        for name, _ in imports_of(path, module, annotations=False):
            while name and not _is_module(name):
                name = name.rpartition(".")[0]  # a name inside a module: the module
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph):
    """The strongly connected sets of two modules or more (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for target in edges:
                if target not in graph:
                    continue
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    advanced = True
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.append(sorted(members))
    return found


def all_modules():
    return sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".pyx"))


def test_every_module_belongs_to_a_layer():
    unplaced = [module_name(p) for p in all_modules()
                if layer_of(module_name(p)) is None
                and not any(module_name(p).startswith(s) for s in (*STANDALONE, HARNESS))]
    assert unplaced == []


@pytest.mark.parametrize("path", all_modules(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_run_down_the_layers(path):
    module = module_name(path)
    if module.startswith(HARNESS):
        return  # the harness sits beside the library and may use all of it
    for prefix, allowed in STANDALONE.items():
        if module.startswith(prefix):
            bad = [(name, line) for name, line in imports_of(path, module)
                   if not any(name == a or name.startswith(a + ".") for a in allowed)]
            assert bad == [], f"{module} must not import {bad}"
            return
    mine = layer_of(module)
    for name, line in imports_of(path, module):
        assert not name.startswith(HARNESS), f"{module}:{line} imports the test harness {name}"
        if any(name.startswith(prefix) for prefix in STANDALONE):
            continue  # ferro.nn may be used from above (the public face re-exports it)
        theirs = layer_of(name)
        assert theirs is not None, f"{module}:{line} imports {name}, which is in no layer"
        assert theirs <= mine, (f"{module}:{line} ({LAYERS[mine][0]}) imports {name} ({LAYERS[theirs][0]}), "
                                f"a layer above it")


def test_the_layer_check_catches_an_upward_import(tmp_path):
    # The rule itself must bite: a backend module importing the collectives is refused.
    assert layer_of("ferro.collective") > layer_of("ferro.backend.tcp")
    assert layer_of("ferro.collective.process_group") > layer_of("ferro.backend.sub")
    assert layer_of("ferro.testing.processes") is None
    fake = tmp_path / "ferro" / "backend" / "x.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from ferro.collective.process_group import get_default_group\n")
    assert imports_of(fake, "ferro.backend.x") == [("ferro.collective.process_group", 2)]


def test_no_two_modules_import_each_other():
    # Inside a layer too, through any chain, counting imports inside functions. A type named only for
    # annotations (under TYPE_CHECKING) is no import: FSDP's step hooks name the FSDP they serve.
    assert cycles(import_graph()) == []


def test_the_cycle_check_catches_a_circle_through_a_deferred_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_top_level_reads_as_the_layer_table():
    # ls ferro/: a folder per layer, the bottom's modules, the public face and `python -m ferro`.
    public_face = {"__init__.py", "pipeline.py", "device_mesh.py"}
    top = sorted(p.name for p in PACKAGE.iterdir() if not p.name.startswith(".") and p.name != "__pycache__"
                 and not p.name.endswith((".so", ".c")))
    layered = {prefix.split(".")[1] for _, prefixes in LAYERS for prefix in prefixes if "." in prefix}
    assert top == sorted({f"{name}.py" if (PACKAGE / f"{name}.py").exists() else name for name in layered}
                         | public_face | {"nn", "testing", "py.typed"})


def _rooms_of_one_call(call):
    """The rooms of the collectives layer that one call's public function and body call into, in order.

    Only calls made from the call's own module count (reductions, movement,
    objects): that is the call read top to bottom. Repeats are folded.
    """
    import sys

    seen = []

    def profile(frame, event, _arg):
        module = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
        if (event == "call" and module.startswith("ferro.collective.") and not frame.f_code.co_name.startswith("<")
                and caller.rsplit(".", 1)[-1] in ("reductions", "movement", "objects")):
            room = module.rsplit(".", 1)[1]
            if room in ("resolve", "direct", "execute", "algorithms") and (not seen or seen[-1] != room):
                seen.append(room)

    call()  # the first call on a group also builds its direct paths, once
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("name", ["reduce_scatter", "allreduce", "gather", "all_to_all", "scatter", "broadcast_object"])
def test_a_collective_is_resolved_once_then_executed(name):
    # The walk of one call: all of its arguments resolved (one visit to resolve), then its link made and the call
    # executed; never back to resolving once execution began.
    import numpy as np

    import ferro
    from ferro.testing import run_threads

    def rank(group):
        x = np.arange(4.0)
        calls = {"reduce_scatter": lambda: ferro.reduce_scatter(x, group=group),
                 "allreduce": lambda: ferro.allreduce(x, group=group, algorithm="ring"),
                 "gather": lambda: ferro.gather(x, group=group),
                 "all_to_all": lambda: ferro.all_to_all(x, group=group),
                 "scatter": lambda: ferro.scatter([x, x] if group.rank == 0 else None, group=group),
                 "broadcast_object": lambda: ferro.broadcast_object("x", group=group)}
        return _rooms_of_one_call(calls[name])

    for rooms in run_threads(rank, 2, timeout=60):
        assert rooms[:2] == ["resolve", "execute"] and "resolve" not in rooms[2:], rooms


def test_every_folder_is_a_package():
    # setuptools' find_packages ships folders with an __init__.py only; an editable install would hide the gap.
    folders = [p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))]
    assert [str(p.relative_to(PACKAGE.parent)) for p in folders if not (p / "__init__.py").exists()] == []


def test_design_md_draws_the_same_layers_in_the_same_order():
    # DESIGN.md's table lists the layers top-down; each layer's folders first appear on its own row.
    text = (PACKAGE.parent / "DESIGN.md").read_text()
    table = text.split("## Layers as built", 1)[1].split("```", 2)[1]
    rows = [line for line in table.splitlines() if line.strip()]

    def first_row(path):
        return next(i for i, line in enumerate(rows) if path in line)

    spans = []
    for name, prefixes in LAYERS:
        paths = [p.replace(".", "/") + ("/" if (PACKAGE.parent / p.replace(".", "/")).is_dir() else ".py")
                 for p in prefixes if p != "ferro"] or ["ferro/__init__.py"]
        spans.append((name, min(map(first_row, paths)), max(map(first_row, paths))))
    for (below, start_below, _), (name, start, end) in zip(spans, spans[1:], strict=False):
        assert start <= end < start_below, f"DESIGN.md draws {name} (rows {start}-{end}) into {below} ({start_below})"


#: The house's "about 600 lines" outside the compiled core (STYLE.md): past it, a module is split at its seams.
LONGEST_MODULE = 620


def test_no_module_outside_the_compiled_core_outgrows_the_house_limit():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py") if "_core" not in p.parts
            and (n := len(p.read_text().splitlines())) > LONGEST_MODULE}
    assert long == {}, f"split these at their seams: {long}"
