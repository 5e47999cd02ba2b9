"""A griffe extension: actcomp's docstrings, written for ``help()`` and doctest, as Markdown.

The API reference (``docs/api.md``) renders docstrings as Markdown, where ``literal`` is already a
code span but three reST habits are not Markdown: ``>>>`` examples (they would become nested
block quotes), roles such as :func:`to_compressed` and reST simple tables or ``Grammar::``
literal blocks (both would run together into one paragraph). This rewrites those, for the site
only; the source stays as it is. mkdocs.yml loads it (the python handler's ``extensions``).
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|obj|exc):`(~?)([^`]+)`")
TABLE_BORDER = re.compile(r"^\s*=+(\s+=+)+\s*$")


def _roles(line: str) -> str:
    """Roles as code spans; ``~a.b.c`` shows ``c``, as Sphinx does."""
    return ROLE.sub(lambda match: f"`{match.group(2).rsplit('.', 1)[-1] if match.group(1) else match.group(2)}`", line)


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _fence(out: list[str], block: list[str], language: str, indent: str) -> None:
    """Append ``block`` to ``out`` as a fenced code block at ``indent``, after a blank line."""
    if out and out[-1].strip():
        out.append("")
    depth = min(len(_indent(line)) for line in block if line.strip())
    out += [f"{indent}```{language}", *(indent + line[depth:] for line in block), f"{indent}```"]


def to_markdown(text: str) -> str:
    """The Markdown for a docstring's reST-flavoured ``text``.

    >>> to_markdown("See :func:`~actcomp.parse`.\\n\\n>>> 1 + 1\\n2").splitlines()
    ['See `parse`.', '', '```pycon', '>>> 1 + 1', '2', '```']
    """
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith("```"):
            # Already Markdown (a docstring seen twice): copy the fenced block as it is.
            end = i + 1
            while end < len(lines) and not lines[end].strip().startswith("```"):
                end += 1
            out += lines[i : end + 1]
            i = end + 1
        elif stripped.startswith(">>>"):
            # A doctest block runs to the next blank line (doctest's own rule).
            end = i
            while end < len(lines) and lines[end].strip():
                end += 1
            _fence(out, lines[i:end], "pycon", _indent(line))
            i = end
        elif TABLE_BORDER.match(line):
            # A simple table: top border, header, border, rows, bottom border. Kept as drawn.
            borders, end = 0, i
            while end < len(lines) and borders < 3:
                borders += bool(TABLE_BORDER.match(lines[end]))
                end += 1
            _fence(out, lines[i:end], "text", _indent(line))
            i = end
        elif stripped.endswith("::") and i + 2 < len(lines) and not lines[i + 1].strip():
            # A literal block: the indented lines after "Paragraph::" and a blank line.
            out.append(_roles(line[:-1]) if stripped != "::" else "")
            start = end = i + 2
            base = len(_indent(line))
            while end < len(lines) and (not lines[end].strip() or len(_indent(lines[end])) > base):
                end += 1
            while end > start and not lines[end - 1].strip():
                end -= 1
            _fence(out, lines[start:end], "text", _indent(line))
            i = end
        else:
            out.append(_roles(line))
            i += 1
    return "\n".join(out)


class RstDocstrings(griffe.Extension):
    """Rewrite every docstring griffe loads (see :func:`to_markdown`)."""

    def on_object(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)

    def on_package(self, *, pkg: griffe.Module, **kwargs: object) -> None:
        # The package itself gets no on_object call.
        self.on_object(obj=pkg)
