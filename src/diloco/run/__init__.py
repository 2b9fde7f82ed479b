"""Runs: the one assembler of a run, the training loop, the server worker and replay
(docs/architecture.md)."""
