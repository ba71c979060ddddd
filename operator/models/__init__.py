"""What a plan is made from: its inputs (whose hash names the plan), the published cost
models, the plans profiling pods refined by measurement, and a job's tables.

Imports only :mod:`shardwise.operator.cluster` among the rooms.
"""
