"""The documentation site builds strictly, documents every public name, and its code runs.

The site (mkdocs.yml, docs/) is built with ``mkdocs build --strict`` into a temporary folder: a broken
cross-reference, a docstring griffe cannot parse or a page missing from the navigation fails the build.
The built HTML is then checked for what the API reference promises: an entry for every name of
``ferro.__all__`` and of each documented subpackage's ``__all__``, and every exception class on the
exceptions page.

Every fenced code block of the guides, the home page and the README is collected, and each one is either
run here or marked, in the Markdown, as not runnable with a reason. What a block may carry, on the line
above its fence:

* nothing: a ``python`` block runs as one rank (``ferro.testing.run_processes`` with the rank's
  environment, so ``ferro.init_process_group()`` works) in the page's working folder;
* ``<!-- test: ranks=N -->``: a ``python`` block runs on N ranks as processes, each with its rank's
  environment, and every rank must finish without an error;
* ``<!-- not-run: REASON -->``: the block is not run, and REASON (a GPU, several hosts, minutes of
  runtime) says why; a block with no reason fails the collection test;
* a ``python`` block with a ``title="NAME"`` is a file: it is written into the working folder as NAME,
  and some ``bash`` block of the page must name it or some other file of the page import it;
* a ``bash`` block runs with bash in the working folder, after the page's files are written;
* ``text`` blocks are output shown to the reader, not code. Output a reader would compare with their own run is
  checked against a real one: ``<!-- test: output -->`` on a ``text`` block that follows a ``bash`` block makes the
  lines that block prints the lines shown, and ``<!-- test: transcript -->`` on a ``text`` block that starts with
  ``$ COMMAND`` runs COMMAND in the repository root and compares likewise. Both compare the sets of lines (ranks
  print in any order; a note repeated once per timeout may repeat another time) after numbers that differ from run
  to run (times, losses, CPU shares, process ids, addresses, shared-library paths) are masked, so a line the page
  shows and the program no longer prints fails, and so does a line the program prints that the page leaves out.
  A transcript that ends at a line of ``ferro run``'s own is compared up to that line of the run: ranks the launcher
  is stopping may print after it, in a race with the stop.
  Output that cannot be compared (benchmark figures, a run with a random order of events) says why in
  ``<!-- not-run: REASON -->``.
"""

from __future__ import annotations

import dataclasses
import html
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ferro
import ferro.errors
from ferro.testing import run_processes

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_ext" not in p.parts) + [ROOT / "README.md"]
_FENCE = re.compile(r"^```(\w*)([^\n]*)$")
_DIRECTIVE = re.compile(r"^<!--\s*(test|not-run):\s*(.*?)\s*-->$")
_TITLE = re.compile(r'title="([^"]+)"')
OUTPUT_LANGUAGES = {"text"}
RUNNABLE_LANGUAGES = {"python", "bash"}
BLOCK_TIMEOUT = 240.0


@dataclasses.dataclass
class Block:
    """One fenced code block of a page, with what the line above its fence says about it."""

    page: Path
    line: int
    language: str
    code: str
    title: str | None = None
    ranks: int = 1
    checked_output: str | None = None  # "output" or "transcript"
    not_run: str | None = None
    directive_error: str | None = None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _parse_directive(block: Block, kind: str, text: str) -> None:
    if kind == "not-run":
        block.not_run = text
        if not text:
            block.directive_error = "not-run without a reason"
        return
    for word in text.split():
        if word.startswith("ranks=") and word[6:].isdigit():
            block.ranks = int(word[6:])
        elif word in ("output", "transcript") and block.language in OUTPUT_LANGUAGES:
            block.checked_output = word
        else:
            block.directive_error = f"unknown test directive {word!r}"


