"""A griffe extension: ferro's reStructuredText docstring idioms become the site's Markdown.

ferro's docstrings are Google style with reStructuredText roles (``:class:`~ferro.DDP```), which
``help()`` and IDEs show as they are. mkdocstrings renders Markdown, where a role would show as
literal text, so when the package has loaded (``on_package``) every role is rewritten:

* a target found in ferro (absolute, or relative to the docstring's class, module or a module
  above it, or to ``ferro``) becomes an autorefs link to the object's canonical path, marked
  optional: it links where the site documents that object and shows as code where it does not
  (a private helper);
* a target in another installed package (``numpy.ndarray``, ``torch.nn.Module``) or a builtin shows as code;
* anything else stays a required cross-reference, so ``mkdocs build --strict`` fails and names it:
  a role that points at a name no longer in the code is a broken reference, not a style choice.

Literal blocks (``Example::`` and an indented block, the per-rank examples) become fenced, highlighted
code blocks.
"""

from __future__ import annotations

import builtins
import html
import importlib.util
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|data|attr|exc|mod|obj|const):`([^`]+)`")
_TITLED = re.compile(r"^(.*?)\s*<([^>]+)>$")
_SHELL_STARTS = ("$ ", "ferro ", "mpirun ", "torchrun ", "srun ", "python ", "FERRO_", "pip ")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def fence_literal_blocks(text: str) -> str:
    """Turn each reStructuredText literal block (a line ending in ``::``, then an indented block) into a fence."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.rstrip().endswith("::"):
            out.append(line)
            i += 1
            continue
        base = _indent(line)
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        end = j
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
            end += 1
        block = lines[j:end]
        while block and not block[-1].strip():
            block.pop()
        if not block:
            out.append(line)
            i += 1
            continue
        depth = min(_indent(b) for b in block if b.strip())
        head = line.rstrip()[:-2].rstrip()
        pad = " " * base
        language = "bash" if block[0].strip().startswith(_SHELL_STARTS) else "python"
        if head.strip() in ("Example", "Examples"):
            out.extend([f"{pad}**{head.strip()}**", ""])
        elif head.strip():
            out.extend([f"{head}:", ""])
        out.append(f"{pad}```{language}")
        out.extend(pad + b[depth:] if b.strip() else "" for b in block)
        out.append(f"{pad}```")
        out.append("")
        i = end
    return "\n".join(out)


def _member(root: griffe.Object | griffe.Alias, parts: list[str]) -> griffe.Object | None:
    """Return the object at ``parts`` below ``root``, following aliases; None where any step is missing."""
    node: Any = root
    for part in parts:
        try:
            if isinstance(node, griffe.Alias):
                node = node.final_target
            node = node.members[part]
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError, AttributeError):
            return None
    try:
        return node.final_target if isinstance(node, griffe.Alias) else node
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None


class SphinxRoles(griffe.Extension):
    """Rewrite reStructuredText roles into autorefs cross-references (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Rewrite every docstring of the package once it has loaded whole."""
        self._package = pkg
        self._rewrite(pkg)

    def _rewrite(self, obj: griffe.Object) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            value = _ROLE.sub(lambda match: self._link(obj, match.group(1)), obj.docstring.value)
            obj.docstring.value = fence_literal_blocks(value) if "::" in value else value
        for member in obj.members.values():
            if not isinstance(member, griffe.Alias):
                self._rewrite(member)

    def _resolve(self, obj: griffe.Object, target: str) -> griffe.Object | None:
        if target.startswith("ferro.pipeline."):  # the module's public name; it lives in ferro.parallel
            target = "ferro.parallel.pipeline." + target.removeprefix("ferro.pipeline.")
        parts = target.split(".")
        if parts[0] == self._package.name:
            return _member(self._package, parts[1:])
        scopes: list[griffe.Object] = []
        scope: griffe.Object | None = obj
        while scope is not None:
            scopes.append(scope)
            scope = scope.parent
        for scope in scopes:
            found = _member(scope, parts)
            if found is not None:
                return found
        return None

    def _link(self, obj: griffe.Object, text: str) -> str:
        text = text.strip()
        titled = _TITLED.match(text)
        if titled:
            title, target = titled.group(1), titled.group(2).lstrip("~.")
        else:
            target = text.lstrip("~.")
            title = target.rsplit(".", 1)[-1] if text.startswith("~") else target
        target = target.removesuffix("()")
        found = self._resolve(obj, target)
        if found is not None:
            identifier = html.escape(found.canonical_path, quote=True)
            return f'<autoref identifier="{identifier}" optional><code>{html.escape(title)}</code></autoref>'
        top = target.split(".", 1)[0]
        if top != self._package.name and (hasattr(builtins, top) or importlib.util.find_spec(top) is not None):
            return f"`{title}`"
        return f"[`{title}`][{target}]"
