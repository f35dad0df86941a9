"""A Sphinx directive, ``matepoint-options``: the table of matepoint's
options and environment variables, generated at build time from the one
place each is defined, so that no page writes them twice:

* defaults and accepted values: the C core's option table
  (csrc/module/options.c, exported as ``matepoint._C.OPTIONS``);
* what each option does: the ``Options`` docstring (matepoint/_options.py);
* the other ``MATEPOINT_*`` variables: ``matepoint._options.ENVIRONMENT``;
* the benchmarks page's tables and plot: ``benchmarks/RESULTS.md`` (the
  latest row of each section), written to docs/_generated/ (not committed).
"""
from __future__ import annotations

import re
from typing import Dict, List

from docutils import nodes
from docutils.parsers.rst import Directive


def option_descriptions(doc: str) -> Dict[str, str]:
    """``name: text`` entries of the Options docstring, joined per name."""
    found: Dict[str, str] = {}
    current = None
    for line in doc.splitlines():
        match = re.match(r"^    (\w+): (.*)$", line)
        if match:
            current = match.group(1)
            found[current] = match.group(2)
        elif current and line.startswith("        "):
            found[current] += " " + line.strip()
        elif line.strip() == "":
            current = None
    return found


def _table(header: List[str], rows: List[List[str]], widths: List[int]) -> nodes.table:
    table = nodes.table()
    group = nodes.tgroup(cols=len(header))
    table += group
    for width in widths:
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    group += head
    body = nodes.tbody()
    group += body
    for cells, parent in [(header, head)] + [(row, body) for row in rows]:
        row_node = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            paragraph = nodes.paragraph()
            # `code` spans in the text become literals
            for index, piece in enumerate(re.split(r"``?", cell)):
                if piece:
                    paragraph += nodes.literal(piece, piece) if index % 2 else nodes.Text(piece)
            entry += paragraph
            row_node += entry
        parent += row_node
    return table


def _default(value: object) -> str:
    return "None" if value is None else repr(value)


class OptionsTable(Directive):
    """``.. matepoint-options::`` (or ```{matepoint-options}``` in MyST)."""

    has_content = False
    optional_arguments = 1   # "options" (default) or "environment"

    def run(self) -> List[nodes.Node]:
        import matepoint
        from matepoint import _C
        from matepoint._options import ENVIRONMENT

        which = self.arguments[0] if self.arguments else "options"
        if which == "environment":
            rows = [[f"``{name}``", text] for name, text in ENVIRONMENT.items()]
            return [_table(["variable", "what it does"], rows, [3, 9])]
        described = option_descriptions(matepoint.Options.__doc__ or "")
        rows = []
        for name, (default, accepted) in _C.OPTIONS.items():
            if name not in described:
                raise self.error(f"option {name} has no entry in the Options docstring")
            rows.append([f"``{name}``", f"``MATEPOINT_{name.upper()}``",
                         f"``{_default(default)}``", accepted or "True or False",
                         described[name]])
        return [_table(["option", "variable", "default", "accepts", "what it does"], rows,
                       [2, 3, 1, 2, 6])]




# ---- benchmarks: today's figures from benchmarks/RESULTS.md --------------------

def latest_tables(results: str) -> List[str]:
    """Per ``##`` section of RESULTS.md: its title and its first table, as
    Markdown; a table by date is cut to its header and last (latest) row."""
    out: List[str] = []
    for section in results.split("\n## ")[1:]:
        title, _, body = section.partition("\n")
        rows = []
        for line in body.split("\n### ", 1)[0].splitlines():
            if line.startswith("|"):
                rows.append(line)
            elif rows:
                break
        if len(rows) >= 3:
            # a dated table grows a row per run: today's is the last
            dated = rows[0].strip("| ").lower().startswith("date")
            out += [f"### {title}", ""] + (rows[:2] + rows[-1:] if dated else rows) + [""]
    return out


