"""Requests for ``/api/v1/namespaces[/NAME[/status|/finalize]]``: kmock parses that path
as a namespace *scope* (and fails on the bare list), so they are parsed here, as
requests for the namespaces resource; everything else is parsed by kmock."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import kmock
from kmock import resource as kresource

_NAMESPACE_PATH = re.compile(r"/api/v1/namespaces(?:/([^/]+)(?:/(status|finalize))?)?/?")


def _guess_action(method: str, named: bool, query: Mapping[str, str]) -> Any:
    if method == "GET" and query.get("watch") in ("true", "1"):
        return kmock.action.WATCH
    table = {
        ("GET", False): kmock.action.LIST,
        ("POST", False): kmock.action.CREATE,
        ("GET", True): kmock.action.FETCH,
        ("PATCH", True): kmock.action.UPDATE,
        ("DELETE", True): kmock.action.DELETE,
    }
    return table.get((method, named))


async def namespace_request(raw_request: Any, request_id: int) -> kmock.Request | None:
    """The request for the namespaces resource that ``raw_request`` is, or ``None`` when
    its path is not a namespaces path (kmock parses it)."""
    m = _NAMESPACE_PATH.fullmatch(raw_request.path)
    if m is None:
        return None
    body = await raw_request.read()
    try:
        data = json.loads(body) if body else None
    except ValueError:
        data = None
    query = dict(raw_request.query)
    name, sub = m.group(1), m.group(2)
    method = raw_request.method.upper()
    action = _guess_action(method, name is not None, query)
    return kmock.Request(
        id=request_id,
        raw_request=raw_request,
        method=method,
        url=raw_request.url,
        params=query,
        headers=dict(raw_request.headers),
        body=body,
        text=body.decode(errors="replace"),
        data=data,
        action=action,
        resource=kresource("", "v1", "namespaces"),
        namespace=None,
        name=name,
        subresource=sub,
    )
