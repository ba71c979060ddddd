"""The benchmark of every planner (``shardwise bench``, docs/bench.md): its spec, tasks,
models, measurement, results, statistics and report.
"""
