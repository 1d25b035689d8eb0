"""Named decoder shapes a TrainingJob can ask for with ``model.preset``: :data:`PRESETS`."""

from typing import Literal

PresetName = Literal[
    "tiny", "125m", "350m", "1.3b", "7b", "llama-tiny", "llama3.2-1b", "llama3-8b", "llama3-70b"
]

PresetValue = int | float | str | bool | dict[str, float | int]

PRESETS: dict[str, dict[str, PresetValue]] = {
    "tiny": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 64},
    "125m": {"layers": 12, "hidden": 768, "heads": 12, "vocab": 50304, "seq_len": 2048},
    "350m": {"layers": 24, "hidden": 1024, "heads": 16, "vocab": 50304, "seq_len": 2048},
    "1.3b": {"layers": 24, "hidden": 2048, "heads": 16, "vocab": 50304, "seq_len": 2048},
    "7b": {"layers": 32, "hidden": 4096, "heads": 32, "vocab": 50304, "seq_len": 4096},
    "llama-tiny": {
        "family": "llama",
        "layers": 4,
        "hidden": 64,
        "heads": 4,
        "kv_heads": 2,
        "vocab": 256,
        "seq_len": 64,
        "ffn_hidden": 192,
    },
    "llama3.2-1b": {
        "family": "llama",
        "layers": 16,
        "hidden": 2048,
        "heads": 32,
        "kv_heads": 8,
        "vocab": 128256,
        "seq_len": 8192,
        "ffn_hidden": 8192,
        "rope_theta": 500000.0,
        "tie_embeddings": True,
        "rope_scaling": {
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "llama3-8b": {
        "family": "llama",
        "layers": 32,
        "hidden": 4096,
        "heads": 32,
        "kv_heads": 8,
        "vocab": 128256,
        "seq_len": 8192,
        "ffn_hidden": 14336,
        "rope_theta": 500000.0,
    },
    "llama3-70b": {
        "family": "llama",
        "layers": 80,
        "hidden": 8192,
        "heads": 64,
        "kv_heads": 8,
        "vocab": 128256,
        "seq_len": 8192,
        "ffn_hidden": 28672,
        "rope_theta": 500000.0,
    },
}
"""Each preset's shape fields, and where they come from.

The GPT shapes follow the GPT-3 paper's table of model sizes (125M, 350M, 1.3B) and the common 7B
decoder shape; their vocabulary is GPT-2's 50257 padded to 50304 (a multiple of 128, so it splits
evenly over tensor-parallel ranks).  ``tiny`` uses byte-level tokens (vocab 256) and is sized for
CPU tests.  The ``llama*`` presets are Llama-family shapes (RoPE, RMSNorm, SwiGLU, grouped-query
attention): ``llama3-8b`` and ``llama3-70b`` follow Meta's published Llama 3 configurations
(128,256-token vocabulary, 8 key/value heads, RoPE base 500,000); ``llama3.2-1b`` follows Llama 3.2
1B (tied embeddings, Llama 3.1's RoPE scaling, trained here at its original 8,192 context), the
Llama shape that trains on one GPU; ``llama-tiny`` has ``tiny``'s width and depth for CPU tests
and side-by-side benchmarks.
"""
