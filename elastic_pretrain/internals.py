"""The private (underscore) names of megatron-core, torch and DeepSpeed that elastic-pretrain uses.

A library may rename, remove or change a private name in any release (megatron-core 0.17 did, for two we use).
:data:`PRIVATE` lists every one with its signature in the locked versions, so that an upgrade fails loudly
instead of at the first async save on a cluster (issue 30, item 7): ``tests/test_private_names.py`` checks the
package's code against the list, and :func:`require` refuses to start, in one line, when a name is missing.
docs/checkpoints.md, "Ours or the public APIs" (Private names in general; the 0.17 comparison).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
from importlib import metadata
from typing import Any

from elastic_pretrain.errors import UserError

DISTRIBUTION = {"megatron": "megatron-core", "torch": "torch", "deepspeed": "deepspeed"}
TESTED = {"megatron": "0.16.1", "torch": "2.13.0", "deepspeed": "0.19.8"}  # requirements/lock-cpu.txt


@dataclasses.dataclass(frozen=True)
class Private:
    """One private name: ``where`` is ``module:attribute.path``."""

    where: str
    signature: str | None = None  # str(inspect.signature(...)) in the tested version; None: not a callable
    instance: bool = False  # an attribute each instance gets in __init__, not one of the class
    renamed: str = ""  # its name in later versions (same module), accepted in its place

    @property
    def library(self) -> str:
        return self.where.split(":")[0].split(".")[0]

    @property
    def dotted(self) -> str:
        return self.where.replace(":", ".")


_FS_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_TORCH_STRATEGY = "megatron.core.dist_checkpointing.strategies.torch:TorchDistSaveShardedStrategy"
_RANDOM = "megatron.core.tensor_parallel.random"
_LAYER = "megatron.core.transformer.transformer_layer:TransformerLayer"
_ROUTER = "megatron.core.transformer.moe.router:TopKRouter"
_DIST_OPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
_DCP_FS = "torch.distributed.checkpoint.filesystem"
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher"
_ZERO_TO_FP32 = "deepspeed.utils.zero_to_fp32"
_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
_ZERO = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"

PRIVATE: tuple[Private, ...] = (
    # checkpoint/snapshot.py, checkpoint/manager.py: megatron's async checkpoint writer
    Private(f"{_FS_ASYNC}:_get_write_results_queue", "()", renamed="get_write_results_queue"),
    Private(f"{_FS_ASYNC}:_results_queue"),
    Private(
        f"{_FS_ASYNC}:_split_by_size_and_type",
        "(bins: int, items: List[torch.distributed.checkpoint.planner.WriteItem]) -> "
        "List[List[torch.distributed.checkpoint.planner.WriteItem]]",
    ),
    Private(
        f"{_FS_ASYNC}:_split_by_separation_hint",
        "(buckets: List[List[torch.distributed.checkpoint.planner.WriteItem]], separation_hint: Optional[str]"
        " = None) -> Dict[str, List[List[torch.distributed.checkpoint.planner.WriteItem]]]",
    ),
    Private(
        "megatron.core.dist_checkpointing.strategies.state_dict_saver:_DistWrapper",
        "(group: torch.distributed.distributed_c10d.ProcessGroup | None, use_dist: bool, coordinator_rank: int)",
    ),
    # checkpoint/snapshot.py: a repeat save's request (megatron-core 0.17 adds an ``async_strategy`` argument)
    Private(
        f"{_TORCH_STRATEGY}._get_save_and_finalize_callbacks",
        "(self, writer, save_state_dict_ret) -> megatron.core.dist_checkpointing.strategies.async_utils.AsyncRequest",
    ),
    # parallel/overlap.py: the bucket groups started by the depth ledger
    Private(
        "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup",
        "(buckets: List[megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucket], ddp_config: "
        "megatron.core.distributed.distributed_data_parallel_config.DistributedDataParallelConfig, "
        "collective_group: torch.distributed.distributed_c10d.ProcessGroup, collective_group_size: int)",
    ),
    # parallel/cpu_compat.py: megatron's CUDA RNG tracker, replaced on CPU
    Private(f"{_RANDOM}:_CUDA_RNG_STATE_TRACKER"),
    Private(f"{_RANDOM}:_CUDA_RNG_STATE_TRACKER_INITIALIZED"),
    Private(f"{_RANDOM}:_MODEL_PARALLEL_RNG_TRACKER_NAME"),
    Private(
        f"{_RANDOM}:_get_cuda_rng_state",
        "(device: Union[int, str, torch.device] = 'cuda', clone: bool = False, graph_safe: bool = False) -> "
        "torch.Tensor",
    ),
    Private(f"{_RANDOM}:_set_cuda_rng_state", "(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False)"),
    # model/looped.py, model/inference.py: a layer's halves, called pass by pass
    Private(
        f"{_LAYER}._forward_attention",
        "(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, context: "
        "Optional[torch.Tensor] = None, context_mask: Optional[torch.Tensor] = None, rotary_pos_emb: "
        "Optional[torch.Tensor] = None, rotary_pos_cos: Optional[torch.Tensor] = None, rotary_pos_sin: "
        "Optional[torch.Tensor] = None, rotary_pos_cos_sin: Optional[torch.Tensor] = None, attention_bias: "
        "Optional[torch.Tensor] = None, inference_context: Optional[Any] = None, packed_seq_params: "
        "Optional[megatron.core.packed_seq_params.PackedSeqParams] = None, sequence_len_offset: "
        "Optional[torch.Tensor] = None, padding_mask: Optional[torch.Tensor] = None, *, inference_params: "
        "Optional[Any] = None)",
    ),
    Private(f"{_LAYER}._forward_pre_mlp_layernorm", "(self, hidden_states)"),
    Private(f"{_LAYER}._forward_mlp", "(self, hidden_states, inference_context=None, padding_mask=None)"),
    Private(f"{_LAYER}._forward_post_mlp", "(self, mlp_output_with_bias, residual)"),
    # model/replay_dispatch.py: the router's aux losses on replayed routes
    Private(
        f"{_ROUTER}._apply_aux_loss",
        "(self, probs: torch.Tensor, scores_for_aux_loss: torch.Tensor, routing_map: torch.Tensor, "
        "with_padding_mask: bool = False)",
    ),
    Private(
        f"{_ROUTER}._apply_seq_aux_loss",
        "(self, probs: torch.Tensor, scores_for_aux_loss: torch.Tensor, routing_map: torch.Tensor, "
        "seq_length: int, bsz: int, with_padding_mask: bool = False)",
    ),
    Private(
        f"{_ROUTER}._apply_global_aux_loss",
        "(self, probs: torch.Tensor, scores_for_aux_loss: torch.Tensor, routing_map: torch.Tensor, "
        "with_padding_mask: bool = False)",
    ),
    Private(
        f"{_DISPATCHER}._maybe_dtoh_and_synchronize",
        "(self, point: str, tokens_per_expert: Optional[torch.Tensor] = None) -> torch.Tensor",
    ),
    # checkpoint/optim_state.py, train/session.py: the distributed optimizer's shard of each parameter
    Private(f"{_DIST_OPT}._get_model_param_range_map", "(self, param: torch.nn.parameter.Parameter)"),
    # torch
    Private("torch._C:_current_graph_task_id"),  # parallel/overlap.py: inside a backward?
    Private(
        f"{_DCP_FS}:_StorageInfo",
        "(relative_path: str, offset: int, length: int, transform_descriptors: collections.abc.Sequence[str] "
        "| None = None) -> None",
    ),
    Private(
        f"{_DCP_FS}:_write_item",
        "(transforms: torch.distributed.checkpoint.filesystem._StorageWriterTransforms, stream: io.IOBase, "
        "data: _io.BytesIO | torch.Tensor, write_item: torch.distributed.checkpoint.planner.WriteItem, "
        "storage_key: str, serialization_format: torch.distributed.checkpoint.filesystem.SerializationFormat)"
        " -> torch.distributed.checkpoint.storage.WriteResult",
    ),
    Private(
        "torch.utils._pytree:tree_flatten",
        "(tree: Any, is_leaf: collections.abc.Callable[[typing.Any], bool] | None = None) -> "
        "tuple[list[typing.Any], torch.utils._pytree.TreeSpec]",
    ),
    Private("torch.nn.modules.module:Module._forward_hooks", instance=True),  # model/replay_dispatch.py
    Private("torch.nn.modules.module:Module._forward_pre_hooks", instance=True),
    Private("torch:Tensor._base"),  # checkpoint/optim_state.py: is a view of the probe?
    # DeepSpeed (engine/)
    Private(
        f"{_ZERO_TO_FP32}:_zero2_merge_trainable_params",
        "(state_dict, world_size, fp32_flat_groups, zero_model_states, param_alignment_paddings=None)",
    ),
    Private(
        f"{_ZERO_TO_FP32}:_zero3_merge_trainable_params",
        "(state_dict, world_size, fp32_flat_groups, zero_model_states)",
    ),
    Private(f"{_ENGINE}._backward_prologue", "(self)"),
    Private(f"{_ENGINE}._backward_prologue_per_tensor", "(self, grad)"),
    Private(f"{_ZERO}._lazy_init_hp_params_optimizer_state", "(self)"),
    Private(f"{_ZERO}._hp_optimizer_states_linked", instance=True),
)


def _lookup(module: str, path: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def resolve(entry: Private) -> tuple[str, Any] | None:
    """(the name found, the object) in the installed version: the private name, else its later name; None when
    neither exists. An instance attribute resolves to its class, when the class's source assigns it."""
    module, path = entry.where.split(":")
    names = [path] + ([f"{path.rpartition('.')[0]}.{entry.renamed}".lstrip(".")] if entry.renamed else [])
    for name in names:
        owner_path, _, attr = name.rpartition(".")
        try:
            found = _lookup(module, owner_path if entry.instance else name)
        except (ImportError, AttributeError):
            continue
        if not entry.instance or _assigns(found, attr, entry.library):
            return name, found
    return None