def blocks_of(page: Path) -> list[Block]:
    """Every fenced code block of ``page``, in order."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i].strip()) if not lines[i].startswith("    ") else None
        if fence is None:
            i += 1
            continue
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        title = _TITLE.search(fence.group(2))
        block = Block(page, start + 1, fence.group(1), "\n".join(body) + "\n", title.group(1) if title else None)
        above = start - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        directive = _DIRECTIVE.match(lines[above].strip()) if above >= 0 else None
        if directive:
            _parse_directive(block, directive.group(1), directive.group(2))
        blocks.append(block)
        i += 1
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in blocks_of(page)]
RUN_BLOCKS = [b for b in ALL_BLOCKS if b.not_run is None and b.language in RUNNABLE_LANGUAGES and b.title is None]
TRANSCRIPTS = [b for b in ALL_BLOCKS if b.checked_output == "transcript"]


def _output_shown_after(block: Block) -> Block | None:
    """The ``<!-- test: output -->`` block that follows ``block`` on its page, if the next block is one."""
    blocks = [b for b in ALL_BLOCKS if b.page == block.page]
    following = blocks[blocks.index(block) + 1:]
    if following and following[0].checked_output == "output":
        return following[0]
    return None


_MASKS = [
    (re.compile(r"0x[0-9a-f]+"), "<address>"),
    (re.compile(r"\(/[^()]*\.so[.0-9]*:\d+\)"), "(<library>)"),   # a native frame's shared library
    (re.compile(r"\d+\.\d+|\b\d{4,}\b"), "<n>"),                  # times, losses, pids, ports, run ids
    (re.compile(r"\d+% CPU"), "<n>% CPU"),
]


def _masked_lines(text: str) -> set[str]:
    lines = set()
    for line in text.splitlines():
        for pattern, mask in _MASKS:
            line = pattern.sub(mask, line)
        if line.strip():
            lines.add(line.rstrip())
    return lines


def assert_output_matches(shown: Block, printed: str) -> None:
    """The lines ``shown`` on the page are the lines the program ``printed``, numbers masked (see the docstring)."""
    text = shown.code.split("\n", 1)[1] if shown.checked_output == "transcript" else shown.code
    expected = _masked_lines(text)
    last = text.rstrip().splitlines()[-1]
    if shown.checked_output == "transcript" and last.startswith("ferro run:") and last in printed:
        # The page ends at a line of the launcher's, which prints in order: what ranks print after it (a rank
        # the launcher is stopping may still report its peers gone) races the stop and is not the page's.
        printed = printed[:printed.index(last) + len(last)]
    actual = _masked_lines(printed)
    missing, unshown = sorted(expected - actual), sorted(actual - expected)
    assert not missing and not unshown, (
        f"{shown.name}: the page's output is not what the program prints\n"
        f"shown but not printed:\n  " + "\n  ".join(missing) + "\nprinted but not shown:\n  " + "\n  ".join(unshown)
        + f"\n--- the run printed ---\n{printed}")


def test_every_code_block_is_run_or_marked_with_a_reason():
    problems = []
    for block in ALL_BLOCKS:
        if block.directive_error:
            problems.append(f"{block.name}: {block.directive_error}")
        elif block.not_run is None and block.language not in RUNNABLE_LANGUAGES | OUTPUT_LANGUAGES:
            problems.append(f"{block.name}: a {block.language or 'plain'} block neither runs nor says why not "
                            "(mark it <!-- not-run: REASON -->, or make it text if it is output)")
        elif block.ranks > 1 and block.language != "python":
            problems.append(f"{block.name}: ranks= applies to python blocks")
    for page in PAGES:
        blocks = [b for b in ALL_BLOCKS if b.page == page]
        users = "\n".join(b.code for b in blocks if b.not_run is None and (b.language == "bash" or b.title))
        for block in blocks:
            if not block.title or block.not_run is not None:
                continue
            module = Path(block.title).stem
            if block.title not in users and not re.search(rf"^\s*(from|import) {module}\b", users, re.M):
                problems.append(f"{block.name}: the file {block.title} is run by no bash block of its page "
                                "and imported by no file of it")
    for block in ALL_BLOCKS:
        if block.checked_output == "output" and not any(_output_shown_after(b) is block for b in RUN_BLOCKS
                                                        if b.language == "bash"):
            problems.append(f"{block.name}: <!-- test: output --> must follow a bash block that runs")
    assert not problems, "\n".join(problems)
    assert len(RUN_BLOCKS) >= 25, "the guides lost their runnable examples"


def _page_folder(block: Block, tmp_path: Path) -> Path:
    """The block's working folder: every titled file of its page, and the repository's examples as in a clone."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for other in ALL_BLOCKS:
        if other.page == block.page and other.title:
            target = tmp_path / other.title
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(other.code)
    return tmp_path


