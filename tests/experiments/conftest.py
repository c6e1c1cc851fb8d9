"""Fixtures of the quick end-to-end experiment tests (helpers: tests/experiments/quick.py).

``decider_quick`` runs ``experiment decider`` and ``experiment decider-depths`` (``--quick --seeds 1``) in one
process and one runs folder, once per session: one interpreter start instead of two, and decider-depths' L_max
= 4 base is the decider set's late-switch job (same config), which the runner reuses instead of training again.
"""

from __future__ import annotations

import pytest

from tests.experiments.quick import QuickRun, quick_experiments, quick_workspace


@pytest.fixture(scope="session")
def decider_quick(tmp_path_factory: pytest.TempPathFactory) -> QuickRun:
    """The decider and decider-depths quick experiments (module docstring), run once per session."""
    root = quick_workspace(tmp_path_factory.mktemp("decider-quick"), "decider", "decider-depths")
    return quick_experiments(root, "decider", "decider-depths")
