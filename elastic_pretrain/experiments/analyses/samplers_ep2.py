"""samplers-ep2: the samplers that do not idle under expert parallelism, at 2 processes (issue 19 item 4).

The ``samplers`` analysis (:mod:`.samplers`) on the ``samplers-ep2`` job set: 2 gloo processes,
data-parallel 2 and expert-parallel 2 (``parallel: cpu-ep2``, one EP group spanning both replicas), equal
tokens, paired seeds, ELR's 15% one-loop override in every arm:

* ``independent-rank`` (ELR: each replica draws its own ℓ; the EP group runs ghost passes);
* ``deep-first`` (``order: deep_first``: ELR's draws, each replica's micro-batches deepest first — the same
  gradient up to rounding, fewer ghost passes);
* ``expert-group`` (``depth_group: expert_group``: one ℓ per micro-batch and EP group — here both
  replicas agree, so ℓ mixes across micro-batches only, never across replicas).
"""

from __future__ import annotations

import dataclasses

from elastic_pretrain.experiments.analyses.samplers import DEPTH_PAYS, matches
from elastic_pretrain.experiments.analyses.samplers import EXPERIMENT as DP2

EXPERIMENT = dataclasses.replace(
    DP2,
    name="samplers-ep2",
    title="Depth samplers at 2 processes (EP 2): independent-rank (ELR) vs EP-group ordering vs one ℓ per EP group",
    question="At equal tokens, paired seeds and the same depth distribution per token, does EP-group ordering "
    "(`order: deep_first`) or drawing ℓ per EP group (`depth_group: expert_group`) change the held-out loss at "
    "ℓ = 1 and ℓ = L_max against ELR's independent-rank draws, and what do they do to depth efficiency and wall "
    "time per token? 2 processes each: data-parallel 2, expert-parallel 2. Every claim presupposes that depth pays "
    "here (its own row).",
    claims=(
        DEPTH_PAYS,  # the premise of every row below (issue 32)
        *(
            matches(arm, m, ell)
            for arm in ("expert-group", "deep-first")
            for m, ell in (("loss@1", "1"), ("loss@max", "L_max"))
        ),
    ),
)
