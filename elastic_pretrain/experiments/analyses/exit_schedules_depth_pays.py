"""exit-schedules-depth-pays: TLM's exit schedules (``exit_schedules.py``'s analysis and claims) on the depth-pays
corpus, where the answers need 1..6 lookups, so a shallow exit has something it cannot do and depth has something
to add. The same 8-layer stack, arms and exits as exit-schedules, trained on depth-premise-long's learning rate for
1,500 steps; without exit-schedules' ``fixed-depth`` reference (no claim reads it; CPU budget, docs/experiments.md)."""

from __future__ import annotations

import dataclasses

from elastic_pretrain.experiments.analyses.exit_schedules import EXPERIMENT as BYTES

EXPERIMENT = dataclasses.replace(
    BYTES,
    name="exit-schedules-depth-pays",
    title="Exit schedules on the depth-pays corpus: telescopic vs sparse exits at equal training FLOPs",
    question=(
        "exit-schedules' question on the depth-pays corpus: on a non-looped 8-layer stack with an exit after each "
        "layer, trained 1,500 steps on text whose answers need 1..6 lookups, does telescopic training give a lower "
        "area under the quality-budget curve than sparse exits after layers 2, 4 and 8 at equal training FLOPs, does "
        "it match them at full depth, and what does the density dial buy and cost? Every claim on the area "
        "presupposes the holes TLM fills: unsupervised exits far above full depth (its row)."
    ),
)