def overhead_svg(results: str) -> str:
    """A bar chart (SVG, no library) of the latest per-call overhead row."""
    section = results.split("## Per-call overhead (CPU)", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| 20")]
    cells = [cell.strip() for cell in rows[-1].strip("|").split("|")]
    bars = [("no checkpoint", cells[3]), ("torch checkpoint", cells[4]), ("matepoint", cells[5])]
    values = [float(value.split()[0]) for _, value in bars]
    scale = 300.0 / max(values)
    parts = ['<svg xmlns="http://www.w3.org/2000/svg" width="520" height="130" '
             'font-family="sans-serif" font-size="13">']
    for index, ((label, text), value) in enumerate(zip(bars, values)):
        y = 15 + index * 36
        parts.append(f'<text x="0" y="{y + 17}">{label}</text>')
        parts.append(f'<rect x="130" y="{y}" width="{value * scale:.1f}" height="24" '
                     f'fill="#4a7fb5"/>')
        parts.append(f'<text x="{136 + value * scale:.1f}" y="{y + 17}">{text}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_benchmarks(app) -> None:  # noqa: ANN001 (Sphinx's object)
    import os
    root = os.path.dirname(os.path.abspath(app.srcdir))
    with open(os.path.join(root, "benchmarks", "RESULTS.md"), encoding="utf-8") as file:
        results = file.read()
    folder = os.path.join(app.srcdir, "_generated")
    os.makedirs(folder, exist_ok=True)
    tables = "\n".join(latest_tables(results))
    figure = ("![Per-call time, forward and backward, latest run](/_generated/overhead.svg)\n\n"
              "Per-call time of one small checkpointed call (the latest row of "
              "\"Per-call overhead\").\n\n")
    for name, text in (("bench_tables.md", figure + tables), ("overhead.svg",
                                                              overhead_svg(results))):
        path = os.path.join(folder, name)
        old = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        if old != text:     # unchanged files keep Sphinx's cache valid
            with open(path, "w", encoding="utf-8") as file:
                file.write(text)


# ---- docstrings: plain text for help(), read as reStructuredText here ----------

_ENTRY = re.compile(r"^(\s*)([A-Za-z_][\w, ]*): (.+)$")


def _escape_stars(line: str) -> str:
    """``*args``/``**kwargs`` outside literals, escaped for reST."""
    pieces = re.split(r"(``.*?``)", line)
    return "".join(piece if piece.startswith("``") else
                   re.sub(r"(?<![\w`\\])(\*{1,2})(?=\w)",
                          lambda m: "\\*" * len(m.group(1)), piece) for piece in pieces)


def plain_docstring(app, what, name, obj, options, lines: List[str]) -> None:  # noqa: ANN001
    """matepoint's docstrings list arguments as ``name: text`` with indented
    continuation lines (help() reads them well); here each becomes a
    definition-list item. Docstrings in Google style (``Args:``) are left to
    napoleon."""
    if any(line.strip() in ("Args:", "Returns:", "Raises:") for line in lines):
        lines[:] = [_escape_stars(line) for line in lines]
        return
    out: List[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        match = _ENTRY.match(line)
        if match and not match.group(1) and " " not in match.group(2).replace(", ", ","):
            if out and out[-1].strip():
                out.append("")
            out.append(f"``{match.group(2)}``")
            out.append("    " + _escape_stars(match.group(3)))
            index += 1
            while index < len(lines) and lines[index].startswith("    ") and lines[index].strip():
                out.append("    " + _escape_stars(lines[index].strip()))
                index += 1
            out.append("")
            continue
        out.append(_escape_stars(line))
        index += 1
    lines[:] = out


def setup(app):  # noqa: ANN001, ANN201 (Sphinx's signature)
    app.add_directive("matepoint-options", OptionsTable)
    app.connect("builder-inited", write_benchmarks)
    app.connect("autodoc-process-docstring", plain_docstring)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
