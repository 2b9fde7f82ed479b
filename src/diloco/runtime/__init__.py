"""Runtimes move tensors and time; the algorithm lives in the core modules."""