def _assigns(cls: type, attr: str, library: str) -> bool:
    """Whether a class of ``library`` in ``cls``'s MRO names ``attr`` in its source (an instance attribute)."""
    for c in cls.__mro__:
        if c.__module__.split(".")[0] == library:
            try:
                if re.search(rf"\b{attr}\b", inspect.getsource(c)):
                    return True
            except (OSError, TypeError):  # no source (a compiled build): cannot tell, so do not refuse
                return True
    return False


def signature(obj: Any) -> str | None:
    """``str(inspect.signature(obj))``, or None for what has none (a value, a builtin without text signature)."""
    if not callable(obj):
        return None
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None


def version(library: str) -> str:
    try:
        return metadata.version(DISTRIBUTION[library])
    except metadata.PackageNotFoundError:
        return "(not installed)"


@functools.cache
def require(*libraries: str) -> None:
    """Refuse to start, in one line, when an installed library lacks a private name the package uses."""
    for entry in PRIVATE:
        if entry.library in libraries and resolve(entry) is None:
            dist = DISTRIBUTION[entry.library]
            raise UserError(
                f"{dist} {version(entry.library)} has no {entry.dotted}, which elastic-pretrain uses (tested with "
                f"{dist} {TESTED[entry.library]}): install {dist}=={TESTED[entry.library]}"
            )


