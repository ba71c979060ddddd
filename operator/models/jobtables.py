"""A DLRMJob's tables as the operator reads them: inline in the spec, or from the
ConfigMap ``spec.tables.configMapRef`` names (docs/operator.md). The planner plans
them, the profiling pod calibrates on them (the operator copies them into a ConfigMap
of its own, so the pod measures exactly what coverage was judged on) and their
signatures (``shardwise.planner.tables.table_signature``) say whether a published
cost model covers them. Nothing here imports torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardwise.basics import UserError
from shardwise.operator.context import OperatorContext, call
from shardwise.operator.crd import DLRMJobSpec, inline_tables
from shardwise.planner.tables import TableSpec, format_of, parse_tables, table_signature

#: The condition reasons of tables that cannot be read.
TABLES_NOT_FOUND = "TablesNotFound"
INVALID_TABLES = "InvalidTables"
TABLE_REASONS = frozenset({TABLES_NOT_FOUND, INVALID_TABLES})


@dataclass(frozen=True)
class JobTables:
    """The tables, with one signature per table; or, with ``problem``, why they could
    not be read (``reason`` is the condition's)."""

    specs: tuple[TableSpec, ...] = ()
    signatures: tuple[str, ...] = ()
    problem: str | None = None
    reason: str = ""
    #: Reads in a row that failed with ``reason`` (the retry backs off with it).
    attempts: int = 0

    @classmethod
    def of(cls, specs: list[TableSpec]) -> JobTables:
        return cls(tuple(specs), tuple(table_signature(t) for t in specs))

    @classmethod
    def unreadable(cls, reason: str, problem: str) -> JobTables:
        return cls(problem=problem, reason=reason)


async def read_tables(ctx: OperatorContext, namespace: str, spec: DLRMJobSpec) -> list[TableSpec]:
    """The job's tables; ``LookupError`` when the ConfigMap or its key is missing,
    :class:`UserError` when the file in it is invalid (both name the field)."""
    if spec.tables.inline is not None:
        return inline_tables(spec)
    ref = spec.tables.config_map_ref
    assert ref is not None
    cm = await call(ctx.kube.get, "v1", "configmaps", namespace, ref.name)
    where = f"spec.tables.configMapRef: ConfigMap {namespace}/{ref.name}"
    if cm is None:
        raise LookupError(f"{where} does not exist")
    text = (cm.get("data") or {}).get(ref.key)
    if text is None:
        raise LookupError(f"{where} has no key {ref.key!r}")
    return parse_tables(text, format_of(Path(ref.key)), f"{where} key {ref.key}")


async def job_tables(ctx: OperatorContext, namespace: str, spec: DLRMJobSpec) -> JobTables:
    """:func:`read_tables`, with a problem instead of an exception."""
    try:
        return JobTables.of(await read_tables(ctx, namespace, spec))
    except LookupError as err:
        return JobTables.unreadable(TABLES_NOT_FOUND, str(err))
    except UserError as err:
        return JobTables.unreadable(INVALID_TABLES, str(err))
