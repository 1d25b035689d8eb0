"""In-place recovery: the per-pod supervisor's helpers and the worker's generation loop (docs/recovery.md)."""
