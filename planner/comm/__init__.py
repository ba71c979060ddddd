"""How a plan's embedding all-to-all is costed (docs/comm.md): the model's interface and
analytic forms, their fit to measurements, and the choice among them.
"""
