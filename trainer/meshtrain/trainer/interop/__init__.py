"""Hugging Face interop: weights to and from ``config.json`` + safetensors directories."""
