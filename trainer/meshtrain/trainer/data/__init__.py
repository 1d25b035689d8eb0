"""Training data: token files, the deterministic batches drawn from them, and tokenising text."""
