"""late-switch-depth-pays-long: ``late_switch_depth_pays.py`` (its arms, analysis and claims) trained twice as
long, 6,000 steps.

At 3,000 steps the premise row (mixed depth from scratch at ℓ = L_max below the one-loop baseline) did not
resolve, tied or untied: one mixed-depth seed per attention was still on the copying plateau when its learning
rate had decayed (untied seed 1238 at 0.44 nat against 0.27-0.32 for the others; tied seed 1236), so the row
measured when a seed leaves the plateau, not what four passes do that one cannot. Same corpus, shapes, seeds and
learning-rate schedule shape; twice the steps, as depth-premise-long did for depth-premise."""

from __future__ import annotations

import dataclasses

from elastic_pretrain.experiments.analyses.late_switch_depth_pays import EXPERIMENT as SHORT

EXPERIMENT = dataclasses.replace(
    SHORT,
    name="late-switch-depth-pays-long",
    title="ELR's 75% late switch on the depth-pays corpus, 6,000 steps: tied (as published) and untied (Foil×ELR)",
    question=SHORT.question.replace(
        "3,000 steps",
        "6,000 steps (twice late-switch-depth-pays', where one "
        "mixed-depth seed per attention was still on the copying plateau)",
    ),
)
