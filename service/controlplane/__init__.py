"""The control plane: REST API, SQLite history, group state machines, drills."""
