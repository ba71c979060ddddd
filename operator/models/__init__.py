"""What the operator reads that someone else wrote: the published cost models, the plans
profiling pods refined by measurement, and a job's tables.
"""
