"""A checkpoint of one layer spec loads into a model of the other (issue 30, item 5; docs/checkpoints.md).

A GPU run saves with megatron's TE spec, where a MoE layer's pre-MLP norm is ``pre_mlp_layernorm`` (``TENorm``);
the local spec a CPU machine builds saves the same norm as ``mlp.linear_fc1.layer_norm_weight``. The
checkpoint here is saved by the real save path from a TE-spec model (TE's classes stood in on CPU as in
``tests/model/test_te_spec.py``: the spec and its key names are megatron's own), with its Adam state, and
loaded by the real load path into the local-spec model eval/export/convert build, and the other way round;
every weight and Adam moment must arrive unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from elastic_pretrain.checkpoint import optim_state
from elastic_pretrain.checkpoint.spec_keys import map_spec_keys
from elastic_pretrain.checkpoint.tensors import load_tensors, save_tensors
from tests.conftest import REPO
from tests.model.test_te_spec import build, te_standins, to_te_names  # noqa: F401 (a fixture)

# the TE spec's and the local spec's checkpoint key of one MoE layer's pre-MLP norm
TE_KEY, LOCAL_KEY = "core.0.passes.0.pre_mlp_layernorm.weight", "core.0.passes.0.mlp.linear_fc1.layer_norm_weight"


def _parts(spec: str) -> tuple[Any, Any]:
    """The tiny job's model (MoE edge layers, LayerNorm: weight and bias) under ``spec``, with its optimizer."""
    from elastic_pretrain.job_loader import load_job
    from elastic_pretrain.train.session import build_optimizer, wrap_ddp

    job = load_job(REPO / "jobs" / "tiny-cpu.yaml", ["parallel=single", "tracking.backend=none",
                   "model.edge_mlp=moe", "model.normalization=LayerNorm"])  # fmt: skip
    net = build(job.model, spec)
    optimizer, _ = build_optimizer(job, wrap_ddp(job, net))
    optim_state.ensure_state(optimizer)
    return net, optimizer


def _state(net: Any, optimizer: Any, te_names: set[str] | None) -> dict[str, torch.Tensor]:
    """Every weight and Adam moment by parameter name (TE-spec names when ``te_names`` is given)."""
    weights = {k: v for k, v in net.state_dict().items() if not k.endswith("_extra_state")}
    names = {id(p): n for n, p in net.named_parameters()}
    out = dict(weights)
    for opt in optim_state.optimizers(optimizer):
        for p in opt.model_param_group_index_map:
            tensors = optim_state.owned_states(opt, p)
            for moment in optim_state.ADAM_STATES:
                out[f"{moment}:{names[id(p)]}"] = tensors[moment].view(p.shape)
    if te_names is None:
        return {k: v.detach().clone() for k, v in out.items()}
    renamed = to_te_names(weights, te_names)
    for moment in optim_state.ADAM_STATES:
        mine = {k.split(":", 1)[1]: v for k, v in out.items() if k.startswith(f"{moment}:")}
        renamed.update({f"{moment}:{k}": v for k, v in to_te_names(mine, te_names).items()})
    return {k: v.detach().clone() for k, v in renamed.items()}


def _fill(net: Any, optimizer: Any, seed: int) -> None:
    """Distinct values in every weight (norms too) and every Adam moment."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        for opt in optim_state.optimizers(optimizer):
            for p in opt.model_param_group_index_map:
                tensors = optim_state.owned_states(opt, p)
                tensors["param"].copy_(p.view(-1))
                for moment in optim_state.ADAM_STATES:
                    tensors[moment].copy_(torch.rand(tensors[moment].shape, generator=g))


@pytest.mark.usefixtures("mesh1", "te_standins")
def test_the_two_specs_name_only_the_moe_pre_mlp_norm_differently() -> None:
    """What the mapping is for: only the MoE layers' (prelude, core, coda with edge_mlp moe) pre-MLP norms."""
    keys = {
        spec: {t.key for t in nested_values(build_model_only(spec).sharded_state_dict())} for spec in ("te", "local")
    }

    def norms(key: str) -> set[str]:
        return {key.replace("core.0.passes.0.", layer).replace("weight", param)
                for layer in ("prelude.0.", "core.0.passes.0.", "coda.0.") for param in ("weight", "bias")}  # fmt: skip

    assert keys["te"] - keys["local"] == norms(TE_KEY) and keys["local"] - keys["te"] == norms(LOCAL_KEY)


def build_model_only(spec: str) -> Any:
    from elastic_pretrain.job_loader import load_job

    job = load_job(REPO / "jobs" / "tiny-cpu.yaml", ["model.edge_mlp=moe", "model.normalization=LayerNorm"])
    return build(job.model, spec)


@pytest.mark.usefixtures("mesh1", "te_standins")
@pytest.mark.parametrize(("saved_by", "loaded_by"), [("te", "local"), ("local", "te")])
def test_a_checkpoint_of_one_spec_loads_into_the_other_bitwise(tmp_path: Path, saved_by: str, loaded_by: str) -> None:
    te_names = set(build_model_only("te").state_dict())
    source, source_opt = _parts(saved_by)
    _fill(source, source_opt, seed=1)
    save_tensors(source, source_opt, tmp_path, TorchDistSaveShardedStrategy("torch_dist", 1))
    want = _state(source, source_opt, te_names if saved_by == "local" else None)

    target, target_opt = _parts(loaded_by)
    _fill(target, target_opt, seed=2)  # nothing may keep its own value
    load_tensors(target, target_opt, tmp_path, adam_step=3.0)
    got = _state(target, target_opt, te_names if loaded_by == "local" else None)
    assert got.keys() == want.keys() and TE_KEY in got  # compared under the TE spec's names
    assert [k for k in want if not torch.equal(got[k], want[k])] == []

    # the model-only read of eval, generate, export and convert-checkpoint (engine/restore.py: load_model)
    bare = build_model_only(loaded_by)
    load_tensors(bare, None, tmp_path, what="model tensors")
    weights = {k: v for k, v in bare.state_dict().items() if not k.endswith("_extra_state")}
    if loaded_by == "local":
        weights = to_te_names(weights, te_names)
    assert [k for k, v in weights.items() if not torch.equal(v, want[k])] == []


def test_only_a_key_the_checkpoint_lacks_is_renamed_and_only_to_one_it_holds() -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def sharded(key: str) -> ShardedTensor:
        return ShardedTensor.from_rank_offsets(key, torch.zeros(2))

    request = {
        "a": sharded(LOCAL_KEY),
        "b": sharded("prelude.0.mlp.linear_fc1.layer_norm_weight"),
        "c": sharded(f"optimizer.exp_avg.{LOCAL_KEY}"),
        "d": sharded("coda.0.mlp.linear_fc1.layer_norm_bias"),
    }
    saved = {TE_KEY, "prelude.0.mlp.linear_fc1.layer_norm_weight", f"optimizer.exp_avg.{TE_KEY}"}
    assert map_spec_keys(request, saved) == [(LOCAL_KEY, TE_KEY), (f"optimizer.exp_avg.{LOCAL_KEY}",
                                                                   f"optimizer.exp_avg.{TE_KEY}")]  # fmt: skip
    # a dense layer's fused norm is in the checkpoint as it is; a key with no alias saved stays (DCP names it)
    assert [t.key for t in request.values()] == [
        TE_KEY,
        "prelude.0.mlp.linear_fc1.layer_norm_weight",
        f"optimizer.exp_avg.{TE_KEY}",
        "coda.0.mlp.linear_fc1.layer_norm_bias",
    ]
