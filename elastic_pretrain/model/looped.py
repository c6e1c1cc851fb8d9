"""The looped flattened-MoE language model, built from megatron-core modules.

Shape legend (suffixes): B batch, T sequence, D hidden, V (padded) vocabulary, E experts, L loops.
megatron-core layers work sequence-first, so hidden states inside the block are ``h_TBD``.

    embedding -> prelude (run once) -> core (run ℓ times) -> coda (run once per exit) -> norm -> head

Core layer i at pass j = attention A[i][j] (one parameter set per pass: untied; Foil,
seeds/000: "Each pass gets its own attention parameters while the experts and routers stay shared") + the MoE
MLP M[i] (experts, router and the norm in front of it shared by every pass). The model contains no
process-group code: it receives a megatron ``TransformerConfig`` built by ``parallel/``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from functools import partial
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

import torch
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.router_replay import RouterReplayAction
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from elastic_pretrain.config import ConfigError
from elastic_pretrain.model.config import GhostKind, ModelConfig, RecomputeKind, RunModes
from elastic_pretrain.model.decider import DeciderConfig, IterationDecider, PerTokenRun, run_per_token
from elastic_pretrain.model.kv_training import FinalKV, mixed_attention, project_kv
from elastic_pretrain.model.layer_list import LayerList
from elastic_pretrain.model.recompute import checkpoint_pass, checkpoint_scope
from elastic_pretrain.model.replay_dispatch import check_replayable, moe_forward
from elastic_pretrain.model.routing import RoutingProbe

P = ParamSpec("P")
R = TypeVar("R")
LoopedModelT = TypeVar("LoopedModelT", bound="LoopedMoEModel")


@dataclasses.dataclass(frozen=True)
class LayerSpecs:
    """megatron layer specs: ``dense`` for dense layers, ``moe`` for MoE layers, ``norm`` for the final norm.

    The final norm has its own spec: Transformer Engine's layer spec fuses each layer's input norm into
    the linear after it, so ``dense.submodules.input_layernorm`` is ``IdentityOp`` there."""

    dense: ModuleSpec
    moe: ModuleSpec
    norm: ModuleSpec | type


# Inside the one FP8 autocast of a forward under delayed scaling (fp8_forward); per thread of execution
_IN_DELAYED_FP8: contextvars.ContextVar[bool] = contextvars.ContextVar("in_delayed_fp8", default=False)


def _delayed(config: TransformerConfig) -> bool:
    return bool(config.fp8) and str(getattr(config.fp8_recipe, "value", config.fp8_recipe)) == "delayed"


def fp8_context(config: TransformerConfig, layer_number: int) -> contextlib.AbstractContextManager[Any]:
    """megatron's FP8 autocast for one layer (global 1-based ``layer_number``); a no-op without ``config.fp8``.

    megatron enters it inside ``TransformerBlock``, which the looped model does not use: it calls layers
    (and their attention/MLP halves) itself, so it enters the context around every layer call — each
    (core layer, pass), each prelude/coda layer — as the block does per layer. Not for ``delayed`` scaling:
    there the block enters one autocast around all its layers (every exit of a delayed-scaling autocast
    reduces and updates the amax histories; megatron refuses per-layer entry for it), and so does the looped
    model, around its whole forward (:func:`fp8_forward`); a layer run outside that is a bug, not bf16.
    """
    if not config.fp8:
        return contextlib.nullcontext()
    if _delayed(config):
        if not _IN_DELAYED_FP8.get():
            raise RuntimeError("model.fp8=delayed: a layer ran outside its forward's FP8 autocast (fp8_forward)")
        return contextlib.nullcontext()
    from megatron.core import fp8_utils  # looked up per call: tests stand in for TE's autocast here

    return fp8_utils.get_fp8_context(config, layer_number - 1)


@contextlib.contextmanager
def fp8_forward(config: TransformerConfig) -> Iterator[None]:
    """The one FP8 autocast of a forward under ``delayed`` scaling (megatron's ``TransformerBlock`` outer
    context: all layers, ``layer_no=-1``); re-entrant (an inner forward entry point adds nothing) and a no-op for
    the other recipes, which enter it per layer (:func:`fp8_context`). Under it the ghost MoE calls of mixed
    depth run in FP8 too: their one all-zero token and its zero gradients add nothing to any amax."""
    if not _delayed(config) or _IN_DELAYED_FP8.get():
        yield
        return
    from megatron.core import fp8_utils

    token = _IN_DELAYED_FP8.set(True)
    try:
        with fp8_utils.get_fp8_context(config):
            yield
    finally:
        _IN_DELAYED_FP8.reset(token)


def _in_fp8_forward(method: Callable[Concatenate[LoopedModelT, P], R]) -> Callable[Concatenate[LoopedModelT, P], R]:
    """Run a forward entry point of the model inside :func:`fp8_forward`."""

    @functools.wraps(method)
    def wrapper(self: LoopedModelT, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with fp8_forward(self.config):
            return method(self, *args, **kwargs)

    return wrapper


def attention_only(spec: ModuleSpec) -> ModuleSpec:
    """The same layer spec with no MLP half (the shared MLP of pass 0 is used instead)."""
    sub = dataclasses.replace(spec.submodules, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp)
    return dataclasses.replace(spec, submodules=sub)


class CoreLayer(MegatronModule):
    """Core layer i: one attention per pass, one MoE MLP shared by every pass.

    ``passes[0]`` is a full megatron ``TransformerLayer`` (attention A[i][0] + shared MLP M[i]);
    ``passes[j>0]`` are attention-only layers. Each pass runs its own attention half and then the MLP
    half of ``passes[0]``, so shared parameters are registered exactly once (one gradient buffer
    entry, one checkpoint key) and receive the gradient of every pass.
    """

    def __init__(
        self,
        config: TransformerConfig,
        spec: ModuleSpec,
        *,
        layer_number: int,
        num_passes: int,
        tied_attention: bool,
        replay_impl: Literal["dispatch", "router"] = "dispatch",
    ) -> None:
        super().__init__(config=config)
        n_attn = 1 if tied_attention else num_passes
        layers = [build_module(spec, config=config, layer_number=layer_number)]
        layers += [
            build_module(attention_only(spec), config=config, layer_number=layer_number) for _ in range(n_attn - 1)
        ]
        self.passes = LayerList(layers)
        # route replay: pass 0's routing per micro-batch (impl router: its top-k experts; dispatch: a RouteRecord)
        self.pass0_routes: dict[Hashable, Any] = {}
        self.replay_impl = replay_impl  # model.route_replay_impl

    @property
    def full_layer(self) -> Any:
        """``passes[0]``: attention of pass 0 + the shared MLP half (megatron ``TransformerLayer``)."""
        return self.passes[0]

    @property
    def shared_mlp(self) -> Any:
        return self.full_layer.mlp

    def attention_for(self, pass_idx: int) -> Any:
        return self.passes[min(pass_idx, len(self.passes) - 1)]

    def forward(
        self,
        h_TBD: Tensor,
        *,
        pass_idx: int,
        rotary_pos_emb: Tensor | None,
        replay: bool = False,
        replay_key: Hashable = None,
        recomputing: bool = False,
        kv: FinalKV | None = None,
    ) -> Tensor:
        """Pass ``pass_idx``: its own attention, then the shared MLP (inside the FP8 autocast, if any).

        ``replay_key`` names the micro-batch whose pass-0 routes a later pass replays. Without pipeline
        parallelism passes run in order and one key suffices; the interleaved pipeline schedule runs
        pass 0 of micro-batch m+1 before pass 1 of micro-batch m, so there each micro-batch has its own.
        ``recomputing``: this is the backward's re-run of the pass (``train.recompute: pass``); with route
        replay every pass — pass 0 too — replays the recorded pass-0 routes and records nothing.
        ``model.route_replay_impl``: ``dispatch`` replays pass 0's routing map and dispatch metadata
        (model/replay_dispatch.py); ``router`` megatron's RouterReplay (only top-k is replaced).
        ``kv`` (``model.kv_training: last_loop``, model/kv_training.py): while capturing, keep this pass's
        K/V as the layer's final K/V; else attend to earlier tokens' final K/V and the token's own.
        """
        with fp8_context(self.config, self.full_layer.layer_number):
            attention = self.attention_for(pass_idx)
            number = self.full_layer.layer_number
            if kv is not None and not kv.capture:
                assert rotary_pos_emb is not None, "kv_training: last_loop needs the rotary embedding"
                h_TBD = mixed_attention(attention, h_TBD, rotary_pos_emb, kv, number)
            else:
                if kv is not None:  # capturing: this pass's K/V are the layer's final K/V
                    assert rotary_pos_emb is not None, "kv_training: last_loop needs the rotary embedding"
                    kv.kv[number] = project_kv(attention, h_TBD, rotary_pos_emb)
                h_TBD, _ = attention._forward_attention(h_TBD, attention_mask=None, rotary_pos_emb=rotary_pos_emb)
            if replay and self.replay_impl == "dispatch":
                return self._replayed_mlp(h_TBD, pass_idx=pass_idx, recomputing=recomputing, key=replay_key)
            router = getattr(self.shared_mlp, "router", None)
            rr = getattr(router, "router_replay", None) if replay else None
            record = rr is not None and pass_idx == 0 and not recomputing
            if rr is not None:
                # Route replay (ELR), route_replay_impl router: pass 0 records its top-k experts, later passes
                # reuse them; the full router still runs, so the gates are a softmax of the live logits.
                if record:
                    rr.clear_indices()
                    rr.set_router_replay_action(RouterReplayAction.RECORD)
                else:
                    rr.target_topk_idx = self.pass0_routes[replay_key]  # not set_target_indices: no backward list
                    rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            try:
                return self.full_layer._forward_mlp(h_TBD)
            finally:
                if rr is not None:
                    if record:
                        self.pass0_routes[replay_key] = rr.recorded_topk_idx
                    rr.clear_router_replay_action()

    def _replayed_mlp(self, h_TBD: Tensor, *, pass_idx: int, recomputing: bool, key: Hashable) -> Tensor:
        """``TransformerLayer._forward_mlp`` with the MoE call of model/replay_dispatch.py: pass 0 records
        its routing and dispatch metadata (``pass0_routes[key]``), later passes and re-runs replay them.
        Only pass 0 adds the router's z-loss and load-balancing loss (in its backward re-run, if any)."""
        record = pass_idx == 0 and not recomputing
        layer = self.full_layer
        if layer.recompute_mlp or layer.recompute_pre_mlp_layernorm:
            raise RuntimeError("route_replay_impl dispatch does not compose with megatron's MLP recompute")
        residual = h_TBD
        x_TBD = layer._forward_pre_mlp_layernorm(h_TBD)
        ep = self.shared_mlp.token_dispatcher.ep_size * self.shared_mlp.token_dispatcher.tp_size
        out, rec = moe_forward(
            self.shared_mlp,
            x_TBD,
            None if record else self.pass0_routes[key],
            exchange_counts=ep > 1,
            router_losses=pass_idx == 0 and recomputing,
        )
        if record:
            self.pass0_routes[key] = rec
        return layer._forward_post_mlp((out, None), residual)

    @torch.no_grad()
    def copy_pass0_attention(self, passes: Sequence[int]) -> list[torch.nn.Parameter]:
        """Copy pass 0's attention parameters into ``passes`` (j >= 1); returns the parameters written.

        ``schedule.init_unused_passes: copy_pass0`` at a late switch from fewer loops: the fixed phase
        never ran these passes, so their attention is still at its initialisation. Pass j's layer
        holds exactly the attention half of pass 0's (same names, same TP shards).
        """
        src = dict(self.full_layer.named_parameters())
        written = []
        for j in passes:
            if 1 <= j < len(self.passes):
                for name, p in self.passes[j].named_parameters():
                    p.copy_(src[name])
                    written.append(p)
        return written

    def ghost_pass(self, like_TBD: Tensor) -> Tensor:
        """Join one MoE call (forward and backward collectives) without contributing — see run_loops.

        megatron's router cannot take zero tokens (a ``view(..., -1)`` of an empty tensor), so the
        ghost call sends one all-zero token. The caller multiplies the result by zero: the token's
        expert outputs and every gradient it produces are exactly zero, so numerics are unchanged.
        """
        dummy = like_TBD.new_zeros((1, 1, like_TBD.shape[-1]), requires_grad=True)
        router = self.shared_mlp.router
        was_training = router.training
        router.train(False)  # no aux / z loss from the dummy token; still in the autograd graph
        try:
            out, _ = self.shared_mlp(dummy)
        finally:
            router.train(was_training)
        return out.sum()


