"""Models: diloco's GPT, Hugging Face causal LMs and export (docs/architecture.md)."""
