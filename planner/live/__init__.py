"""Re-planning a running job from what its workers measure: the live summary they report
(:mod:`.summary`), read and checked (:mod:`.inputs`), every shard priced from it
(:mod:`.prices`), and the re-plan (:mod:`.replan`).
"""
