"""cel-go's static cost estimator (its maximum only), ported over cel-python's parse tree,
and the server's budgets: a CRD is refused when a rule's estimated cost, times how often
it can run in one object, is over the per-rule budget, or all rules together are over
the schema's.

Not emulated: the cost of CEL functions other than the standard library, the string,
regex and list extensions.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import celpy

from k8s.cel.decls import MAX_REQUEST_BYTES, Decl, decl
from k8s.cel.syntax import MACROS, identifier, outer_select
from k8s.nodes import Schema

#: Estimated-cost limits of one rule and of a whole schema.
RULE_COST_LIMIT = 10_000_000
SCHEMA_COST_LIMIT = 100_000_000
MAX_U64 = 2**64 - 1
_SCALARS = ("bool", "double", "int", "timestamp", "duration", "uint")


def _add(*xs: int) -> int:
    return min(sum(xs), MAX_U64)


def _mul(a: int, b: int) -> int:
    return min(a * b, MAX_U64)


def _factor(x: int, y: float) -> int:
    """cel-go's ``multiplyByCostFactor``: ``ceil(x * y)``, saturating."""
    if x > 0 and y > 0 and float(x) > MAX_U64 / y:
        return MAX_U64
    product = math.ceil(float(x) * y)
    return MAX_U64 if product >= 2.0**64 else int(product)


@dataclass
class _X:
    """An expression's estimated cost and what its size estimate is made from."""

    cost: int
    kind: str | None = None
    path: tuple[str, ...] = ()
    size: int | None = None  # computed: call results, literals
    var_size: int | None = None
    entry: int | None = None  # a list literal's largest element


_QUOTED = re.compile(r"^([rRbB]*)('''|\"\"\"|'|\")(.*)\2$", re.S)
_ESCAPE = re.compile(r"\\(x..|u....|U........|[0-7]{3}|.)")
_KINDS = {
    "size": "int",
    "int": "int",
    "uint": "uint",
    "double": "double",
    "string": "string",
    "bool": "bool",
    "duration": "duration",
    "timestamp": "timestamp",
    "type": "type",
    "join": "string",
}


