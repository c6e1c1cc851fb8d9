"""decider-depth-pays: TaH2's iteration deciders (``decider.py``'s analysis and claims) on the depth-pays corpus,
where extra passes pay and every answer token's true number of lookups is stored beside it.

The base is the bare looped core of depth-premise-long trained at mixed depth from scratch (``mixed``), so every
ℓ is a trained model a decider can stop at. Two claims beyond ``decider``'s: does each decider give more passes
to tokens that need more lookups (Spearman's ρ of passes with true difficulty over the answers)?"""

from __future__ import annotations

import dataclasses

from elastic_pretrain.experiments.analyses.decider import EXPERIMENT as DECIDER
from elastic_pretrain.experiments.analyses.decider import FROZEN, PER_TOKEN, TAH2, claims_for
from elastic_pretrain.experiments.stats import Claim

BASE = "mixed"
_CLAIMS = claims_for(BASE)
PREMISE = _CLAIMS[0]


def _tracks_difficulty(arm: str, what: str) -> Claim:
    return Claim(
        paper='the decider gives extra passes to the tokens that need them: "Extra compute goes where it moves the '
        'answer"; its labels say "whether one more iteration would improve the prediction for that token"',
        source=TAH2,
        magnitude="not given (TaH2 has no per-token ground truth)",
        measure=f"{what}: Spearman's ρ of each answer token's passes (threshold 0.5) with the number of lookups it "
        "needs (the corpus's stored difficulty)",
        value=lambda ms: ms[arm]["passes_rho_answers"],
        expect="positive",
        premise=PREMISE,
    )


EXPERIMENT = dataclasses.replace(
    DECIDER,
    name="decider-depth-pays",
    title="Adaptive depth on the depth-pays corpus: deciders vs fixed depth, and passes vs true difficulty",
    question="decider's three post-trainings (frozen backbone, joint per-token, the uniform-depth control) on the "
    "bare looped core trained at mixed depth on the depth-pays corpus, where ℓ = 4 beats ℓ = 1 "
    "(depth-premise-long): at the same mean passes, is adaptive depth better than fixed depth and random stopping, "
    "and do the deciders give more passes to the answers that need more lookups?",
    claims=(
        *_CLAIMS,
        _tracks_difficulty(FROZEN, "frozen decider"),
        _tracks_difficulty(PER_TOKEN, "joint per-token decider"),
    ),
)
