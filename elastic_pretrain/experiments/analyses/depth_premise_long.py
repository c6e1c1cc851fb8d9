"""depth-premise-long: the bare looped core's premise (``depth_premise.py``) trained twice as long, 3,000 steps.

At 1,500 steps one of three ℓ = 4 seeds of the bare core was still on the copying plateau (answers at chance)
when its learning rate had decayed, so that comparison measured when a seed leaves the plateau, not what four
passes can do that one cannot. Same corpus, shape, seeds and learning-rate schedule shape; twice the steps."""

from __future__ import annotations

import dataclasses

from elastic_pretrain.experiments.analyses.depth_premise import BARE_ROWS
from elastic_pretrain.experiments.analyses.depth_premise import EXPERIMENT as SHORT

EXPERIMENT = dataclasses.replace(
    SHORT,
    name="depth-premise-long",
    title="Does depth pay? The bare looped core at ℓ = L_max vs ℓ = 1, 3,000 steps",
    question="depth-premise's bare-core pair (the looped core alone: ℓ = 1 is one layer, which cannot look "
    "anything up; ℓ = 4 is four) trained for 3,000 steps instead of 1,500 on the depth-pays corpus, same seeds: "
    "loss and next-token accuracy per ℓ and per true difficulty.",
    claims=BARE_ROWS,
)
