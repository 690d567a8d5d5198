"""Every ``FERRO_*`` variable is registered in ferro.environment, and every read goes through it.

The "Environment variables" page is generated from the registry, so these checks are what keep it true:
a read that bypasses :func:`ferro.environment.get` (``os.environ.get``, ``os.environ[...]``, ``os.getenv``,
``env.get`` on a copied mapping) of a ``FERRO_*`` name, written literally or through a module constant,
fails here, and so does any ``FERRO_*`` name in the Python source that the registry lacks.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ferro import environment

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "ferro").rglob("*.py")) + [ROOT / "_ferro_torch_plugin.py", ROOT / "setup.py"]
# These run before ferro can be imported, so they cannot read through the registry: the bootstrap is run by
# path before ferro is imported (standard library only, see its docstring), and setup.py builds ferro. The names
# they read (FERRO_LAUNCHER_PID, FERRO_GUARDIAN, FERRO_GRACE_SECONDS, FERRO_HEARTBEAT_FILE, FERRO_DEBUG_BUILD) are
# still checked to be registered below.
STDLIB_ONLY = {ROOT / "ferro" / "launch" / "bootstrap.py", ROOT / "setup.py"}
_NAME = re.compile(r"\bFERRO_[A-Z0-9_]+\b")


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "string"`` assignments; the caller keeps those of FERRO_* names, from every module."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node.value.value
    return found


def _all_constants() -> dict[str, str]:
    names: dict[str, str] = {}
    for path in SOURCES:
        for name, value in _constants(ast.parse(path.read_text())).items():
            if value.startswith("FERRO_"):
                names[name] = value
    return names


def _reads(path: Path, constants: dict[str, str]) -> list[str]:
    """Where ``path`` reads a FERRO_* variable without ferro.environment: "line: code"."""
    tree = ast.parse(path.read_text())

    def ferro_name(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("FERRO_"):
            return node.value
        if isinstance(node, ast.Name) and node.id in constants:
            return constants[node.id]
        if isinstance(node, ast.Attribute) and node.attr in constants:
            return constants[node.attr]
        return None

    def is_environment_module(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id == "environment"

    bad = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("get", "getenv", "pop", "setdefault") \
                    and not is_environment_module(func.value):
                name = ferro_name(node.args[0])
            elif isinstance(func, ast.Name) and func.id == "getenv":
                name = ferro_name(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            name = ferro_name(node.slice)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            name = ferro_name(node.left)
        if name is not None:
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            bad.append(f"{shown}:{node.lineno}: {ast.unparse(node)}")
    return bad


def test_every_read_of_a_ferro_variable_goes_through_the_registry():
    constants = _all_constants()
    bad = [line for path in SOURCES if path not in STDLIB_ONLY and path.name != "environment.py"
           for line in _reads(path, constants)]
    assert not bad, "read these through ferro.environment.get:\n" + "\n".join(bad)


def test_the_scan_finds_the_reads_it_forbids(tmp_path):
    # The check above must be able to fail: each way of bypassing the registry is caught.
    sample = tmp_path / "sample.py"
    sample.write_text('import os\nTIMEOUT_ENV = "FERRO_TIMEOUT"\n'
                      'a = os.environ.get("FERRO_SECRET")\nb = os.environ[TIMEOUT_ENV]\nc = os.getenv(TIMEOUT_ENV)\n'
                      'd = "FERRO_SPIN_US" in os.environ\ne = environment.get(TIMEOUT_ENV)\n'
                      'os.environ["FERRO_SECRET"] = "x"\n')
    found = _reads(sample, {"TIMEOUT_ENV": "FERRO_TIMEOUT"})
    assert [line.split(":")[1] for line in found] == ["3", "4", "5", "6"], found


def test_every_ferro_name_in_the_source_is_registered():
    names = {match for path in SOURCES for match in _NAME.findall(path.read_text())}
    assert names, "the scan found no FERRO_* names at all"
    missing = sorted(names - set(environment.VARIABLES))
    assert not missing, f"not in ferro.environment.VARIABLES (so on no page): {missing}"


def test_every_registered_variable_is_read_or_set_somewhere():
    text = "\n".join(path.read_text() for path in SOURCES if path.name != "environment.py")
    unused = sorted(name for name in environment.VARIABLES if name not in text)
    assert not unused, f"registered but never used: {unused}"


def test_registry_entries_are_complete_and_grouped():
    for variable in environment.VARIABLES.values():
        assert variable.area in environment.AREAS, variable
        assert variable.default and variable.meaning.endswith("."), variable


def test_get_reads_the_given_mapping_and_refuses_an_unregistered_name():
    assert environment.get("FERRO_TIMEOUT", environ={"FERRO_TIMEOUT": "7"}) == "7"
    assert environment.get("FERRO_TIMEOUT", "60", environ={}) == "60"
    with pytest.raises(KeyError, match="FERRO_NOT_A_SETTING is not in ferro.environment.VARIABLES"):
        environment.get("FERRO_NOT_A_SETTING")


_SEEN = """
import json, os, sys
rank = os.environ["RANK"]
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(sorted(k for k in os.environ if k.startswith("FERRO_")), f)
"""


@pytest.mark.parametrize("policy", ["group", "rank"])
def test_the_variables_marked_as_set_by_ferro_run_are_the_ones_its_ranks_get(tmp_path, policy):
    script = tmp_path / "seen.py"
    script.write_text(_SEEN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FERRO_", "RANK", "WORLD_SIZE", "MASTER_"))}
    done = subprocess.run([sys.executable, "-m", "ferro.tools.cli", "run", "--nproc-per-node", "2",
                           "--restart-policy", policy, str(script), str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    # Under --restart-policy rank the launcher waits for an elastic Manager's "finished", which this script (it only
    # reports its environment) never sets: that job ends as failed, after both ranks wrote their files.
    assert done.returncode == 0 or (policy == "rank" and "before training finished" in done.stderr), done.stderr[-3000:]
    seen = {name for rank in (0, 1) for name in json.loads((tmp_path / f"rank{rank}.json").read_text())}
    marked = {v.name for v in environment.VARIABLES.values() if v.set_by_launcher}
    elastic_only = {"FERRO_ELASTIC", "FERRO_MIN_SIZE", "FERRO_MIN_NODES", "FERRO_HEARTBEAT_FILE"}
    expected = marked if policy == "rank" else marked - elastic_only
    assert seen == expected, f"ferro run sets {sorted(seen - expected)} unmarked; marked but not set: " \
                             f"{sorted(expected - seen)}"
