"""Documents of the ``elastic_tiny_mc`` lm-eval task: the JSON lines beside this file (no network)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATA = Path(__file__).with_suffix(".jsonl")


def docs() -> list[dict[str, Any]]:
    return [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


def load(**_: Any) -> Any:
    """lm-eval's ``custom_dataset`` hook: a ``DatasetDict`` with one ``test`` split."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs())})
