"""Reading a DeepSpeed-engine checkpoint's model weights (weights-only, engine/safe_load.py): what ``load_model``
(engine/restore.py) and :mod:`elastic_pretrain.engine.convert` share. Low in the layers: imports no command module."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from elastic_pretrain.checkpoint.store import MODEL_DIR
from elastic_pretrain.errors import UserError
from elastic_pretrain.internals import require


def import_deepspeed() -> Any:
    """``deepspeed``, on its CPU accelerator (gloo) when there is no CUDA; one line naming the install if absent.

    On CPU, DeepSpeed's communication backend would JIT-build its shared-memory all-reduce op
    (``deepspeed_shm_comm``: ninja and the C++ compiler, 70-100 s on a 2-core machine, again for every new
    virtual environment) when the first engine starts. That op serves only ``inference_all_reduce`` (DeepSpeed's
    inference tensor parallelism), which training never calls: training's collectives are torch.distributed's
    on gloo. So it is marked incompatible here, and DeepSpeed's backend starts without it."""
    cpu = not torch.cuda.is_available()
    if cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read once, at DeepSpeed's first import
    try:
        import deepspeed
    except ImportError as err:
        raise UserError(
            f"engine=deepspeed needs DeepSpeed ({err}): pip install -c requirements/constraints-cpu.txt "
            "'elastic-pretrain[deepspeed]' (scripts/setup.sh installs it), or set engine=megatron"
        ) from None
    if cpu:
        deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False  # read by deepspeed.comm.torch.build_shm_op
    require("deepspeed")  # a private name the engine uses, gone in this version: one line
    return deepspeed


SHM_COMM_OP = "deepspeed_shm_comm"


def deepspeed_weights(step: Path) -> dict[str, torch.Tensor]:
    """The full fp32 model state dict of a DeepSpeed-engine ``step_<N>`` (ZeRO 1/2/3), weights-only."""
    from elastic_pretrain.engine.safe_load import weights_only_loads

    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        with weights_only_loads():
            state = get_fp32_state_dict_from_zero_checkpoint(str(step), tag=MODEL_DIR)
    except Exception as err:
        raise UserError(
            f"{step / MODEL_DIR}: cannot read the DeepSpeed model weights ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}); use another checkpoint"
        ) from err
    # engine/deepspeed.py wraps the model (LoopedForDeepSpeed): its names start with "module."
    return {k.removeprefix("module."): v for k, v in state.items()}


def load_deepspeed_weights(net: torch.nn.Module, step: Path) -> None:
    """``net`` (the bare looped model, one rank) from a DeepSpeed-engine checkpoint's weights."""
    state = deepspeed_weights(step)
    missing, unexpected = net.load_state_dict(state, strict=False)
    # megatron's modules list an ``_extra_state`` entry per layer (None on the local spec); DeepSpeed keeps only
    # parameters and buffers
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise UserError(
            f"{step}: the DeepSpeed weights do not fit the model of its trainer.json (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}): use another checkpoint"
        )
