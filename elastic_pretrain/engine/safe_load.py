"""Loading a DeepSpeed-engine checkpoint never unpickles arbitrary objects (docs/security.md).

DeepSpeed writes its checkpoints with ``torch.save`` and its own loader (``TorchCheckpointEngine.load``)
reads them back with full unpickling switched on: a crafted ``*_model_states.pt`` would run code on every
rank that resumes from it. :func:`load_checkpoint_safely` runs DeepSpeed's ``load_checkpoint`` with
``torch.load`` forced to ``weights_only=True`` and an allowlist of the exact ``(module, name)`` pairs a
DeepSpeed 0.19.8 ZeRO checkpoint of this project holds (its config enums and loss-scaler record, found by
``tests/engine/test_deepspeed_checkpoint.py``, which fails when a new one appears); anything else is
refused with one line naming the file.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from elastic_pretrain.errors import UserError

if TYPE_CHECKING:  # annotations only: DeepSpeed is imported by a deepspeed job only
    from deepspeed.runtime.engine import DeepSpeedEngine


def allowed_globals() -> list[Any]:
    """The classes a DeepSpeed checkpoint may construct (plain records and enums; no side effects)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Within this block every ``torch.load`` is ``weights_only=True`` with :func:`allowed_globals`."""
    original = torch.load
    allowed = allowed_globals()

    @functools.wraps(original)
    def guarded(f: Any, map_location: Any = None, *args: Any, weights_only: Any = None, **kwargs: Any) -> Any:
        with torch.serialization.safe_globals(allowed):
            return original(f, map_location, *args, weights_only=True, **kwargs)

    torch.load = guarded  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.load = original  # type: ignore[assignment]


def load_checkpoint_safely(engine: DeepSpeedEngine, path: Path) -> None:
    """``engine.load_checkpoint`` of ``path`` (``step_<N>/model_optim``), weights-only; one UserError on failure."""
    try:
        with weights_only_loads():
            loaded, _ = engine.load_checkpoint(
                str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=False
            )
    except Exception as err:  # a refused global, a truncated file, a missing rank's file, ...
        text = str(err).strip().splitlines()
        raise UserError(
            f"{path}: cannot load the DeepSpeed checkpoint ({type(err).__name__}: {text[0] if text else ''}); "
            "it is damaged or not one of ours: use another checkpoint"
        ) from err
    if loaded is None:
        raise UserError(f"{path}: DeepSpeed found no checkpoint there: use another checkpoint")
