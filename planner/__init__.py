"""Tables, plans and planners: everything needed to place embedding tables.

The planner imports neither :mod:`shardwise.profiler` nor :mod:`shardwise.operator`;
both of them build on it.
"""
