from __future__ import annotations

from tests.checkpoint.conftest import prepared  # noqa: F401  (the default job's shards, as a fixture here too)
