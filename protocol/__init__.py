"""Wire formats shared by the trainer, the agents and the control plane.

Nothing here imports torch: the control plane and the agents import this package and must
start in well under a second.
"""
