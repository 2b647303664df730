"""A small C emitter shared by the CUDA generators: lines, blocks, declarations, indentation.

    src = CSource()
    src.line("#include <math.h>")
    with src.block(f'extern "C" __global__ void {entry}(const {entry}_args a)'):
        src.constants({"ROWS": 4, "TILE": 32})
        src.decls([("b", "DIV(bid, H)")])
        src.pragma("unroll")
        with src.block("for (int c = 0; c < DVL; ++c)"):
            src.line("acc[c] = 0.0f;")
    kernel_source = src.text()

A generator says what it writes (a statement, a block, declarations of index expressions, a
directive); the emitter indents it by the blocks open around it (two spaces a level), so a
statement moved into a loop needs no re-indenting. Preprocessor lines (#pragma, #define,
#include) go to column 0 wherever they are written, as nvcc expects them.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Mapping

INDENT = "  "


class CSource:
    """C source text under construction: a list of lines and the depth of the open blocks."""

    def __init__(self, depth: int = 0) -> None:
        self.lines: list[str] = []
        self.depth = depth

    @property
    def indent(self) -> str:
        return INDENT * self.depth

    def line(self, *texts: str) -> CSource:
        """Statements (or any lines) at the current depth; an empty text is an empty line, and
        a text starting with '#' a preprocessor line at column 0."""
        for text in texts:
            self.lines.append(text if not text or text.startswith("#") else self.indent + text)
        return self

    def raw(self, *texts: str) -> CSource:
        """Lines exactly as given (multi-line texts kept whole): macro blocks, continuation lines."""
        self.lines.extend(texts)
        return self

    def pragma(self, text: str) -> CSource:
        return self.raw(f"#pragma {text}")

    def comment(self, text: str) -> CSource:
        return self.line(f"// {text}")

    def decls(self, pairs: Iterable[tuple[str, str]], ctype: str = "const auto") -> CSource:
        """One declaration `CTYPE name = expr;` per (name, expr) pair: the index tables the
        generators share with their numpy models are written through here."""
        return self.line(*(f"{ctype} {name} = {expr};" for name, expr in pairs))

    def constants(self, values: Mapping[str, int], ctype: str = "int") -> CSource:
        """The compile-time constants as one `constexpr CTYPE A = 1, B = 2;` line."""
        return self.line(f"constexpr {ctype} " + ", ".join(f"{k} = {v}" for k, v in values.items()) + ";")

    @contextmanager
    def block(self, head: str, end: str = "}", comment: str = "") -> Iterator[CSource]:
        """`head {` (then `  // comment`), the body one level deeper, then `end` (`};` for a struct);
        an empty head opens a bare scope."""
        self.line((f"{head} {{" if head else "{") + (f"  // {comment}" if comment else ""))
        self.depth += 1
        try:
            yield self
        finally:
            self.depth -= 1
        self.line(end)

    @contextmanager
    def indented(self) -> Iterator[CSource]:
        """One level deeper without braces: the statement of an unbraced `for`."""
        self.depth += 1
        try:
            yield self
        finally:
            self.depth -= 1

    def extend(self, lines: Iterable[str]) -> CSource:
        """Lines another helper built, already indented."""
        self.lines.extend(lines)
        return self

    def text(self, trailing_newline: bool = True) -> str:
        return "\n".join(self.lines) + ("\n" if trailing_newline else "")
