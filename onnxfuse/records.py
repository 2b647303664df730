"""Result records (profiles, latencies, verification checks) as the plain dicts that JSON reports
and `--json` print."""
from __future__ import annotations


def attributes(record, names: str, **extra) -> dict:
    """{name: record.name} for the space-separated `names`, in that order, then `extra`."""
    return {**{name: getattr(record, name) for name in names.split()}, **extra}