def _program(block: Block) -> str:
    """The block's code after blank lines up to its fence, so a traceback's line numbers are the page's."""
    return "\n" * block.line + block.code


def run_block_as_rank(rank: int, world_size: int, code: str, folder: str, name: str) -> None:
    """Run a page's Python on one rank, in its folder, as ``__main__``; leaves no default group behind."""
    os.chdir(folder)
    sys.argv = [name]
    try:
        exec(compile(code, name, "exec"), {"__name__": "__main__"})
    finally:
        if ferro.is_initialized():
            ferro.destroy_process_group()


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda b: b.name)
def test_code_block_runs(block, tmp_path):
    folder = _page_folder(block, tmp_path)
    if block.language == "python":
        run_processes(run_block_as_rank, block.ranks, args=(_program(block), str(folder), str(block.page)),
                      backend=None, timeout=BLOCK_TIMEOUT)
        return
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
    assert result.returncode == 0, f"{block.name} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    shown = _output_shown_after(block)
    if shown is not None:
        assert_output_matches(shown, result.stdout + result.stderr)


@pytest.mark.parametrize("shown", TRANSCRIPTS, ids=lambda b: b.name)
def test_transcript_is_what_its_command_prints(shown):
    command = shown.code.split("\n", 1)[0]
    assert command.startswith("$ "), f"{shown.name}: a transcript starts with '$ COMMAND'"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FERRO_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    result = subprocess.run(["bash", "-c", command[2:] + " 2>&1"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=BLOCK_TIMEOUT)
    assert_output_matches(shown, result.stdout)


def test_output_checks_cannot_pass_on_other_output():
    # The comparison must be able to fail both ways: a line shown that is not printed, and one printed not shown.
    shown = Block(ROOT / "README.md", 1, "text", "[rank 0] loss 0.25 after 1.5 s\nferro run: done\n",
                  checked_output="output")
    assert_output_matches(shown, "ferro run: done\n[rank 0] loss 0.31 after 2.0 s\n")  # numbers masked
    with pytest.raises(AssertionError, match="shown but not printed"):
        assert_output_matches(shown, "ferro run: done\n")
    with pytest.raises(AssertionError, match="printed but not shown"):
        assert_output_matches(shown, "ferro run: done\n[rank 0] loss 0.31 after 2.0 s\n[rank 1] extra\n")
    # A transcript ending at the launcher's stop: ranks' words after it race the stop and are not compared;
    # before it they are.
    stopped = Block(ROOT / "README.md", 1, "text", "$ ferro run x.py\nferro run: stopping the job (exit code 86)\n",
                    checked_output="transcript")
    assert_output_matches(stopped, "ferro run: stopping the job (exit code 86)\n[rank 3] Traceback ...\n")
    with pytest.raises(AssertionError, match="printed but not shown"):
        assert_output_matches(stopped, "[rank 3] Traceback ...\nferro run: stopping the job (exit code 86)\n")


# --- the built site ---

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("mkdocs is not installed: pip install '.[docs]' (the test extra includes it)")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "-d", str(out)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    return out


def _anchors(page: Path) -> set[str]:
    return {html.unescape(a) for a in re.findall(r'id="([^"]+)"', page.read_text())}


def test_site_builds_with_a_search_index_and_no_empty_page(site):
    index = json.loads((site / "search" / "search_index.json").read_text())
    locations = {doc["location"].split("#")[0] for doc in index["docs"]}
    for page in sorted(DOCS.rglob("*.md")):
        if "_ext" in page.parts:
            continue
        relative = page.relative_to(DOCS).with_suffix("")
        folder = relative.parent if relative.name == "index" else relative
        location = "" if str(folder) == "." else f"{folder}/"
        assert location in locations, f"{page} is not in the search index"
        text = re.sub(r"<[^>]+>", " ", (site / location / "index.html").read_text().split('<article', 1)[1])
        words = len(text.split())
        assert words > 150, f"{page} renders {words} words: empty or a stub"


# Each reference page, and the modules whose __all__ it documents (names re-exported by `ferro` may be on its page).
REFERENCE_PAGES = {
    "checkpoint": ["ferro.checkpoint"], "rpc": ["ferro.rpc"], "dtensor": ["ferro.dtensor"],
    "pipeline": ["ferro.parallel.pipeline"], "elastic": ["ferro.elastic"], "nn": ["ferro.nn"],
    "torch": ["ferro.interop.torch"], "testing": ["ferro.testing"], "doctor": ["ferro.collective.diagnosis"],
    "backend": ["ferro.backend"], "parallel": ["ferro.parallel.comm_hooks", "ferro.parallel.local_sgd"],
}


def test_api_reference_has_every_public_name(site):
    top = _anchors(site / "api" / "ferro" / "index.html") | _anchors(site / "api" / "errors" / "index.html")
    namespaces = {"checkpoint", "dtensor", "elastic", "nn", "p2p", "pipeline", "rpc", "__version__"}
    missing = [name for name in ferro.__all__
               if name not in namespaces and f"ferro.{name}" not in top and f"ferro.errors.{name}" not in top]
    assert not missing, f"not in the API reference: {missing}"
    for page, module_names in REFERENCE_PAGES.items():
        anchors = _anchors(site / "api" / page / "index.html") | top
        for module_name in module_names:
            missing = [name for name in importlib.import_module(module_name).__all__
                       if f"{module_name}.{name}" not in anchors and f"ferro.{name}" not in top]
            assert not missing, f"api/{page}: {module_name} names not documented: {missing}"


def test_exceptions_page_explains_every_exception_class():
    text = (DOCS / "api" / "errors.md").read_text()
    classes = [name for name in ferro.errors.__all__ if issubclass(getattr(ferro.errors, name), BaseException)]
    assert len(classes) >= 25
    missing = [name for name in classes if f"### `{name}`" not in text]
    assert not missing, f"docs/api/errors.md has no section for {missing}"


def test_readme_is_a_landing_page_whose_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    for target in re.findall(r"\]\((?!https?:|#)([^)#]+)", text):
        assert (ROOT / target).exists(), f"README links to {target}, which is not in the repository"


def test_guides_link_the_public_names_they_mention(site):
    page = (site / "guides" / "collectives" / "index.html").read_text()
    assert 'href="../../api/errors/#ferro.errors.PeerLostError"' in page
    assert 'href="../../api/ferro/#ferro.init_process_group"' in page


# --- the generated reference pages (docs/_ext/reference.py) ---

def _reference_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_docs_reference", DOCS / "_ext" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _page_text(site, path: str) -> str:
    page = site / path / "index.html"
    assert page.exists(), f"{path} was not generated"
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text().split("<article", 1)[1]))


