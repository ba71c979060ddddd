"""A DLRMJob's children as plain dicts: pure functions of the spec and the plan.

Imports :mod:`~shardwise.operator.cluster` and :mod:`~shardwise.operator.models` among
the rooms; :mod:`~shardwise.operator.decide` asks it for the objects it wants.
"""
