"""A thin wrapper around torchft's Lighthouse: restart on death, JSON status, health, metrics.

Stands alone: imports torchft's command-line Lighthouse and nothing of the service.
"""