def test_environment_page_lists_every_registered_variable_and_marks_the_launchers(site):
    from ferro import environment

    text = _page_text(site, "reference/environment")
    missing = [name for name in environment.VARIABLES if name not in text]
    assert not missing, f"reference/environment lacks {missing}"
    generated = _reference_module().environment_page()
    secret_row = next(line for line in generated.splitlines() if line.startswith("| `FERRO_SECRET`"))
    spin_row = next(line for line in generated.splitlines() if line.startswith("| `FERRO_SPIN_US`"))
    assert secret_row.endswith("| yes |") and spin_row.endswith("|  |")


def test_command_line_page_has_every_option_of_every_parser(site):
    from ferro.tools import cli, run
    from ferro.tools.bench import cli as bench_cli

    text = _page_text(site, "reference/cli")
    assert f"ferro {ferro.__version__}" in text
    for parser in (cli.build_parser(), run.build_parser(), bench_cli.build_parser()):
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert flag in text, f"reference/cli lacks {parser.prog} {flag}"
    for command in ("ferro doctor", "ferro ckpt inspect", "ferro ckpt consolidate", "ferro run", "ferro bench"):
        assert command in text


def test_backend_page_reads_each_backends_declaration_and_engine(site):
    from ferro.backend import BACKENDS

    reference = _reference_module()
    text = _page_text(site, "reference/backends")
    for name, entry in BACKENDS.items():
        assert f"{name}" in text
        if entry.backend_class:
            cls = entry.backend_class()
            assert cls.SUPPORT.devices in text
    # The engine column is read from the class: TCP runs allreduce, reduce and all_to_all natively, shared memory
    # allreduce natively and all_to_all generically.
    assert {"allreduce", "reduce", "all_to_all"} <= set(reference.own_engine(ferro.TcpBackend))
    assert "allreduce" in reference.own_engine(ferro.ShmBackend) and "all_to_all" not in reference.own_engine(
        ferro.ShmBackend)
    assert reference.own_engine(ferro.SimulatedBackend) == []


