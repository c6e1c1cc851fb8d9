"""Third-party noise the user cannot act on, filtered once for every command (``cli.main``).

megatron-core warns at import time that Transformer Engine / Apex are absent (the CPU path is
deliberate); torch's checkpoint planner warns that ShardedTensor — which megatron's
``dist_checkpointing`` uses on every load — is deprecated. A command's own output is what remains.
"""

from __future__ import annotations

import logging
import os
import warnings

_MESSAGES = (
    ".*Transformer Engine and Apex are not installed.*",
    ".*Apex is not installed.*",
    # megatron's optimizer probes .grad on shard views; torch warns on every such access
    ".*is not a leaf Tensor is being accessed.*",
    ".*full scope is deprecated.*",
)
# deprecations inside the libraries' own checkpoint code (ShardedTensor, load_state_dict)
_FUTURE_MODULES = ("torch.distributed", "megatron.core")


def third_party_warnings() -> None:
    """Ignore the warnings above in this process (call before importing megatron)."""
    for message in _MESSAGES:
        warnings.filterwarnings("ignore", message=message)
    for module in _FUTURE_MODULES:
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)


def quiet_logs() -> None:
    """Log lines for a training process: INFO from rank 0, WARNING from the others, megatron's WARNING only."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    third_party_warnings()
    # libraries' INFO lines the user cannot act on: numexpr's thread count, matplotlib's font cache
    for name in ("megatron", "megatron.core", "numexpr", "matplotlib"):
        logging.getLogger(name).setLevel(logging.WARNING)