class LoopConditioning(MegatronModule):
    """ELR loop-count conditioning: (target ℓ, pass j) → a vector added to the residual at pass entry.

    ``out`` is zero-initialised and the head is only switched on when the schedule enters mixed
    depth, so the switch step's loss equals the fixed-depth model's (ELR, seeds/003: "conditioning heads
    initialized to zero at the switch").
    Parameters are replicated over TP; tagged ``sequence_parallel`` so their gradients (partial sums
    over each rank's sequence shard) are all-reduced over TP like norm weights.
    """

    def __init__(self, config: TransformerConfig, max_loops: int) -> None:
        super().__init__(config=config)
        d = config.hidden_size
        self.target_emb = torch.nn.Embedding(max_loops + 1, d)
        self.pass_emb = torch.nn.Embedding(max_loops, d)
        self.out = torch.nn.Linear(d, d, bias=False)
        with torch.no_grad():
            self.target_emb.weight.normal_(0.0, config.init_method_std)
            self.pass_emb.weight.normal_(0.0, config.init_method_std)
            self.out.weight.zero_()
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, target_loops: int, pass_idx: int) -> Tensor:
        idx = torch.tensor(target_loops, device=self.out.weight.device)
        z_D = self.target_emb(idx) + self.pass_emb(torch.tensor(pass_idx, device=idx.device))
        return self.out(torch.nn.functional.silu(z_D))


