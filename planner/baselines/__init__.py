"""The planners Shardwise is judged against: random and greedy heuristics, TorchRec's
planner as shipped, and TorchRec's planner fed measured costs.
"""
