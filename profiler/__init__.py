"""Kernel benchmarks, cost datasets, cost-model pre-training and the plan evaluator.

Nothing lives here yet: the profiler lands with its own issue. It may import
:mod:`shardwise.planner` (tables, plans), never the other way round.
"""
