"""The optimizer: AdamW, the learning-rate schedule, and learning rates across batch changes."""