def write_results_queue() -> Any:
    """megatron's queue through which the async checkpoint writers report (made on first use):
    ``_get_write_results_queue()`` up to megatron-core 0.16, ``get_write_results_queue()`` from 0.17 on."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    get = getattr(filesystem_async, "get_write_results_queue", None) or filesystem_async._get_write_results_queue
    return get()


def write_preloaded_data() -> Any:
    """megatron's writer of preloaded write buckets, ``(transform_list, use_msc, rank, write_buckets,
    results_queue)``: ``FileSystemWriterAsync.write_preloaded_data_multiproc`` (a process per bucket) up to
    megatron-core 0.16, ``write_preloaded_data_multithread`` (a thread per bucket) from 0.17 on. A public name,
    so not in :data:`PRIVATE`; looked up here so that the rename does not surface as an AttributeError in a
    writer process."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    cls = filesystem_async.FileSystemWriterAsync
    for name in ("write_preloaded_data_multithread", "write_preloaded_data_multiproc"):
        if (fn := getattr(cls, name, None)) is not None:
            return fn
    raise UserError(
        f"megatron-core {version('megatron')} has neither FileSystemWriterAsync.write_preloaded_data_multithread "
        f"nor write_preloaded_data_multiproc (tested with megatron-core {TESTED['megatron']})"
    )
