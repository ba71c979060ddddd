"""The cost dataset: an append-only, versioned, crash-safe store of measured costs, its
manifest and its records.
"""
