"""The algorithm, in plain PyTorch: inner and outer optimisation, the outer side, codecs,
Streaming DiLoCo, the asynchronous rules and policy. Imports nothing of diloco but errors and
settings (docs/architecture.md)."""
