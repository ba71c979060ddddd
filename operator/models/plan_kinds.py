"""How a plan cuts its tables, as status, Events and metrics say it.

A plan of only table-wise tables needs no words about kinds. Once a table is cut
otherwise (column-wise, row-wise over ranks, row-wise within a host, a grid, or a copy
on every rank), a user asks which tables and why a rank holds a slice of every big
table: :func:`kind_fields` counts the tables per kind and names those placed row-wise,
table-row-wise, grid or data-parallel (a bounded list per kind, with how many more), for
the plan ConfigMap's summary annotation and ``status.plan``; :func:`describe_kinds`
says it in one phrase for the ``Planned`` condition and its Event.

The summary is read back from an annotation anyone could edit, so the readers
(:func:`status_kinds`) keep only what the CRD's schema allows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardwise.planner.kinds import KINDS
from shardwise.planner.plan import Plan

#: Kinds whose tables status names (column-wise is only counted: it is the old, common
#: way to spread a wide table, and its shards are whole columns of every row).
NAMED_KINDS = ("row_wise", "table_row_wise", "grid", "data_parallel")
#: At most this many table names per kind in status and messages.
MAX_NAMES = 10


def kind_fields(plan: Plan) -> dict[str, Any]:
    """``kinds`` (tables per kind) and ``tablesByKind`` (the named kinds' tables, at
    most :data:`MAX_NAMES` each, and how many more), or nothing when every table is
    table-wise."""
    counts = plan.kinds()
    if set(counts) <= {"table_wise"}:
        return {}
    out: dict[str, Any] = {"kinds": {k: counts[k] for k in KINDS if k in counts}}
    named: dict[str, Any] = {}
    for kind in NAMED_KINDS:
        tables = [t.name for t in plan.tables if t.kind == kind]
        if tables:
            named[kind] = {"tables": tables[:MAX_NAMES], "more": max(0, len(tables) - MAX_NAMES)}
    if named:
        out["tablesByKind"] = named
    return out


def status_kinds(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The summary's kind fields as ``status.plan`` may hold them (anything else in an
    edited annotation is dropped rather than refused by the API server)."""
    out: dict[str, Any] = {}
    counts = summary.get("kinds")
    if isinstance(counts, Mapping):
        kept = {
            k: int(v)
            for k, v in counts.items()
            if k in KINDS and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        }
        if kept:
            out["kinds"] = kept
    named = summary.get("tablesByKind")
    if isinstance(named, Mapping):
        by_kind: dict[str, Any] = {}
        for kind in NAMED_KINDS:
            entry = named.get(kind)
            if not isinstance(entry, Mapping) or not isinstance(entry.get("tables"), list):
                continue
            tables = [str(t) for t in entry["tables"][:MAX_NAMES]]
            more = entry.get("more", 0)
            more = more if isinstance(more, int) and not isinstance(more, bool) else 0
            by_kind[kind] = {"tables": tables, "more": max(0, more)}
        if by_kind:
            out["tablesByKind"] = by_kind
    return out


def describe_kinds(summary: Mapping[str, Any]) -> str:
    """``"1 row-wise (big_ids), 2 data-parallel (a, b), 97 table-wise"``; ``""`` when
    every table is table-wise (or the summary says nothing of kinds)."""
    fields = status_kinds(summary)
    counts = fields.get("kinds") or {}
    named = fields.get("tablesByKind") or {}
    parts = []
    for kind, n in sorted(counts.items(), key=lambda kv: (kv[0] == "table_wise", -kv[1])):
        words = f"{n} {kind.replace('_', '-')}"
        entry = named.get(kind)
        if entry:
            more = f" and {entry['more']} more" if entry["more"] else ""
            words += f" ({', '.join(entry['tables'])}{more})"
        parts.append(words)
    return ", ".join(parts)