class _Coster:
    """cel-go's static cost estimator (its maximum only) over cel-python's parse tree,
    with the server's size estimates from the schema."""

    def __init__(self, root: Decl) -> None:
        self.root = root
        self.vars: dict[str, list[_X]] = {}

    def decl_at(self, path: tuple[str, ...]) -> Decl | None:
        """The server's size estimator walks a path from ``self``, whatever its first
        step is called (so any identifier's size is the rule's own node's)."""
        if not path:
            return None
        node: Decl | None = self.root
        for name in path[1:]:
            if node is None:
                return None
            if name in ("@items", "@values"):
                node = node.elem
            elif name == "@keys":
                node = node.key
            else:
                node = node.fields.get(name)
        return node

    def size(self, x: _X) -> int:
        """cel-go's ``computeSize``: computed, else the schema's, else 1 for a scalar."""
        if x.size is not None:
            return x.size
        found = self.decl_at(x.path)
        if found is not None:
            return found.max_elements
        if x.kind in _SCALARS:
            return 1
        return x.var_size if x.var_size is not None else MAX_U64

    def ev(self, t: Any) -> _X:
        """The cost of one parse-tree node (each grammar rule as cel-go costs its AST)."""
        if not hasattr(t, "data"):
            return _X(0)
        data = str(t.data)
        kids = list(t.children)
        binary = len(kids) == 2
        if data == "expr" and len(kids) == 3:
            c, a, b = (self.ev(k) for k in kids)
            size = max(self.size(a), self.size(b))
            return _X(_add(c.cost, max(a.cost, b.cost)), a.kind or b.kind, size=size)
        if data in ("conditionalor", "conditionaland") and binary:
            return _X(_add(self.ev(kids[0]).cost, self.ev(kids[1]).cost), "bool")
        if data == "relation" and binary:
            return self.relation(str(kids[0].data), self.ev(kids[0].children[0]), self.ev(kids[1]))
        if data == "addition" and binary:
            return self.addition(self.ev(kids[0].children[0]), self.ev(kids[1]))
        if data == "multiplication" and binary:
            a, b = self.ev(kids[0].children[0]), self.ev(kids[1])
            return _X(_add(1, a.cost, b.cost), a.kind or b.kind)
        if data == "unary" and binary:
            x = self.ev(kids[1])
            return _X(_add(1, x.cost), "bool" if str(kids[0].data) == "unary_not" else x.kind)
        handler = {
            "member_dot": self.select,
            "member_dot_arg": self.method,
            "member_index": self.index,
            "ident_arg": self.call,
            "list_lit": self.list_lit,
            "map_lit": self.map_lit,
        }.get(data)
        if handler is not None:
            return handler(kids)
        if data in ("ident", "dot_ident"):
            return self.ident(str(kids[0]))
        if data == "literal":
            return self.literal(str(kids[0]))
        if data == "member_object":
            inits = [k for k in (kids[1].children if len(kids) > 1 else []) if hasattr(k, "data")]
            return _X(_add(40, *(self.ev(k).cost for k in inits)))
        if len(kids) == 1:
            return self.ev(kids[0])
        return _X(_add(*(self.ev(k).cost for k in kids)))

    def select(self, kids: list[Any]) -> _X:
        o = self.ev(kids[0])
        extra = 1 if o.kind in ("object", "map", None) else 0
        path = (*o.path, str(kids[1])) if o.path else ()
        found = self.decl_at(path)
        return _X(_add(o.cost, extra), found.kind if found else None, path)

    def index(self, kids: list[Any]) -> _X:
        o, i = self.ev(kids[0]), self.ev(kids[1])
        path = (*o.path, "@items" if o.kind == "list" else "@values") if o.path else ()
        found = self.decl_at(path)
        return _X(_add(1, o.cost, i.cost), found.kind if found else None, path)

    def list_lit(self, kids: list[Any]) -> _X:
        elems = [self.ev(k) for k in (kids[0].children if kids else [])]
        entry = max((self.size(e) for e in elems), default=0)
        return _X(_add(10, *(e.cost for e in elems)), "list", size=len(elems), entry=entry)

    def map_lit(self, kids: list[Any]) -> _X:
        inits = kids[0].children if kids else []
        return _X(_add(30, *(self.ev(k).cost for k in inits)), "map", size=len(inits) // 2)

    def ident(self, name: str) -> _X:
        if self.vars.get(name):
            var = self.vars[name][-1]
            return _X(1, var.kind, var.path, var_size=var.var_size)
        return _X(1, self.root.kind if name == "self" else None, (name,))

    def literal(self, text: str) -> _X:
        if text in ("true", "false"):
            return _X(0, "bool", size=1)
        if text == "null":
            return _X(0, "null", size=1)
        quoted = _QUOTED.match(text)
        if quoted:
            body = quoted.group(3)
            if "r" not in quoted.group(1).lower():
                body = _ESCAPE.sub("_", body)
            return _X(0, "bytes" if "b" in quoted.group(1).lower() else "string", size=len(body))
        if text.endswith(("u", "U")):
            return _X(0, "uint", size=1)
        is_double = bool(re.search(r"[.eE]", text)) and not text.lower().startswith("0x")
        return _X(0, "double" if is_double else "int", size=1)

    def relation(self, op: str, a: _X, b: _X) -> _X:
        sized = op in ("relation_eq", "relation_ne") or (
            op in ("relation_lt", "relation_le", "relation_gt", "relation_ge")
            and bool({a.kind, b.kind} & {"string", "bytes"})
        )
        if sized:
            smallest = min(self.size(a), self.size(b))
            return _X(_add(_factor(smallest, 0.1), a.cost, b.cost), "bool")
        if op == "relation_in" and b.kind not in ("map", "object"):
            return _X(_add(self.size(b), a.cost, b.cost), "bool")
        return _X(_add(1, a.cost, b.cost), "bool")

    def addition(self, a: _X, b: _X) -> _X:
        if "string" in (a.kind, b.kind):
            total = _add(self.size(a), self.size(b))
            return _X(_add(_factor(total, 0.1), a.cost, b.cost), "string", size=total)
        if "list" in (a.kind, b.kind):
            total = _add(self.size(a), self.size(b))
            return _X(_add(1, a.cost, b.cost), "list", size=total)
        return _X(_add(1, a.cost, b.cost), a.kind or b.kind)

    def call(self, kids: list[Any]) -> _X:
        name = str(kids[0])
        arg_nodes = list(kids[1].children) if len(kids) > 1 else []
        if name == "has" and arg_nodes:
            inner = outer_select(arg_nodes[0])
            if inner is not None:  # a presence test costs its operand only
                return _X(self.ev(inner.children[0]).cost, "bool")
        args = [self.ev(a) for a in arg_nodes]
        costs = [a.cost for a in args]
        if name == "dyn" and args:
            return _X(_add(1, costs[0]), args[0].kind, args[0].path, args[0].size)
        if name == "matches" and len(args) == 2:
            return _X(_add(self.matches(args[0], args[1]), *costs), "bool")
        return _X(_add(1, *costs), _KINDS.get(name))

    def matches(self, target: _X, regex: _X) -> int:
        text = _factor(_add(self.size(target), 1), 0.1)
        return _mul(text, _factor(self.size(regex), 0.25))

    def method(self, kids: list[Any]) -> _X:
        name = str(kids[1])
        arg_nodes = list(kids[2].children) if len(kids) > 2 else []
        var = identifier(arg_nodes[0]) if name in MACROS and len(arg_nodes) >= 2 else None
        if var:
            return self.macro(name, kids[0], var, arg_nodes[1:])
        target = self.ev(kids[0])
        args = [self.ev(a) for a in arg_nodes]
        size = self.size(target)
        kind: str | None = _KINDS.get(name)
        out_size: int | None = None
        if name in ("matches", "find", "findAll") and args:
            cost, kind = self.matches(target, args[0]), "bool" if name == "matches" else None
        elif name == "contains" and args:
            cost, kind = _mul(_factor(size, 0.1), _factor(self.size(args[0]), 0.1)), "bool"
        elif name in ("startsWith", "endsWith") and args:
            cost, kind = _factor(self.size(args[0]), 0.1), "bool"
        elif name in ("lowerAscii", "upperAscii", "substring", "trim"):
            cost, kind, out_size = _factor(size, 0.1), "string", size
        elif name in ("replace", "split"):
            cost = _factor(size, 0.2)
        elif name in ("isSorted", "sum", "max", "min", "indexOf", "lastIndexOf"):
            cost = self.list_scan(target, size)
        else:
            cost = 1
        return _X(_add(target.cost, cost, *(a.cost for a in args)), kind, size=out_size)

    def list_scan(self, target: _X, size: int) -> int:
        found = self.decl_at(target.path)
        if target.kind != "list" and (found is None or found.kind != "list"):
            return _factor(size, 0.1)
        element = 1
        if found is not None and found.elem is not None and found.elem.kind in ("string", "bytes"):
            element = _add(1, _factor(found.elem.max_elements, 0.1))
        return _mul(size, element)

    def macro(self, name: str, target_node: Any, var: str, bodies: list[Any]) -> _X:
        """A comprehension: range + init + result + size x (loop condition + step)."""
        rng = self.ev(target_node)
        count = self.size(rng)
        step = "@keys" if rng.kind == "map" else "@items"
        path = (*rng.path, step) if rng.path else ()
        found = self.decl_at(path)
        self.vars.setdefault(var, []).append(
            _X(0, found.kind if found else None, path, var_size=rng.entry)
        )
        try:
            costs = [self.ev(b).cost for b in bodies]
        finally:
            self.vars[var].pop()
        body = costs[0] if costs else 0
        if name == "all":
            per, init, result = _add(3, body), 0, 1
        elif name == "exists":
            per, init, result = _add(4, body), 0, 1
        elif name == "exists_one":
            per, init, result = _add(2, body), 0, 2
        elif name == "filter":
            per, init, result = _add(body, 13), 10, 1
        elif len(costs) == 2:  # map(x, filter, transform)
            per, init, result = _add(costs[0], max(_add(12, costs[1]), 1)), 10, 1
        else:
            per, init, result = _add(12, body), 10, 1
        is_list = name in ("map", "filter")
        total = _add(rng.cost, init, result, _mul(count, per))
        return _X(total, "list" if is_list else "bool", size=count if is_list else None)


def rule_cost(expr: str, s: Schema, root: bool = False) -> int:
    """The server's estimated maximum cost of one evaluation of ``expr`` on node ``s``."""
    node = decl(s, root)
    if node is None:
        return 0
    try:
        tree = celpy.Environment().compile(expr)
    except Exception:  # a syntax error is reported on its own
        return 0
    return _Coster(node).ev(tree).cost


def max_cardinality(s: Schema, root: bool = False) -> int:
    """How often a rule on ``s`` can run under an unbounded list or map: as many times as
    its smallest JSON form (plus a comma) fits in a request."""
    node = decl(s, root)
    least = node.min_size if node is not None else 0
    return MAX_REQUEST_BYTES // (least + 1)


def cardinality_below(s: Schema, cardinality: int | None) -> int | None:
    """How often a child of ``s`` can occur in one object (``None``: unbounded), as the
    server's cost context tracks it: lists and maps multiply by their bounds."""
    if cardinality is None:
        return None
    t = s.get("type")
    if t == "array":
        return cardinality * int(s["maxItems"]) if "maxItems" in s else None
    if t == "object" and s.get("additionalProperties") is not None:
        return cardinality * int(s["maxProperties"]) if "maxProperties" in s else None
    return cardinality


def cost_message(what: str, cost: int, limit: int) -> str:
    factor = cost / limit
    if factor > 100:
        shown = "more than 100x"
    elif factor < 1.5:
        shown = f"{factor:f}x"
    else:
        shown = f"{factor:.1f}x"
    return (
        f"{what} exceeds budget by factor of {shown} (try simplifying the rule, or adding "
        "maxItems, maxProperties, and maxLength where arrays, maps, and strings are declared)"
    )
