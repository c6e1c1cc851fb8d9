"""The reverse direction: an export loaded back into a fresh project model equals the original."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic_pretrain.data.config import TokenizerConfig
from elastic_pretrain.errors import UserError
from elastic_pretrain.export.hf_export import write_export
from elastic_pretrain.export.hf_import import load_export
from elastic_pretrain.model.config import DeciderConfig
from tests.export.conftest import build, tiny


def test_export_then_import_round_trips(mesh1, tmp_path: Path) -> None:
    src = build(tiny(route_replay=True), decider=DeciderConfig(), seed=0)
    write_export(src, TokenizerConfig(), tmp_path / "hf", decider=DeciderConfig())
    dst = build(tiny(route_replay=True), decider=DeciderConfig(), seed=1, conditioning=False)
    assert not torch.equal(dst.core[0].shared_mlp.router.weight, src.core[0].shared_mlp.router.weight)
    load_export(dst, tmp_path / "hf")
    assert dst.conditioning_active
    a, b = src.state_dict(), dst.state_dict()
    for key, t in a.items():
        if isinstance(t, torch.Tensor):
            if key in ("embedding.word_embeddings.weight", "output_layer.weight"):  # padding rows: never used
                t, pad = t[:257], b[key][257:]
                assert pad.abs().sum() == 0
            assert torch.equal(t, b[key][: t.shape[0]]), key
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    for ell in range(1, 5):
        with torch.no_grad():
            assert torch.equal(dst(ids, loops=ell)[ell], src(ids, loops=ell)[ell])
    other = build(tiny(hidden_size=64), conditioning=False)
    with pytest.raises(UserError, match="hidden_size=32 but the model has 64"):
        load_export(other, tmp_path / "hf")
