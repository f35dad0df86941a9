"""The mutation operators of `make mutants`, over C source text.

A mutant is one small change to one C file that a test should notice:

- ``call``: a statement that is a function call alone on its line(s),
  ``name(...);`` or ``(void)name(...);``, becomes ``(void)0;``;
- ``condition``: a comparison or logical operator flipped (``==`` and
  ``!=``, ``<`` and ``>=``, ``>`` and ``<=``, ``&&`` and ``||``), and the
  whole condition of an ``if`` or ``while`` negated;
- ``constant``: an integer literal changed (0 and 1 swapped, any other n
  to n + 1; ``return -1`` becomes ``return -0``);
- ``goto``: a ``goto label;`` (an error path) becomes ``(void)0;``.

Comments, string and character literals are never touched; preprocessor
lines only in a ``#define``'s value. Each mutant has a key that names it
by its file, operator, line text and change (not its line number), so the
list of equivalent mutants (targets.py) survives edits elsewhere.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

# calls never deleted: an assert only checks (deleting it changes nothing a
# test can see but the check), and these expand to syntax, not calls
KEPT_CALLS = {"MP_ASSERT", "Py_BEGIN_ALLOW_THREADS", "Py_END_ALLOW_THREADS", "Py_RETURN_NONE",
              "Py_UNREACHABLE", "PyDoc_STRVAR", "_Static_assert", "static_assert"}
KEYWORDS = {"if", "while", "for", "switch", "return", "sizeof", "do", "else", "case", "goto",
            "_Alignof", "alignof", "defined"}
FLIPS = {"==": "!=", "!=": "==", "<": ">=", ">=": "<", ">": "<=", "<=": ">", "&&": "||",
         "||": "&&"}
# longest first: `->`, shifts and compound assignments are no comparisons
OPERATOR = re.compile(r"->|<<=|>>=|<<|>>|<=|>=|==|!=|&&|\|\||<|>")
NUMBER = re.compile(r"(?<![\w.])(0[xX][0-9a-fA-F]+|\d+)([uUlL]*)(?![\w.])")
CALL_START = re.compile(r"(\(void\)\s*)?([A-Za-z_]\w*)(\s*(->|\.)\s*[A-Za-z_]\w*)*\s*\(")
GOTO = re.compile(r"\bgoto\s+[A-Za-z_]\w*\s*;")
BRANCH = re.compile(r"\b(if|while)\s*\(")


@dataclass(frozen=True)
class Mutant:
    path: str           # relative to the checkout
    operator: str
    line: int           # 1-based, of the change's start
    start: int          # offsets into the file's text
    end: int
    replacement: str
    key: str            # stable name: see the module's docstring

    def apply(self, text: str) -> str:
        return text[:self.start] + self.replacement + text[self.end:]

    def describe(self, text: str) -> str:
        """`line: original -> replacement`, on one line."""
        original = " ".join(text[self.start:self.end].split())
        return f"{self.path}:{self.line}: {original} -> {self.replacement}"


def code_mask(text: str) -> List[bool]:
    """Per character: True where it is code (not a comment, a string or
    character literal, or a preprocessor line other than a #define's
    value)."""
    mask = [True] * len(text)
    i, n = 0, len(text)
    while i < n:
        two = text[i:i + 2]
        if two == "/*":
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
        elif two == "//":
            end = text.find("\n", i)
            end = n if end < 0 else end
        elif text[i] in "\"'":
            end = i + 1
            while end < n and text[end] != text[i]:
                end += 2 if text[end] == "\\" else 1
            end = min(end + 1, n)
        elif text[i] == "#" and (i == 0 or text[:i].rstrip(" \t").endswith("\n") or
                                 not text[:i].strip()):
            end = _preprocessor_end(text, i)
            value = re.match(r"#\s*define\s+\w+(\([^)]*\))?", text[i:end])
            if value is not None:       # a #define's value stays code
                end = i + value.end()
        else:
            i += 1
            continue
        for k in range(i, end):
            mask[k] = False
        i = end
    return mask


def _preprocessor_end(text: str, start: int) -> int:
    """The end of the preprocessor line at `start`, continuations included."""
    end = start
    while True:
        end = text.find("\n", end)
        if end < 0:
            return len(text)
        if text[end - 1] != "\\":
            return end
        end += 1


def _all_code(mask: List[bool], start: int, end: int) -> bool:
    return all(mask[start:end])


def _matching_paren(text: str, mask: List[bool], open_at: int) -> int:
    """The offset of the parenthesis closing the one at `open_at`, or -1."""
    depth = 0
    for i in range(open_at, len(text)):
        if not mask[i]:
            continue
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _line_starts(text: str) -> List[int]:
    starts = [0]
    starts.extend(i + 1 for i, c in enumerate(text) if c == "\n")
    return starts


def _calls(text: str, mask: List[bool]) -> Iterator[Tuple[int, int, str]]:
    """Statements that are a call alone: (start, end, replacement)."""
    for start in _line_starts(text):
        indent = len(text[start:]) - len(text[start:].lstrip(" \t"))
        at = start + indent
        match = CALL_START.match(text, at)
        if match is None or not mask[at] or match.group(2) in KEYWORDS | KEPT_CALLS:
            continue
        close = _matching_paren(text, mask, match.end() - 1)
        end = close + 1
        while end < len(text) and text[end] in " \t":
            end += 1
        if close < 0 or end >= len(text) or text[end] != ";":
            continue
        # a statement's start: after `;`, a brace, a label or an if's or
        # else's head; never a continued expression or an initializer
        before = _code_before(text, mask, start)
        if not (before in (";", "{", "}", ":", ")") or before == "" or
                text[:start].rstrip().endswith("else")):
            continue
        yield at, end + 1, "(void)0;"


def _code_before(text: str, mask: List[bool], offset: int) -> str:
    """The last code character before `offset` that is not a space ("" at
    the file's start)."""
    for i in range(offset - 1, -1, -1):
        if mask[i] and not text[i].isspace():
            return text[i]
    return ""


def _conditions(text: str, mask: List[bool]) -> Iterator[Tuple[int, int, str]]:
    for match in OPERATOR.finditer(text):
        operator = match.group()
        if operator in FLIPS and _all_code(mask, match.start(), match.end()):
            yield match.start(), match.end(), FLIPS[operator]
    for match in BRANCH.finditer(text):
        open_at = match.end() - 1
        if not mask[match.start()]:
            continue
        close = _matching_paren(text, mask, open_at)
        if close > open_at + 1:
            inner = text[open_at + 1:close]
            yield open_at, close + 1, f"(!({inner}))"


def _constants(text: str, mask: List[bool]) -> Iterator[Tuple[int, int, str]]:
    for match in NUMBER.finditer(text):
        if not _all_code(mask, match.start(), match.end()):
            continue
        digits, suffix = match.group(1), match.group(2)
        base = 16 if digits[:2].lower() == "0x" else 8 if len(digits) > 1 and digits[0] == "0" else 10
        value = int(digits[2:] if base == 16 else digits, base)
        changed = 1 if value == 0 else 0 if value == 1 else value + 1
        shown = {16: hex, 8: lambda v: "0" + format(v, "o"), 10: str}[base](changed)
        yield match.start(), match.end(), shown + suffix


def _gotos(text: str, mask: List[bool]) -> Iterator[Tuple[int, int, str]]:
    for match in GOTO.finditer(text):
        if _all_code(mask, match.start(), match.end()):
            yield match.start(), match.end(), "(void)0;"


OPERATORS = {"call": _calls, "condition": _conditions, "constant": _constants, "goto": _gotos}


def mutants(path: str, text: str) -> List[Mutant]:
    """Every mutant of the C file `path` (its `text`), in file order."""
    mask = code_mask(text)
    starts = _line_starts(text)
    found: List[Mutant] = []
    seen: Dict[str, int] = {}
    for operator, generate in OPERATORS.items():
        for start, end, replacement in generate(text, mask):
            line = _line_of(starts, start)
            line_text = text[starts[line - 1]:text.find("\n", start) if "\n" in text[start:]
                             else len(text)].strip()
            change = f"{' '.join(text[start:end].split())} -> {replacement}"
            key = f"{path}: {operator}: `{line_text}`: {change}"
            seen[key] = seen.get(key, 0) + 1
            if seen[key] > 1:
                key += f" (#{seen[key]})"
            found.append(Mutant(path, operator, line, start, end, replacement, key))
    return sorted(found, key=lambda m: (m.start, m.operator, m.key))


def _line_of(starts: List[int], offset: int) -> int:
    low, high = 0, len(starts) - 1
    while low < high:
        middle = (low + high + 1) // 2
        if starts[middle] <= offset:
            low = middle
        else:
            high = middle - 1
    return low + 1
