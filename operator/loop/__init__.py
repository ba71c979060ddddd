"""One job's reconcile loop, the part that touches the world: observe, decide, apply, plan
in a process, write status.

The last room: it may import every other one.
"""