def test_torch_name_map_resolves_on_both_sides(site):
    reference = _reference_module()
    assert "torch.distributed" in _page_text(site, "reference/torch-names")
    for _, ours, _ in reference.TORCH_NAMES:
        obj = ferro
        for part in ours.split("."):
            obj = getattr(obj, part)  # AttributeError names a ferro name that does not exist
    torch = pytest.importorskip("torch")
    for submodule in ("checkpoint", "fsdp", "pipelining", "rpc", "tensor", "device_mesh"):
        importlib.import_module(f"torch.distributed.{submodule}")  # the modules the names live in
    for torch_name, _, _ in reference.TORCH_NAMES:
        obj = torch
        for part in torch_name.split(".")[1:]:
            obj = getattr(obj, part)


def test_the_version_is_written_once_and_shown_everywhere(site):
    from ferro._version import __version__

    assert ferro.__version__ == __version__
    assert f"ferro {__version__}" in (site / "index.html").read_text()  # the header
    done = subprocess.run([sys.executable, "-m", "ferro.tools.cli", "--version"], capture_output=True, text=True,
                          cwd=ROOT.parent, timeout=60)
    assert done.stdout.strip() == f"ferro {__version__}"
    assert f"## [{__version__}]" in (ROOT / "CHANGELOG.md").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and "version = \"" not in pyproject.split("[project]")[1][:400]


@pytest.mark.parametrize("query, first", [
    ("allreduce", "api/ferro/#ferro.allreduce"), ("init_process_group", "api/ferro/#ferro.init_process_group"),
    ("FERRO_SOCKET_BUFFER_BYTES", "reference/environment/"), ("nproc-per-node", "reference/cli/"),
])
def test_search_lists_the_entry_a_user_looks_for_first(site, query, first):
    node = shutil.which("node")
    if node is None:
        pytest.skip("needs node to run the site's own search worker")
    done = subprocess.run([node, str(ROOT / "tests" / "search_rank.js"), str(site), query], capture_output=True,
                          text=True, timeout=60)
    results = done.stdout.split()
    assert results and results[0].startswith(first), f"search {query!r}: {results}\n{done.stderr[-2000:]}"


def test_search_splits_dotted_names(site):
    # The separator must split "ferro.allreduce" so that a search for "allreduce" matches the API entry's title.
    config = json.loads((site / "search" / "search_index.json").read_text())["config"]
    separator = re.compile(config["separator"])
    assert "allreduce" in separator.split("ferro.allreduce")
    assert "reduce_scatter" in separator.split("ferro.reduce_scatter(x)") or \
        "reduce" in separator.split("ferro.reduce_scatter(x)")


def test_backend_classes_show_users_their_calls_and_the_backend_page_shows_implementers_the_hooks(site):
    user = _anchors(site / "api" / "ferro" / "index.html")
    implementer = _anchors(site / "api" / "backend" / "index.html")
    for name in ("send", "recv", "barrier", "split", "close", "stats"):
        assert f"ferro.Backend.{name}" in user
    for cls in ("Backend", "TcpBackend", "ShmBackend", "HierarchicalBackend", "MpiBackend", "NcclBackend"):
        hooks = sorted(a for a in user if a.startswith(f"ferro.{cls}.") and re.search(
            r"\.(native_\w+|\w+_tagged|ring_pieces|frames_waiting|abort_peers|cut_peer|issue_nonblocking)$", a))
        assert not hooks, f"the page users read lists implementer hooks: {hooks}"
    for hook in ("send_tagged", "frames_waiting", "abort_peers", "cut_peer", "issue_nonblocking"):
        assert f"ferro.backend.base.Backend.{hook}" in implementer
    assert "ferro.backend.NativeCollectives.native_allreduce" in implementer
