"""kv-cache-depth-pays: ``kv_cache.py``'s analysis and claims on the elastic model of the depth-pays corpus, where
more passes lower the loss, so the last-loop cache's cost is a share of something.

Two arms: ``mixed`` (decider-depth-pays's base, shared run: the bare looped core at mixed depth from scratch) and
``mixed-kvtrained`` (the same job with ``model.kv_training: last_loop``). Not ELR's late switch: ELR's one-loop
phase would leave three of four untied attention blocks untrained for 75% of the run on this corpus (issue 32)."""

from __future__ import annotations

import dataclasses
import functools

from elastic_pretrain.experiments.analyses.kv_cache import EXPERIMENT as KV_CACHE
from elastic_pretrain.experiments.analyses.kv_cache import analyse, claims_for

ELASTIC, TRAINED = "mixed", "mixed-kvtrained"
ARMS = (ELASTIC, TRAINED)

EXPERIMENT = dataclasses.replace(
    KV_CACHE,
    name="kv-cache-depth-pays",
    title="Last-loop vs per-loop KV cache on the depth-pays corpus's elastic model, with and without the trained mode",
    question="On the bare looped core trained at mixed depth on the depth-pays corpus (where ℓ = 4 beats ℓ = 1): "
    "how much held-out loss does caching only the last pass's keys/values cost, token by token and after a "
    "parallel prefill, does training for the cache (`model.kv_training: last_loop`) shrink that cost, and does it "
    "cost per-loop serving?",
    analyse=functools.partial(analyse, late=ELASTIC, trained=TRAINED),
    claims=claims_for(ARMS, late=ELASTIC, trained=TRAINED),
)
