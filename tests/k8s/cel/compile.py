"""A rule compiled against its schema when the CRD is created, as far as the server's
errors go: a syntax error, a field the schema does not declare (``undefined field
'x'``, located as cel-go locates it), or an expression that is plainly not a bool.

Not emulated: CEL type checking beyond declared fields and the outermost operator (a
wrong overload compiles here), the wording of syntax errors (cel-python's, after
``Syntax error:``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import celpy

from k8s.cel.decls import root_view
from k8s.cel.syntax import MACROS, identifier, outer_select
from k8s.nodes import Schema, additional, items, props


def compile_problem(expr: str, s: Schema, root: bool) -> str | None:
    """``None`` when ``expr`` compiles against the schema, else cel-go's issue text (the
    syntax errors' wording is cel-python's)."""
    try:
        env = celpy.Environment()
        tree = env.compile(expr)
    except Exception as err:  # cel-python raises its own parser errors
        lines = str(err).splitlines()
        col = max(0, len(lines[1]) - 1) if len(lines) > 1 else 0
        return f"ERROR: <input>:1:{col + 1}: Syntax error: {lines[0] if lines else err}"
    self_schema = root_view(s) if root else s
    for name, column in _undefined_fields(tree, {"self": self_schema}):
        line = expr.splitlines()[0] if expr else ""
        return (
            f"ERROR: <input>:1:{column + 1}: undefined field '{name}'\n | {line}\n | "
            + "." * column
            + "^"
        )
    if _result_kind(tree, {"self": self_schema}) == "other":
        return "!bool"
    return None


_BOOL_METHODS = ("all", "exists", "exists_one", "matches", "startsWith", "endsWith", "contains")
_OTHER_METHODS = ("map", "filter", "size", "lowerAscii", "upperAscii", "trim", "split", "join")
_OTHER_CALLS = ("size", "int", "uint", "double", "string", "bytes", "duration", "timestamp")


def _result_kind(tree: Any, scope: dict[str, Schema | None]) -> str | None:
    """``"bool"``, ``"other"`` or ``None`` (unknown): what an expression evaluates to, as
    far as its outermost operator (or a declared field's type) tells."""
    node = tree
    while True:
        kids = [c for c in getattr(node, "children", []) if hasattr(c, "children")]
        data = getattr(node, "data", "")
        if data in ("conditionalor", "conditionaland") and len(node.children) > 1:
            return "bool"
        if data == "relation" and len(node.children) > 1:
            return "bool"
        if data in ("addition", "multiplication") and len(node.children) > 1:
            return "other"
        if (
            data == "unary"
            and node.children
            and getattr(node.children[0], "data", "") == "unary_not"
        ):
            return "bool"
        if (
            data == "unary"
            and node.children
            and getattr(node.children[0], "data", "") == "unary_neg"
        ):
            return "other"
        if data == "expr" and len(node.children) > 1:
            return None
        if len(node.children) == 1 and len(kids) == 1:
            node = kids[0]
            continue
        break
    data = getattr(node, "data", "")
    if data == "literal" and node.children:
        return "bool" if str(node.children[0]) in ("true", "false") else "other"
    if data == "member_dot_arg" and len(node.children) >= 2:
        method = str(node.children[1])
        return "bool" if method in _BOOL_METHODS else "other" if method in _OTHER_METHODS else None
    if data == "ident_arg" and node.children:
        name = str(node.children[0])
        return "bool" if name == "has" else "other" if name in _OTHER_CALLS else None
    if data in ("member_dot", "ident"):
        found = _resolve(node, scope)
        if found is None or found.get("x-kubernetes-int-or-string") or not found.get("type"):
            return None
        return "bool" if found.get("type") == "boolean" else "other"
    if data in ("list_lit", "map_lit"):
        return "other"
    return None


def _undefined_fields(tree: Any, scope: dict[str, Schema | None]) -> Iterator[tuple[str, int]]:
    """Field selections on ``self`` (and on a macro's variable bound to its items) that the
    schema does not declare, with cel-go's 0-based column: the selection's dot, or the
    ``(`` of ``has(...)`` for the selection it tests."""
    data = getattr(tree, "data", None)
    if data == "member_dot_arg" and len(tree.children) >= 3:
        target, method, args = tree.children[0], tree.children[1], tree.children[2]
        var = identifier(args.children[0]) if str(method) in MACROS and args.children else None
        if var:
            over = _resolve(target, scope)
            element = items(over) if (over or {}).get("type") == "array" else None
            yield from _undefined_fields(target, scope)
            for body in args.children[1:]:
                yield from _undefined_fields(body, {**scope, var: element})
            return
    if data == "ident_arg" and tree.children and str(tree.children[0]) == "has":
        arg = tree.children[1] if len(tree.children) > 1 else None
        select = outer_select(arg)
        if select is not None:
            base, name = select.children
            parent = _resolve(base, scope)
            if parent is not None and _declares_fields(parent) and str(name) not in props(parent):
                yield str(name), int(tree.meta.column) - 1 + len("has")
                return
            yield from _undefined_fields(base, scope)
            return
    if data == "member_dot":
        base, name = tree.children
        yield from _undefined_fields(base, scope)
        parent = _resolve(base, scope)
        if parent is not None and _declares_fields(parent) and str(name) not in props(parent):
            yield str(name), _dot_column(tree)
        return
    for sub in getattr(tree, "children", []):
        if hasattr(sub, "children"):
            yield from _undefined_fields(sub, scope)


def _declares_fields(s: Schema) -> bool:
    return (
        s.get("type") == "object"
        and not s.get("x-kubernetes-preserve-unknown-fields")
        and additional(s) is None
    )


def _resolve(tree: Any, scope: dict[str, Schema | None]) -> Schema | None:
    """The schema of a ``self.a.b`` chain, or ``None`` when it is not one."""
    node = tree
    while (
        hasattr(node, "children")
        and len(node.children) == 1
        and getattr(node, "data", "")
        in (
            "member",
            "primary",
            "expr",
            "conditionalor",
            "conditionaland",
            "relation",
            "addition",
            "multiplication",
            "unary",
        )
    ):
        node = node.children[0]
    data = getattr(node, "data", None)
    if data == "ident":
        return scope.get(str(node.children[0]))
    if data == "member_dot":
        parent = _resolve(node.children[0], scope)
        if parent is None:
            return None
        name = str(node.children[1])
        if props(parent):
            return props(parent).get(name)
        return additional(parent)
    return None


def _dot_column(node: Any) -> int:
    token = node.children[1]
    column = getattr(token, "column", None)
    if column is None:
        return max(0, int(getattr(getattr(node, "meta", None), "column", 1)) - 1)
    return max(0, int(column) - 2)
