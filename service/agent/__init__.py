"""The replica-group agent: supervises one group's torchrun and forwards its events."""
