"""What the watched objects say: small summaries of them (the kopf indexes keep these), why
pods have not started, nodes that are lost, and the capacity a job may use.

The first of the operator's rooms: it imports none of the others.
"""
