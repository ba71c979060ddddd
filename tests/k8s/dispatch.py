"""Which of kmock's reactions serves a request, in time that does not grow with the
requests served so far.

kmock decides whether a reaction sees a request with ``request in reaction._source``:
it walks every request the server has recorded through the reaction's filters, to
find the one it holds. The emulator's defaults are such reactions, so each request
cost O(requests so far): a long test's 1,000th request took ~95 ms of CPU, the 20th
3 ms. For the views the emulator and the tests build (the root, filters on it, and
priorities), a request is in the view exactly when it passes each filter on its way to
the root, which is checked on the one request. Any other view (slices, groups,
exclusions, streams) is asked the old way, so the answer is kmock's in every case.
"""

from __future__ import annotations

from typing import Any

from kmock._internal import dsl, rendering  # kmock exports no names for these


def sees(view: Any, request: Any, root: Any) -> bool:
    """Whether ``request`` is among the requests ``view`` holds."""
    found = _walk(view, request, root)
    return (request in view) if found is None else found


def _walk(view: Any, request: Any, root: Any) -> bool | None:
    """Checked on the one request, or None where only kmock's own walk can tell."""
    if view is root:
        return True  # every request the emulator serves is recorded on it first
    kind = type(view)
    if kind is dsl.Priority:
        return _walk(view._source, request, root)
    if kind is dsl.Filter:
        upstream = _walk(view._source, request, root)
        # the source first: a callable criterion sees only what reached it, as in kmock
        return upstream if not upstream else bool(view.criteria(request))
    return None


async def serve(root: Any, request: Any) -> Any:
    """kmock's dispatch (the highest priority first; a reaction that mismatches or is
    spent is disabled, one that declines passes), with :func:`sees` for membership."""
    payloads = list(root._payloads)
    depth = max((len(p.priorities) for p in payloads), default=0)
    order = sorted(
        range(len(payloads)),
        key=lambda i: (
            tuple(-p for p in payloads[i].priorities) + (0,) * (depth - len(payloads[i].priorities))
        ),
    )
    for payload in (payloads[i] for i in order):
        if not sees(payload._source, request, root) or payload._disabled.is_set():
            continue
        try:
            return await payload(request)
        except rendering.ReactionMismatchError:
            payload._disabled.set()
        except NotImplementedError:
            pass
    raise NotImplementedError(
        "no reaction matches the request (the emulator's defaults cover every verb)"
    )
