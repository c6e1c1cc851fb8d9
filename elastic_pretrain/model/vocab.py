"""The padded vocabulary: how many embedding/output rows the model builds for a tokenizer's ids.

Plain arithmetic, no torch: the CLI's config checks, parameter counts and FLOP counts use it too.
"""

from __future__ import annotations

# The padded vocabulary must not depend on the layout, or checkpoints could not move between TP
# sizes: pad to a fixed multiple that every supported TP size (1..128) divides.
VOCAB_DIVISIBLE_BY = 128


def padded_vocab_size(vocab: int, tp: int = 1) -> int:
    """The embedding/output rows the model builds for ``vocab`` ids (the same at every TP size).

    The rows beyond ``vocab`` are padding: the model gives them -inf logits (``LoopedMoEModel.logits``),
    so they take no probability mass and change no loss."""
    if VOCAB_DIVISIBLE_BY % tp:
        raise ValueError(f"tensor parallel size {tp} must divide {VOCAB_DIVISIBLE_BY}")
    return -(-vocab // VOCAB_DIVISIBLE_BY) * VOCAB_DIVISIBLE_BY