class LoopedMoEModel(LanguageModule):
    """Embedding → prelude → core × ℓ → coda → norm → output layer (vocab-parallel).

    ``stage``/``stages``: the part one pipeline stage holds (docs/parallelism.md) — core layers
    ``[stage·k/P, (stage+1)·k/P)`` with every pass's attention and their shared MLPs; embedding, prelude
    and loop conditioning on the first stage; coda, final norm and output layer on the last. Parameters
    keep their global names (``core.<global index>.…``), so checkpoints do not depend on the layout.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        config: TransformerConfig,
        specs: LayerSpecs,
        *,
        padded_vocab: int,
        stage: int = 0,
        stages: int = 1,
        decider: DeciderConfig | None = None,
        head_config: TransformerConfig | None = None,
        modes: RunModes | None = None,
    ) -> None:
        super().__init__(config=config)
        self.cfg = cfg
        self._modes = modes or RunModes()
        self.padded_vocab = padded_vocab
        self.share_embeddings_and_output_weights = cfg.tie_embeddings
        self.stage, self.stages = stage, stages
        self.pre_process, self.post_process = stage == 0, stage == stages - 1
        self.set_vocab_shard(0, padded_vocab)  # single-rank default; build_model sets this rank's slice
        self.model_type = ModelType.encoder_or_decoder  # read by megatron's schedules
        if self.pre_process:
            self.embedding = LanguageModelEmbedding(
                config=config,
                vocab_size=padded_vocab,
                max_sequence_length=0,
                position_embedding_type="rope",
                scatter_to_sequence_parallel=True,
            )
        self.rotary_pos_emb = RotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=1.0,
            rotary_base=cfg.rope_base,
            use_cpu_initialization=config.use_cpu_initialization,
        )
        edge = specs.moe if cfg.edge_mlp == "moe" else specs.dense
        per_stage = cfg.core_layers_built // stages
        first_core = stage * per_stage
        core_number = cfg.prelude_layers + first_core + 1  # megatron layer numbers are global and 1-based
        coda_number = cfg.prelude_layers + cfg.core_layers_built + 1
        self.prelude = LayerList(
            [build_module(edge, config=config, layer_number=1 + i) for i in range(cfg.prelude_layers)]
            if self.pre_process
            else []
        )
        self.core = LayerList(
            [
                CoreLayer(
                    config,
                    specs.moe,
                    layer_number=core_number + i,
                    num_passes=cfg.max_loops,
                    tied_attention=cfg.attention == "tied",
                    replay_impl=cfg.route_replay_impl,
                )
                for i in range(per_stage)
            ],
            start=first_core,
        )
        if cfg.route_replay and cfg.route_replay_impl == "dispatch":
            check_replayable(config)
        if cfg.kv_training == "last_loop" and stages > 1:
            raise ConfigError(
                "model.kv_training=last_loop runs all passes before the graded run: use "
                "parallel.pipeline=1, or model.kv_training=same_pass"
            )
        self.coda = LayerList(
            [build_module(edge, config=config, layer_number=coda_number + i) for i in range(cfg.coda_layers)]
            if self.post_process
            else []
        )
        with_conditioning = cfg.loop_conditioning and self.pre_process
        # The head draws from a forked RNG, so building it leaves every later draw (the coda, the output
        # layer) as without it: runs with and without heads are paired in initialisation, not only in data.
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            self.loop_conditioning = LoopConditioning(config, cfg.max_loops) if with_conditioning else None
        # TaH2 iteration decider (a decider job): a submodule, so DDP, the optimizer and checkpoints
        # treat it like any parameter. Replicated over TP; under sequence parallelism each TP rank sees
        # only its sequence shard, so its gradients are partial sums: tagged like norm weights.
        self.decider = None
        if decider is not None:
            self.decider = IterationDecider(decider, hidden_size=config.hidden_size, max_loops=cfg.max_loops)
            for p in self.decider.parameters():
                p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        self.routing_probe: RoutingProbe | None = None
        if self.post_process:
            self.final_layernorm = build_module(
                specs.norm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
            )
            # head_config: the model's config, or a copy without fused weight-gradient accumulation where its
            # (Apex) kernel is missing (parallel/megatron.py output_layer_config)
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size,
                padded_vocab,
                config=head_config or config,
                init_method=config.init_method,
                bias=False,
                skip_bias_add=False,
                gather_output=False,
                skip_weight_param_allocation=cfg.tie_embeddings,
            )
        if cfg.tie_embeddings:
            self.setup_embeddings_and_output_layer()

    # ------------------------------------------------------------------------------------------
    # Run modes (RunModes): read here, set only through the constructor or set_modes
    @property
    def modes(self) -> RunModes:
        return self._modes

    def set_modes(
        self,
        *,
        ghosts: GhostKind | None = None,
        recompute: RecomputeKind | None = None,
        conditioning: bool | None = None,
    ) -> RunModes:
        """Change the named run modes (the others stay); returns the modes before, so a caller can restore them."""
        before = self._modes
        self._modes = RunModes(
            ghosts=before.ghosts if ghosts is None else ghosts,
            recompute=before.recompute if recompute is None else recompute,
            conditioning=before.conditioning if conditioning is None else conditioning,
        )
        return before

    @property
    def ghosts(self) -> GhostKind:
        return self._modes.ghosts

    @ghosts.setter
    def ghosts(self, value: object) -> None:
        _refuse_mode_attribute("ghosts", "ghosts")

    @property
    def recompute(self) -> RecomputeKind:
        return self._modes.recompute

    @recompute.setter
    def recompute(self, value: object) -> None:
        _refuse_mode_attribute("recompute", "recompute")

    @property
    def conditioning_active(self) -> bool:
        """The loop-count conditioning heads are on (``RunModes.conditioning``)."""
        return self._modes.conditioning

    @conditioning_active.setter
    def conditioning_active(self, value: object) -> None:
        _refuse_mode_attribute("conditioning_active", "conditioning")

    def set_input_tensor(self, input_tensor: Tensor | None) -> None:  # megatron schedule hook (PP=1: unused)
        self.input_tensor = input_tensor

    def fp8_forward(self) -> contextlib.AbstractContextManager[None]:
        """The forward-wide FP8 autocast of ``delayed`` scaling (see the module's :func:`fp8_forward`): for a caller
        that runs several of the model's entry points as one forward (a pipeline chunk and its head)."""
        return fp8_forward(self.config)

    @property
    def one_exit_per_run(self) -> bool:
        """Whether an evaluation at several ℓ needs one run per ℓ (not one L_max run with an exit per ℓ): the
        conditioning head conditions each ℓ on its own target, and ``kv_training: last_loop`` attends to the
        final K/V of the run's ℓ."""
        return self.conditioning_active or self.cfg.kv_training == "last_loop"

    def core_layers(self) -> list[CoreLayer]:
        return [c for c in self.core if isinstance(c, CoreLayer)]

    def idle_parameters(self, *, passes_run: int | None = None) -> list[torch.nn.Parameter]:
        """Parameters no training forward of the current phase runs, so their gradient is exactly zero: the
        loop-conditioning heads while they are off (ELR's fixed phase), and the per-pass attention of passes
        ``passes_run``.. (a fixed phase at fewer loops than L_max; tied attention has one block, run by every
        pass). ``passes_run`` None: every pass runs. The trainer keeps them out of the update (train/idle.py)."""
        out = []
        if self.loop_conditioning is not None and not self.conditioning_active:
            out += list(self.loop_conditioning.parameters())
        if passes_run is not None:
            for core in self.core_layers():
                for j in range(max(passes_run, 1), len(core.passes)):
                    out += list(core.passes[j].parameters())
        return out

    def start_routing_probe(self) -> RoutingProbe:
        """Collect routing health during the next forward passes (until :meth:`stop_routing_probe`)."""
        # rows are global core-layer indices: a pipeline stage fills its own, a sum over stages fills all
        self.routing_probe = RoutingProbe(self.cfg.core_layers_built, self.cfg.max_loops, self.cfg.moe_top_k)
        first = self.stage * (self.cfg.core_layers_built // self.stages)
        self.routing_probe.attach([core.shared_mlp.router for core in self.core_layers()], first=first)
        return self.routing_probe

    def stop_routing_probe(self) -> RoutingProbe | None:
        probe, self.routing_probe = self.routing_probe, None
        if probe is not None:
            probe.detach()
        return probe

    def init_unused_passes(self, passes: Sequence[int]) -> list[torch.nn.Parameter]:
        """Pass 0's attention into ``passes`` on every core layer of this stage (see CoreLayer.copy_pass0_attention)."""
        return [p for core in self.core_layers() for p in core.copy_pass0_attention(passes)]

    @_in_fp8_forward
    def run_loops(
        self,
        input_ids_BT: Tensor,
        *,
        loops: int,
        exits: Sequence[int],
        sync_loops: int | None = None,
        keep: list[Tensor] | None = None,
    ) -> tuple[dict[int, Tensor], Tensor | None]:
        """Hidden states after the coda and final norm at each exit loop count (sequence-first).

        ``sync_loops`` > ``loops``: other members of this rank's expert-parallel group run more
        passes on this micro-batch. Every MoE call is an all-to-all over that group, so after its
        own passes this rank joins each remaining call with zero tokens (forward, and — through the
        returned ``ghost`` scalar, which the caller adds to its loss times zero — backward too).
        Ghost calls come after every real one, so the collectives line up in both directions.
        The heads (coda + final norm) run last, after the ghost passes, in exit order, as the DeepSpeed path's
        :meth:`_run_with_full_ghosts` does: with MoE edge layers (``model.edge_mlp: moe``) each coda layer is an
        all-to-all of the same group, so a head run between passes would pair with a partner's core-layer call and
        send tokens to the wrong layer's experts (issue 30, item 4). Every member then issues the same sequence:
        ``sync_loops`` passes of core calls, then one coda run per exit (the samplers give every member of a group
        as many exits).
        ``keep``: a list that receives the token embedding, then the hidden state after each pass.
        """
        self.cfg.check_loops(loops)
        rope = self.rotary_pos_emb(input_ids_BT.shape[1])
        h_TBD = self.embed(input_ids_BT, rope, keep)
        if self.ghosts == "full_passes":
            return self._run_with_full_ghosts(
                h_TBD, rope, loops=loops, exits=exits, sync_loops=sync_loops or loops, keep=keep
            ), None
        kv = None
        if self.cfg.kv_training == "last_loop" and max(loops, sync_loops or loops) > 1:
            kv = self._final_kv(h_TBD, loops, exits, sync_loops, rope)  # at ℓ = 1 only to pair with deeper EP partners
            # at ℓ = 1 the final K/V are pass 0's: same-pass attention, whose gradient reaches the earlier tokens' K/V
            kv = kv if loops > 1 else None
        states: dict[int, Tensor] = {}
        for j in range(loops):
            h_TBD = self._core_pass(h_TBD, j, loops, rope, kv=kv)
            if keep is not None:
                keep.append(h_TBD)
            if j + 1 in exits:
                states[j + 1] = h_TBD
        ghost = None
        for _ in range(loops, sync_loops or loops):
            g = self._ghost_pass(h_TBD)
            ghost = g if ghost is None else ghost + g
        return {e: self.head_states(states[e], rope, kv) for e in sorted(states)}, ghost

    def _run_with_full_ghosts(
        self,
        h_TBD: Tensor,
        rope: Tensor,
        *,
        loops: int,
        exits: Sequence[int],
        sync_loops: int,
        keep: list[Tensor] | None,
    ) -> dict[int, Tensor]:
        """``ghosts == "full_passes"`` (DeepSpeed ZeRO-3): every module call of ``sync_loops`` passes, in one order.

        ZeRO-3 gathers a module's parameters with a collective over the data-parallel group when the module
        is called (and again in backward), so every rank must call the same modules in the same order. A
        micro-batch at ℓ < ``sync_loops`` therefore runs passes ℓ..sync_loops-1 as ghosts on its own hidden
        state — the same module calls as a real pass (each pass's own attention, the shared MoE MLPs, loop
        conditioning), no router losses, not seen by the routing probe — and :class:`GhostJoin` hands the head
        the state after ℓ with the ghosts' output behind it: the head reads exactly h_ℓ, the ghosts' backward
        runs (its gathers and gradient reductions pair with the deeper ranks') on a zero gradient, so every
        parameter's gradient is exactly that of ℓ passes. The heads run after the last pass (ranks whose exits
        differ call the same head modules at the same point), in exit order."""
        if self.cfg.kv_training == "last_loop":
            raise ValueError("full ghost passes (ZeRO-3 mixed depth) run with model.kv_training=same_pass")
        states: dict[int, Tensor] = {}
        for j in range(loops):
            h_TBD = self._core_pass(h_TBD, j, loops, rope)
            if keep is not None:
                keep.append(h_TBD)
            if j + 1 in exits:
                states[j + 1] = h_TBD
        z_TBD = h_TBD
        for j in range(loops, sync_loops):
            z_TBD = self._core_pass(z_TBD, j, loops, rope, ghost=True)
        if sync_loops > loops:
            states[loops] = GhostJoin.apply(h_TBD, z_TBD)
        return {e: self.head_states(states[e], rope) for e in sorted(states)}

    @_in_fp8_forward
    def run_layers(self, input_ids_BT: Tensor, *, exits: Sequence[int]) -> dict[int, Tensor]:
        """``schedule.exit_axis: layer`` (TLM's own axis): hidden states after core layer k, then the coda and the
        final norm (shared by every exit, as the output layer is), for each k in ``exits``; one pass.

        The exit after layer k is exactly the stack truncated after layer k: the prelude, core layers 1..k, the
        coda and the final norm (pass 0's attention, loop conditioning on ℓ = 1 when it is on — training and
        evaluation both read exits here). Layers after the deepest exit do not run."""
        k_max = self.cfg.core_layers_built
        if self.cfg.max_loops != 1 or self.stages != 1:
            raise ValueError("exit_axis=layer needs a non-looped stack (L_max = 1) without pipeline parallelism")
        if not exits or not all(1 <= k <= k_max for k in exits):
            raise ValueError(f"layer exits {sorted(exits)} must be a non-empty subset of 1..{k_max} (core layers)")
        if self.cfg.kv_training == "last_loop" or self.recomputes_passes():
            raise ValueError("exit_axis=layer runs with model.kv_training=same_pass and train.recompute none|selective")
        rope = self.rotary_pos_emb(input_ids_BT.shape[1])
        h_TBD = self.embed(input_ids_BT, rope)
        if self.loop_conditioning is not None and self.conditioning_active:  # as _pass_body does at pass 0
            h_TBD = h_TBD + self.loop_conditioning(1, 0).to(h_TBD.dtype)
        if self.routing_probe is not None:
            self.routing_probe.at(0, None)
        out: dict[int, Tensor] = {}
        for k, core in enumerate(self.core, start=1):
            if k > max(exits):
                break
            h_TBD = core(h_TBD, pass_idx=0, rotary_pos_emb=rope)
            if k in exits:
                out[k] = self.head_states(h_TBD, rope)
        return out

    @_in_fp8_forward
    def run_chunk(
        self, h_TBD: Tensor | None, input_ids_BT: Tensor, *, pass_idx: int, loops: int, sync_loops: int, key: Hashable
    ) -> Tensor:
        """Virtual pipeline chunk ``pass_idx`` of this stage, for a micro-batch that runs ℓ = ``loops``.

        ``h_TBD`` is None on the first chunk of the first stage (embedding and prelude run first).
        Pass j < ℓ runs this stage's core layers; ℓ <= j < ``sync_loops`` joins each core layer's
        MoE call as a ghost (see :meth:`run_loops`); later chunks forward the activation unchanged.
        ``key`` names the micro-batch (route replay; the schedule interleaves micro-batches).
        """
        rope = self.rotary_pos_emb(input_ids_BT.shape[1])
        if h_TBD is None:
            h_TBD = self.embed(input_ids_BT, rope)
        if pass_idx < loops:
            return self._core_pass(h_TBD, pass_idx, loops, rope, key)
        if pass_idx < sync_loops:
            return h_TBD + 0.0 * self._ghost_pass(h_TBD)  # keeps the ghost's backward all-to-alls in the graph
        return h_TBD.view_as(h_TBD)  # identity chunk: no compute, the activation moves on

    @_in_fp8_forward
    def head_losses(self, h_TBD: Tensor, input_ids_BT: Tensor, labels_BT: Tensor) -> Tensor:
        """Per-token CE ``[B, T]`` of hidden states that finished their passes (last stage only)."""
        rope = self.rotary_pos_emb(input_ids_BT.shape[1])
        return self.compute_language_model_loss(labels_BT, self.logits(self.head_states(h_TBD, rope)))

    # ------------------------------------------------------------------------------------------
    # The pieces of a run: the forward entry points above compose them; public for the per-token decider run
    # (model/decider.py: run_per_token), which steps them itself. None enters the forward-wide autocast of delayed
    # FP8 scaling: a caller of several holds it (fp8_forward).
    def embed(self, input_ids_BT: Tensor, rope: Tensor, keep: list[Tensor] | None = None) -> Tensor:
        """Embedding and prelude (first stage): the state entering pass 0 (``keep`` receives the token embedding)."""
        h_TBD = self.embedding(input_ids=input_ids_BT, position_ids=None)
        if keep is not None:  # the decider reads the token embedding
            keep.append(h_TBD)
        for layer in self.prelude:
            with fp8_context(self.config, _layer_number(layer)):
                h_TBD, _ = layer(h_TBD, attention_mask=None, rotary_pos_emb=rope)
        return h_TBD

    def _final_kv(
        self, h_TBD: Tensor, loops: int, exits: Sequence[int], sync_loops: int | None, rope: Tensor
    ) -> FinalKV:
        """``kv_training: last_loop``: the no-grad ℓ-pass run (and its ghost passes, which EP partners
        pair with) that yields each core layer's final-pass K/V, and each coda layer's K/V on top of
        them, for the graded run (model/kv_training.py). At ℓ = 1 the graded run is same-pass (the same
        loss, and the full gradient): this runs there only when an expert-parallel partner at ℓ > 1 needs its
        MoE all-to-alls joined (``sync_loops`` > 1), and its K/V are not used."""
        if any(e != loops for e in exits):
            raise ValueError(
                f"model.kv_training=last_loop: exits {sorted(exits)} before ℓ = {loops} would attend to "
                "ℓ's final K/V; use one exit per micro-batch (no telescopic exits, no decider training)"
            )
        kv = FinalKV()
        probe, self.routing_probe = self.routing_probe, None  # the routing probe observes the graded run only
        if probe is not None:
            probe.at(None)  # its router hooks stay attached: they skip calls while it points nowhere
        try:
            with torch.no_grad():
                h_TBD = h_TBD.detach()
                for j in range(loops):
                    h_TBD = self._pass_body(
                        h_TBD, rope, j=j, loops=loops, key=None, recomputing=False, kv=kv if j == loops - 1 else None
                    )
                for _ in range(loops, sync_loops or loops):
                    self._ghost_body(h_TBD)
                self.head_states(h_TBD, rope, kv)
        finally:
            self.routing_probe = probe
        kv.capture = False
        return kv

    def core_pass(
        self, h_TBD: Tensor, j: int, *, loops: int, rope: Tensor, key: Hashable = None, kv: FinalKV | None = None
    ) -> Tensor:
        """Pass j (0-based) of a micro-batch that runs ℓ = ``loops`` through this stage's core layers: loop
        conditioning, each core layer, route replay, per-pass recompute and ``kv`` (K/V other than the pass's
        own, model/kv_training.py) as the model's modes and config say."""
        return self._core_pass(h_TBD, j, loops, rope, key, kv)

    def _core_pass(
        self,
        h_TBD: Tensor,
        j: int,
        loops: int,
        rope: Tensor,
        key: Hashable = None,
        kv: FinalKV | None = None,
        ghost: bool = False,
    ) -> Tensor:
        """Pass j of a micro-batch that runs ℓ = ``loops`` through this stage's core layers (``ghost``: pass
        j >= ℓ run only for its module calls, see :meth:`_run_with_full_ghosts`)."""
        body = partial(self._pass_body, j=j, loops=loops, key=key, kv=kv, ghost=ghost)
        if self.recomputes_passes():
            return self._checkpointed(body, h_TBD, rope)
        return body(h_TBD, rope, recomputing=False)

    def _pass_body(
        self,
        h_TBD: Tensor,
        rope: Tensor,
        *,
        j: int,
        loops: int,
        key: Hashable,
        recomputing: bool,
        kv: FinalKV | None = None,
        ghost: bool = False,
    ) -> Tensor:
        if self.loop_conditioning is not None and self.conditioning_active:
            h_TBD = h_TBD + self.loop_conditioning(loops, j).to(h_TBD.dtype)
        if self.routing_probe is not None:  # a recomputed pass was observed already; a ghost pass never
            self.routing_probe.at(None if recomputing or ghost else j, key)
        routers = [core.shared_mlp.router for core in self.core_layers()] if ghost else []
        with _without_router_losses(routers):
            for core in self.core:
                h_TBD = core(
                    h_TBD,
                    pass_idx=j,
                    rotary_pos_emb=rope,
                    replay=self.cfg.route_replay,
                    replay_key=key,
                    recomputing=recomputing,
                    kv=kv,
                )
        return h_TBD

    def _ghost_pass(self, like_TBD: Tensor) -> Tensor:
        """One ghost MoE call per core layer of this stage; the sum of their (zero) outputs.

        Under ``recompute: pass`` a ghost pass is checkpointed like a real one: the backward of every
        pass then starts with its forward all-to-alls again, on the ranks that ghost it too, so the
        collectives of an expert-parallel group keep pairing up in backward.
        """
        if self.recomputes_passes():
            return self._checkpointed(lambda h, recomputing: self._ghost_body(h), like_TBD)
        return self._ghost_body(like_TBD)

    def _ghost_body(self, like_TBD: Tensor) -> Tensor:
        if self.routing_probe is not None:
            self.routing_probe.at(None)
        ghost = None
        for core in self.core_layers():
            g = core.ghost_pass(like_TBD)
            ghost = g if ghost is None else ghost + g
        assert ghost is not None
        return ghost

    def recomputes_passes(self) -> bool:
        """Whether a pass run now is checkpointed and re-run in backward (``RunModes.recompute: pass``, training)."""
        return self.recompute == "pass" and self.training and torch.is_grad_enabled()

    def _checkpointed(self, body: Callable[..., Tensor], *tensors: Tensor) -> Tensor:
        """``body(*tensors, recomputing=…)`` keeping only ``tensors`` for backward, which re-runs it
        (model/recompute.py; under FP8 Transformer Engine's checkpoint, which also keeps the re-run on
        the forward's scaling factors). The forward runs without grad, so the MoE aux/z losses are
        computed (and logged) once, in the re-run.
        """
        calls = 0

        def run(*args: Tensor) -> Tensor:
            nonlocal calls
            calls += 1
            return body(*args, recomputing=calls > 1)

        with checkpoint_scope():  # its backward is a backward call of its own (parallel/overlap.py counts them)
            if self.config.fp8:
                from megatron.core.extensions.transformer_engine import te_checkpoint

                return te_checkpoint(run, False, tensor_parallel.get_cuda_rng_tracker, None, *tensors)
            return checkpoint_pass(run, *tensors)

    def head_states(self, h_TBD: Tensor, rope: Tensor, kv: FinalKV | None = None) -> Tensor:
        """Coda and final norm. ``kv`` (``kv_training: last_loop``): while capturing, keep each coda layer's
        K/V; else each coda layer attends to earlier tokens' captured K/V and the token's own."""
        layer: Any
        for layer in self.coda:
            number = _layer_number(layer)
            with fp8_context(self.config, number):
                if kv is not None and kv.capture:
                    kv.kv[number] = project_kv(layer, h_TBD, rope)
                if kv is not None and not kv.capture:
                    h_TBD = layer._forward_mlp(mixed_attention(layer, h_TBD, rope, kv, number))
                else:
                    h_TBD, _ = layer(h_TBD, attention_mask=None, rotary_pos_emb=rope)
        return self.final_layernorm(h_TBD)

    def set_vocab_shard(self, start: int, end: int) -> None:
        """This rank's slice [start, end) of the padded vocabulary (set by ``parallel/``): ids at or
        beyond ``cfg.vocab_size`` are padding and get -inf logits, so they take no probability mass
        (otherwise the loss at init carries log(padded/real) extra nats and training must learn to
        push them down)."""
        ids = torch.arange(start, end)
        self.register_buffer("pad_mask_V", ids >= self.cfg.vocab_size, persistent=False)
        # decided here on the host, once: a check of the (device) buffer per exit was a host sync (issue 31)
        self.vocab_shard_padded = end > self.cfg.vocab_size

    def logits(self, h_TBD: Tensor) -> Tensor:
        """Vocab-parallel logits ``[T, B, V/tp]`` (sequence gathered under sequence parallelism)."""
        weight = self.shared_embedding_or_output_weight() if self.cfg.tie_embeddings else None
        logits_TBV, _ = self.output_layer(h_TBD, weight=weight)
        mask = getattr(self, "pad_mask_V", None)
        if mask is not None and getattr(self, "vocab_shard_padded", True):
            logits_TBV = logits_TBV.masked_fill(mask.to(logits_TBV.device), float("-inf"))
        return logits_TBV

    @_in_fp8_forward
    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        *,
        loops: int | None = None,
        exits: Sequence[int] = (),
        sync_loops: int | None = None,
        exit_axis: Literal["loop", "layer"] = "loop",
    ) -> dict[int, Tensor]:
        """Run ℓ = ``loops`` passes (default L_max).

        Returns ``{exit: tensor}`` for ℓ and every extra exit in ``exits`` (< ℓ): per-token losses
        ``[B, T]`` when ``labels`` are given, else full-vocabulary logits ``[B, T, V]`` (the padded
        vocabulary entries beyond ``cfg.vocab_size`` are dropped).
        ``exit_axis="layer"`` (a non-looped stack, ℓ = 1): ``exits`` are core layers k, and the result holds
        exactly those (:meth:`run_layers`).
        """
        loops = self.cfg.max_loops if loops is None else loops
        ghost = None
        if exit_axis == "layer":
            if loops != 1:
                raise ValueError(f"exit_axis=layer runs one pass through the stack (loops=1), got loops={loops}")
            states = self.run_layers(input_ids, exits=exits)
        else:
            all_exits = sorted({*exits, loops})
            if all_exits[0] < 1:
                self.cfg.check_loops(all_exits[0])
            states, ghost = self.run_loops(input_ids, loops=loops, exits=all_exits, sync_loops=sync_loops)
        out: dict[int, Tensor] = {}
        for ell, h_TBD in states.items():
            logits_TBV = self.logits(h_TBD)
            if labels is None:
                full_TBV = tensor_parallel.gather_from_tensor_model_parallel_region(logits_TBV)
                out[ell] = full_TBV[..., : self.cfg.vocab_size].transpose(0, 1).contiguous()
            else:
                out[ell] = self.compute_language_model_loss(labels, logits_TBV)
        if ghost is not None:  # keep the ghost MoE calls in the graph: their backward all-to-alls must run
            out[loops] = out[loops] + 0.0 * ghost
        return out

    @_in_fp8_forward
    def forward_decider(self, input_ids: Tensor, labels: Tensor) -> tuple[dict[int, Tensor], Tensor] | PerTokenRun:
        """Decider training (TaH2): one L_max run with an exit at every pass.

        Returns (per-token LM losses ``[B, T]`` at every exit 1..L_max, continue logits ``[L-1, T, B]``
        after passes 0..L_max-2; sequence-first and, under sequence parallelism, this rank's shard).
        With ``backbone: frozen`` the decider reads detached states: its loss cannot reach the LM.
        """
        if self.decider is None:
            raise RuntimeError("forward_decider needs a model built with a decider")
        if self.decider.cfg.backbone == "per_token":  # TaH2 joint post-training under per-token depth
            if self.config.tensor_model_parallel_size != 1 or self.cfg.kv_training != "same_pass":
                raise ConfigError(
                    "decider.backbone=per_token: runs with parallel tensor=1 and model.kv_training="
                    "same_pass (use backbone: joint for tensor parallelism)"
                )
            return run_per_token(
                self, self.decider, input_ids, lambda h: self.compute_language_model_loss(labels, self.logits(h))
            )
        loops = self.cfg.max_loops
        keep: list[Tensor] = []
        states, _ = self.run_loops(input_ids, loops=loops, exits=range(1, loops + 1), keep=keep)
        losses = {ell: self.compute_language_model_loss(labels, self.logits(h)) for ell, h in states.items()}
        emb_TBD, passes = keep[0], keep[1:]
        frozen = self.decider.cfg.backbone == "frozen"
        logits = [
            self.decider(h.detach() if frozen else h, emb_TBD.detach() if frozen else emb_TBD, j)
            for j, h in enumerate(passes[:-1])
        ]
        return losses, torch.stack(logits)


class GhostJoin(torch.autograd.Function):
    """``GhostJoin.apply(h, ghost)``: the value of ``h``; backward hands ``h`` its gradient unchanged and ``ghost``
    an all-zero one, so the ghost passes behind it run their backward (and its collectives) contributing nothing."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, ghost: Tensor) -> Tensor:
        return h.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, torch.zeros_like(grad)


@contextlib.contextmanager
def _without_router_losses(routers: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Routers in eval mode (megatron adds no aux/z loss and logs none outside training); restored after."""
    was = [r.training for r in routers]
    for r in routers:
        r.training = False
    try:
        yield
    finally:
        for r, t in zip(routers, was, strict=True):
            r.training = t


def _refuse_mode_attribute(attribute: str, mode: str) -> None:
    """A run mode set as an attribute: refused, so that no caller sets a mode no forward reads (issue 34, item 2)."""
    raise AttributeError(
        f"LoopedMoEModel.{attribute} is a run mode: pass modes=RunModes({mode}=...) to the constructor "
        f"(build_model) or call model.set_modes({mode}=...)"
    )


def _layer_number(layer: Any) -> int:
    """megatron's global 1-based layer number of a built ``TransformerLayer``."""
    return int(layer.layer_number)
