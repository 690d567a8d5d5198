"""An MkDocs hook: the guides' inline code that names a public object links to its API entry.

A guide writes `` `ferro.allreduce` `` or `` `PeerLostError` `` as code, as the README did; on the site that
becomes a link to the object's entry in the reference. Only names the reference documents are linked: the names
of ``ferro.__all__`` (read from the source with ``ast``, so the hook needs no compiled ferro) and the exception
classes of ``ferro.errors``, which ``tests/test_docs.py`` checks are all in the reference. Code blocks, headings
and code that is already a link are left alone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]
_NAMESPACES = {"checkpoint", "dtensor", "elastic", "nn", "p2p", "pipeline", "rpc", "__version__"}


def _all_of(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise LookupError(f"{path} has no __all__")


_ERRORS = set(_all_of(_ROOT / "ferro" / "errors.py"))
_PUBLIC = set(_all_of(_ROOT / "ferro" / "__init__.py")) - _NAMESPACES
# `ferro.allreduce`, `ferro.allreduce(x)`, `ferro.DDP(model, ...)`, `PeerLostError`: code spans not inside a link.
_CODE = re.compile(r"(?<![\[\w])`(?P<text>(?:ferro\.)?(?P<name>[A-Za-z_]\w*)(?:\([^`]*\))?)`(?!\]|\()")


def _identifier(text: str, name: str) -> str | None:
    if name in _ERRORS:
        return f"ferro.errors.{name}"
    if text.startswith("ferro.") and name in _PUBLIC:
        return f"ferro.{name}"
    return None


def _link(match: re.Match[str]) -> str:
    identifier = _identifier(match.group("text"), match.group("name"))
    return f"[`{match.group('text')}`][{identifier}]" if identifier else match.group(0)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """Link the page's inline code that names a documented object (outside code blocks and headings)."""
    if page.file.src_uri.startswith("api/"):
        return markdown  # the reference links its own names, and its headings are the targets
    out, fenced = [], False
    for line in markdown.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith("#"):
            line = _CODE.sub(_link, line)
        out.append(line)
    return "\n".join(out)
