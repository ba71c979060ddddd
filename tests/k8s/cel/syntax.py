"""The shapes of cel-python's parse tree that the compiler's checks, the cost estimator
and the evaluator look for."""

from __future__ import annotations

from typing import Any

#: The comprehension macros: ``target.name(var, body...)``.
MACROS = ("all", "exists", "exists_one", "map", "filter")


def unwrap(tree: Any) -> Any:
    """An expression without the parser's single-child wrappers around it."""
    node = tree
    while (
        hasattr(node, "children")
        and len(node.children) == 1
        and hasattr(node.children[0], "children")
    ):
        node = node.children[0]
    return node


def outer_select(tree: Any) -> Any:
    """The ``a.b`` that ``has(...)``'s argument is, through the parser's wrappers."""
    node = unwrap(tree)
    return node if getattr(node, "data", None) == "member_dot" else None


def identifier(tree: Any) -> str | None:
    """The identifier an expression is made of, if it is one."""
    node = unwrap(tree)
    if getattr(node, "data", None) == "ident" and node.children:
        return str(node.children[0])
    return None
