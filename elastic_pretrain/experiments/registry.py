"""The registered experiments: each an analysis of the trained runs of ``jobs/experiments/<name>/``.

An analysis (one file under ``experiments/analyses/``) receives a
:class:`~elastic_pretrain.experiments.runner.Context` of one seed's runs (one per arm, in job-file order;
their final checkpoints as models; held-out tokens) and returns :class:`~.runner.Findings`: tables, a
plot, the raw numbers, a reading generated *from* the numbers and scalar metrics per arm; its module's
``EXPERIMENT`` names the paper claims those metrics decide (``stats.Claim``). The report
(``report.py``) runs it for every seed and decides the claims over the seeds.

To add an experiment: a job set under ``jobs/experiments/<name>/``, a module ``analyses/<name>.py``
defining ``EXPERIMENT``, and one line in :data:`ANALYSES`.
"""

from __future__ import annotations

import importlib

from elastic_pretrain.experiments.runner import Experiment

ANALYSES = (  # modules of elastic_pretrain.experiments.analyses, in the order `--list` and `all` use
    "depth_premise",
    "depth_premise_long",
    "exit_schedules",
    "exit_schedules_depth_pays",
    "late_switch",
    "late_switch_depth_pays",
    "late_switch_depth_pays_long",
    "flattening",
    "route_replay",
    "kv_cache",
    "kv_cache_depth_pays",
    "seed_noise",
    "decider",
    "decider_depth_pays",
    "decider_depths",
    "samplers",
    "samplers_ep2",
)


def _load(module: str) -> Experiment:
    experiment = importlib.import_module(f"elastic_pretrain.experiments.analyses.{module}").EXPERIMENT
    if not isinstance(experiment, Experiment):
        raise TypeError(f"analyses/{module}.py: EXPERIMENT must be an Experiment")
    return experiment


EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in map(_load, ANALYSES)}
