"""One replica group of an HSDP job: FSDP2 inside the group, torchft's Manager across groups.

Import nothing heavy here: ``python -m trainer`` must be able to validate its settings and
launch torchrun before torch is imported.
"""
