"""Re-planning a running job from what its workers measure: the live summary they report
and the re-plan made from it.
"""
