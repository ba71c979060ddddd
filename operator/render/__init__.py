"""A DLRMJob's children as plain dicts: pure functions of the spec and the plan."""
