"""The optimizer: AdamW, the learning-rate schedule, clipping, and learning rates across batch changes."""
