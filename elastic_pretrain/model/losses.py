"""Losses of the model's outputs on one process.

Shape legend: B batch, T sequence, V vocabulary.

Training and evaluation take the model's own loss (``LoopedMoEModel.forward`` with ``labels``:
megatron's vocab-parallel cross-entropy over the padded vocabulary, whose padding logits are -inf, so
it is the cross-entropy over the real vocabulary). :func:`token_ce` is the same cross-entropy on
gathered full-vocabulary logits (``forward`` without ``labels``, the decoders of ``model/inference.py``).
The decider's loss is in ``model/decider.py``.
"""

from __future__ import annotations

import torch


def token_ce(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy ``[B, T]`` over the real vocabulary, in fp32."""
    ce = torch.nn.functional.cross_entropy(logits_BTV.float().flatten(0, 1), labels_BT.flatten(), reduction="none")
    return ce.view_as(labels_BT)
