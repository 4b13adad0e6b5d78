"""The service around the trainer: Lighthouse wrapper client, agents, control plane, CLI."""
