"""Measuring what embedding work costs, and learning from it: the fused-kernel and
all-to-all benchmarks, table augmentation, the resumable cost datasets, cost-model
pre-training, the plan evaluator and the benchmark of every planner.

It may import :mod:`shardwise.planner` (tables, plans, cost-model inference), never
the operator or the runtime (docs/design.md §2).
"""
