"""Tables, plans and planners: everything needed to place embedding tables.

The planner imports none of :mod:`shardwise.profiler`, :mod:`shardwise.runtime` and
:mod:`shardwise.operator`; all of them build on it.
"""
