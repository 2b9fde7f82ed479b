"""The `diloco` command: argument parsing and its verbs (docs/architecture.md)."""
