"""Why a rule left a candidate, in words (the rule engine's side of `optimize --explain PASS`).

A condition or a rewrite that declines returns `fail("why")`, which is falsy; the engine keeps a
declined reason as `Declined` and a pattern's own as `Unmatched` (with how far the pattern got),
and `explain_failures` makes one line per candidate of the reasons of the rules tried.
"""
from __future__ import annotations

from typing import Callable

import onnx_graphsurgeon as gs


class Failure:
    """Why a candidate did not match or was not rewritten; falsy, so that a condition or a
    rewrite returns `fail("why")` where it would return False."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"fail({self.reason!r})"


def fail(reason: str) -> Failure:
    return Failure(reason)


def declined(result, what) -> str:
    """The reason a falsy condition or rewrite result gives."""
    if isinstance(result, Failure):
        return result.reason
    name = getattr(what, "__name__", "")
    return f"{name} declined" if name and name != "<lambda>" else "its condition does not hold"


class Declined(str):
    """A condition's or a rewrite's reason (the pattern matched): explain_failures prefers it."""


class Unmatched(str):
    """Where a pattern stopped matching; `depth`: how many operands it had matched by then."""

    depth: int = 0

    def __new__(cls, text: str, depth: int) -> "Unmatched":
        out = super().__new__(cls, text)
        out.depth = depth
        return out


Explain = Callable[[gs.Node, str], object]


def explain_failures(explain: Explain | None, node: gs.Node, tried: list[tuple[str, str]]) -> None:
    """Hand `explain` one line for a candidate root that no rule rewrote: of the rules tried,
    those whose pattern matched (their condition or rewrite declined) when some did, else those
    whose pattern got furthest; their one reason, or each rule's, named."""
    if explain is None or not tried:
        return
    kept = [t for t in tried if isinstance(t[1], Declined)]
    if not kept:
        furthest = max(getattr(why, "depth", 0) for _, why in tried)
        kept = [t for t in tried if getattr(t[1], "depth", 0) == furthest]
    if len({why for _, why in kept}) == 1:
        explain(node, kept[0][1])
    else:
        explain(node, "; ".join(f"{name}: {why}" for name, why in kept))
