"""The profiling pod's own steps (``python -m shardwise.operator.pod.<step>``): fetch the
base model, publish the calibrated model and the refined plans.
"""
