"""A DeepSpeed checkpoint is a torch.save pickle: loading one never runs code from it (engine/safe_load.py)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed")

from elastic_pretrain.engine.safe_load import weights_only_loads


class _Payload:
    """Unpickling this object would create a file (a stand-in for any code an attacker chooses)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[override]
        return (Path.touch, (self.marker,))


def _malicious(path: Path, marker: Path) -> Path:
    torch.save({"module": {}, "global_steps": 3, "evil": _Payload(marker)}, path)
    return path


def test_deepspeeds_own_loader_refuses_a_malicious_pickle(tmp_path: Path) -> None:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    marker = tmp_path / "pwned"
    bad = _malicious(tmp_path / "mp_rank_00_model_states.pt", marker)
    # without the guard DeepSpeed's loader (weights_only=False) runs the payload: the test can fail
    TorchCheckpointEngine().load(str(bad), map_location="cpu")
    assert marker.exists()
    marker.unlink()
    with weights_only_loads(), pytest.raises(pickle.UnpicklingError):
        TorchCheckpointEngine().load(str(bad), map_location="cpu")
    assert not marker.exists()
    assert torch.load.__name__ == "load" and torch.load.__module__ == "torch.serialization"  # restored


def test_plain_tensors_and_deepspeed_records_still_load(tmp_path: Path) -> None:
    from deepspeed.runtime.zero.config import ZeroStageEnum

    path = tmp_path / "ok.pt"
    torch.save({"w": torch.arange(3.0), "zero_stage": ZeroStageEnum.gradients, "shapes": {"w": torch.Size([3])}}, path)
    with weights_only_loads():
        got = torch.load(path, weights_only=False)  # DeepSpeed's call: forced to weights_only=True
    assert torch.equal(got["w"], torch.arange(3.0)) and got["zero_stage"] == ZeroStageEnum.gradients
