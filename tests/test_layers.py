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

# Lowest first. A module may import modules of its own layer or any layer below.
LAYERS = [
    ("bottom", ["ferro.errors", "ferro.types", "ferro._buffers", "ferro._core"]),
    ("rendezvous", ["ferro.rendezvous"]),
    ("rpc", ["ferro.rpc"]),
    ("backend", ["ferro.backend"]),
    ("collectives", ["ferro.collective", "ferro.p2p", "ferro.gpu", "ferro.process_group", "ferro.work",
                     "ferro._dispatch", "ferro._algorithms", "ferro._meta"]),
    ("parallelism and state", ["ferro.parallel", "ferro.pipeline", "ferro.device_mesh", "ferro.dtensor",
                               "ferro.checkpoint"]),
    ("interop", ["ferro.interop"]),
    ("the public face", ["ferro"]),
    ("tools", ["ferro.launch", "ferro.bench", "ferro.cli", "ferro.demo", "ferro.run", "ferro.__main__"]),
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


def imports_of(path, module):
    """Every ferro module ``path`` imports, as (imported name, line)."""
    text = path.read_text()
    if path.suffix == ".pyx":
        found = re.findall(r"^\s*(?:from|cimport|import)\s+(ferro[\w.]*)", text, re.M)
        return [(name, 0) for name in found]
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "ferro"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "ferro":
                # `from ferro import nn` imports ferro.nn; `from ferro.x import name` imports ferro.x.
                names = [f"{node.module}.{a.name}" if node.module == "ferro" else node.module for a in node.names]
                found += [(name, node.lineno) for name in names]
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
    assert layer_of("ferro.process_group") > layer_of("ferro.backend.sub")
    assert layer_of("ferro.testing.processes") is None
    fake = tmp_path / "ferro" / "backend" / "x.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from ferro.process_group import get_default_group\n")
    assert imports_of(fake, "ferro.backend.x") == [("ferro.process_group", 2)]
