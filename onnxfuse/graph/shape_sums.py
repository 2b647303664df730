"""Sums of monomials over a model's dims, as shape_values' elements carry them.

shape_values describes an element of a shape tensor as a monomial coef * d1 * d2 ... (a Mono).
A decode step's key length is a sum, past + 1 (Concat(past keys, the new one)), and so is every
length computed from it; such a value is carried as a monomial too: its integer content times
one symbol of its own, the *sum symbol*, whose value is the rest of the sum. For example
2*past + 2 is (2, ("onnxfuse.sum(past + 1)",)). So every monomial rule of shape_values (products,
exact quotients by numbers, equality of elements, a dim named by an element) holds for sums
unchanged, and a sum symbol can be a dim's name in a shape table, as the name of the dim it is.

A sum is written canonically: like terms combined, terms in one order, the content the gcd of the
coefficients with the sign of the first term, so two equal sums are the same symbol. Arithmetic
expands sum symbols (`expand`), computes on the terms and writes the result back (`collect`).
A sum symbol whose name this process did not write (read back from a model) is an opaque symbol.
"""
from __future__ import annotations

from collections import Counter
from math import gcd

Mono = tuple[int, tuple[str, ...]]
Poly = tuple[Mono, ...]  # terms, canonical: sorted by symbols, no zero coefficient, symbols unique

SUM = "onnxfuse.sum("
_MAX_TERMS = 16  # shape arithmetic is short; a longer sum is not worth describing
_sums: dict[str, Poly] = {}  # sum symbol -> its terms (content 1, first coefficient positive)


def is_sum(symbol: str) -> bool:
    return symbol in _sums


def _order(m: Mono):
    return (-len(m[1]), m[1])


def _normal(terms) -> Poly | None:
    acc: dict[tuple[str, ...], int] = {}
    for c, s in terms:
        acc[s] = acc.get(s, 0) + c
    out = tuple(sorted(((c, s) for s, c in acc.items() if c), key=_order))
    return None if len(out) > _MAX_TERMS else out


def _text(m: Mono) -> str:
    c, s = m
    names = " * ".join(f"({x})" if x in _sums else x for x in s)
    if not s:
        return str(abs(c))
    return names if abs(c) == 1 else f"{abs(c)} * {names}"


def _symbol(p: Poly) -> str:
    text = _text(p[0]) + "".join((" - " if c < 0 else " + ") + _text((c, s)) for c, s in p[1:])
    name = f"{SUM}{'-' if p[0][0] < 0 else ''}{text})"
    _sums.setdefault(name, p)
    return name


def expand(m: Mono | None) -> Poly | None:
    """The terms of a monomial whose symbols may be sums (each replaced by its terms)."""
    if m is None:
        return None
    out: Poly = ((m[0], ()),) if m[0] else ()
    for s in m[1]:
        p = _sums.get(s, ((1, (s,)),))
        out = _normal(((a * b, tuple(sorted(x + y))) for a, x in out for b, y in p))
        if out is None:
            return None
    return out


def collect(p: Poly | None) -> Mono | None:
    """A sum as a monomial: 0, its one term, or its content times its sum symbol."""
    if p is None:
        return None
    if not p:
        return (0, ())
    if len(p) == 1:
        return p[0]
    g = 0
    for c, _ in p:
        g = gcd(g, c)
    if p[0][0] < 0:
        g = -g
    return (g, (_symbol(tuple((c // g, s) for c, s in p)),))


def add(a: Mono | None, b: Mono | None, sign: int = 1) -> Mono | None:
    pa, pb = expand(a), expand(b)
    if pa is None or pb is None:
        return None
    return collect(_normal(list(pa) + [(sign * c, s) for c, s in pb]))


def mul(a: Mono | None, b: Mono | None) -> Mono | None:
    pa, pb = expand(a), expand(b)
    if pa is None or pb is None:
        return None
    return collect(_normal((x * y, tuple(sorted(s + t))) for x, s in pa for y, t in pb))


def has_sum(m: Mono | None) -> bool:
    return m is not None and any(s in _sums for s in m[1])


def divide(a: Mono | None, b: Mono | None) -> Mono | None:
    """a / b where the division is exact for every value of the symbols (one of them a sum), else
    None: division of polynomials by the leading term (terms ordered by degree, then symbols),
    which leaves no remainder exactly when b divides a."""
    pa, pb = expand(a), expand(b)
    if not pa or not pb:
        return (0, ()) if pa == () and pb else None
    lead_c, lead_s = pb[0]
    rest, quotient = list(pa), []
    for _ in range(4 * _MAX_TERMS):
        if not rest:
            return collect(_normal(quotient))
        c, s = rest[0]
        num, den = Counter(s), Counter(lead_s)
        if c % lead_c or any(num[x] < n for x, n in den.items()):
            return None
        q = (c // lead_c, tuple(sorted((num - den).elements())))
        quotient.append(q)
        rest = _normal(rest + [(-q[0] * d, tuple(sorted(q[1] + t))) for d, t in pb])
        if rest is None:
            return None
        rest = list(rest)
    return None


def nonnegative(m: Mono | None) -> bool:
    """Whether the value is >= 0 for every value of the dims (which are >= 0): every term's
    coefficient >= 0."""
    p = expand(m)
    return p is not None and all(c >= 0 for c, _ in p)


def never_equal(a: Mono | None, b: Mono | None) -> bool:
    """Whether a != b for every value of the dims (>= 0): a - b is a nonzero number, or every term
    of it has one sign and its number is nonzero with that sign."""
    pa, pb = expand(a), expand(b)
    if pa is None or pb is None:
        return False
    d = _normal(list(pa) + [(-c, s) for c, s in pb])
    if not d:
        return False
    const = next((c for c, s in d if not s), 0)
    return all(c > 0 for c, _ in d) and const > 0 or all(c < 0 for c, _ in d) and const < 0


def symbols(m: Mono | None) -> set[str]:
    """The dims a value is computed from (a sum's own, not its symbol)."""
    p = expand(m)
    return set() if p is None else {x for _, s in p for x in s}
