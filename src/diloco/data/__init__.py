"""A run's text: sources, tokenizer, token cache, shards and batches (docs/architecture.md)."""
