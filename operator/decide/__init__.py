"""The pure decision of one reconcile: from what is observed
(:class:`~shardwise.operator.decide.records.Observed`) to what should change
(:class:`~shardwise.operator.decide.records.Decision`), with its parts for profiling,
planning, workers, resharding and the live imbalance loop.

No I/O here: every function is called by the tests directly. Imports the rooms before it
(cluster, models, render), never :mod:`~shardwise.operator.loop`.
"""
