"""Parameter counts of meshtrain's GPT and Llama decoders, whole and per rank.

A rank holds its pipeline stage split over the tensor-parallel group: the token embedding and the
head split along the vocabulary, the position table and the norms replicated (docs/planner.md,
"Parameters").
"""

from __future__ import annotations

from meshtrain.api import layout
from meshtrain.api.spec import model as api_model


def norm_params(shape: api_model.ModelShape) -> int:
    """Parameters of one norm: LayerNorm weight and bias (gpt), RMSNorm weight (llama)."""
    return shape.hidden if shape.family == "llama" else 2 * shape.hidden


def block_matrix_dims(shape: api_model.ModelShape) -> list[tuple[int, int]]:
    """(outputs, inputs) of one block's linears in registration order: QKV, attention proj, MLP in, MLP out.

    gpt: QKV 3h x h and a GELU MLP (f x h, h x f); llama: grouped-query QKV
    (h + 2 kv hd) x h and SwiGLU (gate and up fused, 2f x h, then h x f).
    """
    h, f = shape.hidden, shape.ffn_hidden
    if shape.family == "llama":
        kv = shape.key_value_heads * shape.head_dim
        return [(h + 2 * kv, h), (h, h), (2 * f, h), (h, f)]
    return [(3 * h, h), (h, h), (f, h), (h, f)]


def block_matrices(shape: api_model.ModelShape) -> list[int]:
    """Dense sizes of one block's matrices (:func:`block_matrix_dims`)."""
    return [rows * cols for rows, cols in block_matrix_dims(shape)]


def kv_heads_per_rank(shape: api_model.ModelShape, tensor: int) -> int:
    """Key/value heads a tensor rank holds: its share, or one (replicated) when there are fewer heads than ranks."""
    return max(shape.key_value_heads // tensor, 1)


def local_block_matrices(shape: api_model.ModelShape, tensor: int) -> list[int]:
    """:func:`block_matrices` on one tensor-parallel rank.

    Each is split over ``tensor`` ranks, except that a Llama QKV keeps one
    whole key/value head per rank when there are fewer than ``tensor``
    (the trainer replicates them, as vLLM does).
    """
    h, f = shape.hidden, shape.ffn_hidden
    if shape.family == "llama":
        kv = kv_heads_per_rank(shape, tensor) * shape.head_dim
        return [(h // tensor + 2 * kv) * h, h * h // tensor, 2 * f * h // tensor, f * h // tensor]
    return [n // tensor for n in block_matrices(shape)]


def layer_params(shape: api_model.ModelShape, tensor: int = 1) -> int:
    """Parameters of one block on one tensor-parallel rank.

    Two norms (replicated) plus the block's matrices (:func:`block_matrices`),
    split over ``tensor`` ranks (:func:`local_block_matrices`).
    """
    return 2 * norm_params(shape) + sum(local_block_matrices(shape, tensor))


def vocab_rows(shape: api_model.ModelShape, tensor: int) -> int:
    """Rows of the token table (and the head) on one tensor rank: the padded vocabulary's share."""
    return layout.padded_vocab(shape.vocab, tensor) // tensor


def embedding_params(shape: api_model.ModelShape, tensor: int = 1) -> int:
    """Token table (split along the vocabulary) plus the replicated position table (gpt only)."""
    positions = 0 if shape.family == "llama" else shape.seq_len * shape.hidden
    return vocab_rows(shape, tensor) * shape.hidden + positions


def head_params(shape: api_model.ModelShape, tensor: int = 1) -> int:
    """Final norm (replicated) plus the LM head (split along the vocabulary; none when tied to the embedding)."""
    head = 0 if shape.tie_embeddings else vocab_rows(shape, tensor) * shape.hidden
    return norm_params(shape) + head


def total_params(shape: api_model.ModelShape) -> int:
    """Parameters of the whole model: L blocks + embeddings + final norm and head."""
    return shape.layers * layer_params(shape) + embedding_params(shape) + head_params(shape)


def rank_params(shape: api_model.ModelShape, pipeline: int, tensor: int, stage: int) -> int:
    """Parameters held by one rank of pipeline ``stage`` (0-based): its layers' TP shard.

    Layers split evenly over stages (interleaving changes which layers a rank
    holds, not how many); the embeddings live on stage 0 and the final norm
    and head on the last stage.
    """
    if not 0 <= stage < pipeline:
        raise ValueError(f"stage {stage} outside 0..{pipeline - 1}")
    count = shape.layers // pipeline * layer_params(shape, tensor)
    if stage == 0:
        count += embedding_params(shape, tensor)
    if stage == pipeline - 1:
        count += head_params(shape, tensor)
        if shape.tie_embeddings and pipeline > 1:  # the last stage's copy of the tied matrix
            count += vocab_rows(shape, tensor) * shape.hidden
    return count


def rank_matrices(
    shape: api_model.ModelShape, pipeline: int, tensor: int, stage: int
) -> list[tuple[int, int]]:
    """(rows, columns) of the 2-D parameters one rank of ``stage`` holds (as :func:`rank_params` counts them)."""
    h = shape.hidden
    qkv, proj, fc, down = local_block_matrices(shape, tensor)
    out = shape.layers // pipeline * [(qkv // h, h), (h, proj // h), (fc // h, h), (h, down // h)]
    table = (vocab_rows(shape, tensor), h)
    if stage == 0:
        out += [table] + ([] if shape.family == "llama" else [(shape.seq_len, h)])
    if stage == pipeline - 1 and not (shape.tie_embeddings and pipeline == 1):
        out.append(table)
    return out
