"""The iteration decider (TaH2): after pass j, should this token run another pass?

A small head reads (hidden state after pass j, the token's input embedding, the pass index) and outputs a
*continue* probability, trained with TaH2's **lookahead labels**: "continue" exactly when one more pass lowers
the token's loss (``coverage`` below 1 is an ablation). At inference a token stops at the first pass below
``threshold``; its hidden state is frozen and its last K/V keep serving other tokens.
docs/evaluation.md, "Iteration decider (TaH2)" (labels, loss, adaptive-depth semantics).
Shape legend: B batch, T sequence, D hidden, L passes, N tokens (flattened), S new tokens.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from elastic_pretrain.config import ConfigError
from elastic_pretrain.model.config import DeciderConfig  # re-exported: the config lives with ModelConfig
from elastic_pretrain.model.inference import StopFn
from elastic_pretrain.model.kv_training import StoppedKV
from elastic_pretrain.model.losses import token_ce

if TYPE_CHECKING:
    from elastic_pretrain.model.looped import LoopedMoEModel


class IterationDecider(torch.nn.Module):
    """(h after pass j, token embedding, j) → continue logit. Plain torch: replicated, tiny."""

    def __init__(self, cfg: DeciderConfig, *, hidden_size: int, max_loops: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.max_loops = max_loops
        self.norm_h = torch.nn.LayerNorm(hidden_size)
        self.norm_e = torch.nn.LayerNorm(hidden_size)
        self.fc1 = torch.nn.Linear(2 * hidden_size, cfg.hidden_size)
        self.pass_emb = torch.nn.Embedding(max_loops, cfg.hidden_size)
        self.fc2 = torch.nn.Linear(cfg.hidden_size, 1)
        with torch.no_grad():
            self.pass_emb.weight.normal_(0.0, 0.02)
            self.fc2.weight.normal_(0.0, 0.02)
            self.fc2.bias.zero_()  # starts at p = 0.5 everywhere

    def forward(self, h_SBD: Tensor, emb_SBD: Tensor, pass_idx: int) -> Tensor:
        """Continue logits ``[S, B]``."""
        if not 0 <= pass_idx < self.max_loops:
            raise ValueError(f"pass_idx {pass_idx} outside [0, {self.max_loops})")
        z = torch.cat([self.norm_h(h_SBD.float()), self.norm_e(emb_SBD.float())], dim=-1)
        # a call of pass_emb, not an index into its weight: parallel/overlap.py counts uses by module calls
        z = F.silu(self.fc1(z) + self.pass_emb(torch.tensor(pass_idx, device=z.device)))
        return self.fc2(z)[..., 0]

    def continue_prob(self, h_SBD: Tensor, emb_SBD: Tensor, pass_idx: int) -> Tensor:
        return torch.sigmoid(self(h_SBD, emb_SBD, pass_idx))

    def stopper(self, threshold: float | None = None) -> StopFn:
        """The stop rule for adaptive decoding: continue probability < threshold."""
        thr = self.cfg.threshold if threshold is None else threshold

        def stop(h_SBD: Tensor, emb_SBD: Tensor, pass_idx: int) -> Tensor:
            return self.continue_prob(h_SBD, emb_SBD, pass_idx) < thr

        return stop


# ---------------------------------------------------------------------------------------------------
# Lookahead labels (TaH2)
def lookahead_labels(ce_L_N: Tensor, coverage: float, active_L_N: Tensor | None = None) -> Tensor:
    """Continue labels ``[L-1, ...]`` from per-token CE at each pass ``[L, ...]`` (TaH2 lookahead).

    Per pass j: gain = CE_j − CE_{j+1}; tokens with positive gain are sorted by gain (largest first,
    ties in token order) and the shortest prefix whose gain sum reaches ``coverage`` × the total
    positive gain is labelled True. No positive gain → no True label at that pass.
    ``active_L_N`` (``[L-1, ...]``, ``backbone: per_token``): only tokens that ran pass j take part at j
    (nested labels: a token that stopped earlier is never labelled "continue" and adds no gain).
    """
    if ce_L_N.shape[0] < 2:
        raise ValueError("lookahead labels need the CE of at least two passes")
    gain = ce_L_N[:-1] - ce_L_N[1:]
    if active_L_N is not None:
        gain = torch.where(active_L_N, gain, torch.zeros_like(gain))
    return labels_from_gain(gain, coverage)


def labels_from_gain(gain_L_N: Tensor, coverage: float) -> Tensor:
    """:func:`lookahead_labels` from the gains ``[L-1, ...]`` (pooling over ranks gathers these first)."""
    gain = gain_L_N.double().flatten(1)  # [L-1, N]
    if coverage >= 1.0:  # TaH2: one more pass lowers this token's loss (no cumulative sum to round at the tail)
        return (gain > 0).reshape(gain_L_N.shape)
    pos = gain.clamp(min=0)
    sorted_g, order = torch.sort(pos, dim=1, descending=True, stable=True)
    csum = torch.cumsum(sorted_g, dim=1)
    before = torch.cat([torch.zeros_like(csum[:, :1]), csum[:, :-1]], dim=1)
    need = coverage * csum[:, -1:]
    take = (sorted_g > 0) & (before < need)
    labels = torch.zeros_like(take).scatter(1, order, take)
    return labels.reshape(gain_L_N.shape)


# ---------------------------------------------------------------------------------------------------
# Training signal
@dataclasses.dataclass
class DeciderLoss:
    """One batch of decider training. ``total`` = ``lm`` + loss_weight · ``bce``."""

    total: Tensor
    lm: Tensor  # mean CE of the L_max exit
    bce: Tensor
    ce_per_pass: list[float]
    continue_fraction: float  # share of (token, pass) labels that are "continue"
    accuracy: float  # decisions at threshold 0.5 that match the labels


def decider_loss(model: LoopedMoEModel, decider: IterationDecider, ids_BT: Tensor, labels_BT: Tensor) -> DeciderLoss:
    """LM loss at L_max (``lm_loss: every_exit``: the mean over the exits) + weighted BCE of the decider against
    lookahead labels from this batch.

    One L_max run of the model with an exit at every pass (``run_loops``) gives CE_j for all j (with
    active conditioning its target is L_max, the same target adaptive inference uses). ``decider`` need
    not be the model's own (``model.decider``): a head can be trained on a model built without one.
    One process (TP = 1): the job's distributed loss is ``train/decider.py``'s, tested against this.
    """
    cfg = decider.cfg
    if cfg.backbone == "per_token":
        return _per_token_loss(model, decider, ids_BT, labels_BT)
    loops = model.cfg.max_loops
    keep: list[Tensor] = []  # token embedding, then the hidden state after each pass
    heads, _ = model.run_loops(ids_BT, loops=loops, exits=range(1, loops + 1), keep=keep)
    vocab = model.cfg.vocab_size
    ce_L_BT = torch.stack(
        [token_ce(model.logits(heads[ell])[..., :vocab].transpose(0, 1), labels_BT) for ell in range(1, loops + 1)]
    )
    emb_TBD, states = keep[0], keep[1:]
    targets_L_BT = lookahead_labels(ce_L_BT.detach(), cfg.coverage).float()  # [L-1, B, T]
    logits = []
    for j, h_TBD in enumerate(states[:-1]):
        h_in, e_in = (h_TBD.detach(), emb_TBD.detach()) if cfg.backbone == "frozen" else (h_TBD, emb_TBD)
        logits.append(decider(h_in, e_in, j).t())  # [B, T]
    logit_L_BT = torch.stack(logits)
    bce = F.binary_cross_entropy_with_logits(
        logit_L_BT, targets_L_BT, pos_weight=torch.tensor(cfg.pos_weight, device=logit_L_BT.device)
    )
    lm = ce_L_BT[-1].mean() if cfg.lm_loss == "last" else ce_L_BT.mean()  # every_exit: every depth alike
    with torch.no_grad():
        acc = float(((logit_L_BT > 0).float() == targets_L_BT).float().mean())
    return DeciderLoss(
        total=lm + cfg.loss_weight * bce,
        lm=lm,
        bce=bce,
        ce_per_pass=[float(c.mean()) for c in ce_L_BT.detach()],
        continue_fraction=float(targets_L_BT.mean()),
        accuracy=acc,
    )


def _per_token_loss(model: LoopedMoEModel, decider: IterationDecider, ids_BT: Tensor, labels_BT: Tensor) -> DeciderLoss:
    """``backbone: per_token``: LM loss at each token's exit + BCE over the nested labels (one process)."""
    vocab = model.cfg.vocab_size
    with model.fp8_forward():  # one FP8 autocast for the run under delayed scaling (model/looped.py)
        run = run_per_token(
            model, decider, ids_BT, lambda h: token_ce(model.logits(h)[..., :vocab].transpose(0, 1), labels_BT)
        )
    targets = labels_from_gain(run.gain_LBT(), decider.cfg.coverage)
    bce_sum, count = per_token_bce(run, targets, decider.cfg.pos_weight)
    bce = bce_sum / count.clamp(min=1)
    lm = run.exit_ce_BT.mean()
    mask_LTB = run.labelled_LBT().transpose(1, 2)
    with torch.no_grad():
        t_LTB = targets.transpose(1, 2)
        correct = ((run.logit_LTB > 0) == t_LTB) & mask_LTB
        acc = float(correct.sum() / mask_LTB.sum().clamp(min=1))
    return DeciderLoss(
        total=lm + decider.cfg.loss_weight * bce, lm=lm, bce=bce,
        ce_per_pass=[float(c.mean()) for c in run.ce_L_BT],
        continue_fraction=float(t_LTB[mask_LTB].double().mean()) if bool(mask_LTB.any()) else 0.0, accuracy=acc,
    )  # fmt: skip


@dataclasses.dataclass
class PerTokenRun:
    """One L_max run under per-token depth (``backbone: per_token``): see :func:`run_per_token`."""

    exit_ce_BT: Tensor  # CE of each token's state at its exit (the LM loss; carries the gradient)
    ce_L_BT: Tensor  # [L, B, T] detached: CE of the states after pass j under per-token stopping (row L-1: exits)
    ahead_L_BT: Tensor  # [L, B, T] detached: CE had every token run pass j from its state entering it
    active_L_BT: Tensor  # [L, B, T] bool: the token ran pass j (row 0: every token)
    logit_LTB: Tensor  # [L-1, T, B] continue logits after passes 0..L-2 (the decider's live inputs)

    def labelled_LBT(self) -> Tensor:
        """Nested label mask ``[L-1, B, T]``: the decision after pass j is labelled iff the token ran pass j."""
        return self.active_L_BT[:-1]

    def gain_LBT(self) -> Tensor:
        """Lookahead gain of the decision after pass j: CE now − CE after one more pass; 0 where unlabelled."""
        gain = self.ce_L_BT[:-1] - self.ahead_L_BT[1:]
        return torch.where(self.labelled_LBT(), gain, torch.zeros_like(gain))


def run_per_token(
    model: LoopedMoEModel,
    decider: IterationDecider,
    ids_BT: Tensor,
    ce: Callable[[Tensor], Tensor],
    keep: list[Tensor] | None = None,
) -> PerTokenRun:
    """TaH2 joint post-training: L_max passes in which each token stops where the decider says.

    After pass j (j < L_max − 1) the decider's continue probability, read from the live state, decides
    (stop below ``threshold``, as served). A stopped token's hidden state is copied through every later
    pass, so its exit state reaches the head. Attention is the served one (``model/kv_training.py``:
    :class:`StoppedKV` through :func:`mixed_attention`): at pass j a later token reads a stopped token's
    K/V of the last pass it ran (what the per-loop decoder keeps for it), an active token's pass-j K/V,
    so each exit CE equals teacher-forced adaptive decoding's (``eval/adaptive.py``). A stopped token
    still runs each later pass (masked: every rank of an expert-parallel group runs the same MoE calls),
    attending to the others' served K/V and to its own pass-j K/V, which no other token sees: that pass
    is exactly its lookahead, "one more pass" for the label (the coda, which attends across tokens,
    then sees every token one pass further: ``ahead_L_BT``).
    ``ce`` maps final-norm states ``[T, B, D]`` to per-token CE ``[B, T]``. TP = 1, no sequence parallel,
    no per-pass recompute (the K/V state of the passes is carried from pass to pass).
    ``keep``: a list that receives the hidden state after each pass (stopped tokens frozen).
    """
    if model.recomputes_passes():
        raise ConfigError(
            "decider.backbone=per_token carries each token's frozen K/V from pass to pass, which a "
            "recomputed pass would not see: use train.recompute=none or selective"
        )
    cfg = decider.cfg
    loops = model.cfg.max_loops
    rope = model.rotary_pos_emb(ids_BT.shape[1])
    embedded: list[Tensor] = []
    h_TBD = model.embed(ids_BT, rope, embedded)
    emb_TBD = embedded[0]
    active_TB = torch.ones(h_TBD.shape[:2], dtype=torch.bool, device=h_TBD.device)
    ce_rows: list[Tensor] = []
    ahead_rows: list[Tensor] = []
    active_rows: list[Tensor] = []
    logits: list[Tensor] = []
    kv = StoppedKV()
    for j in range(loops):
        kv.stopped_TB = ~active_TB
        x_TBD = model.core_pass(h_TBD, j, loops=loops, rope=rope, kv=kv)
        active_rows.append(active_TB.t())
        h_TBD = torch.where(active_TB[..., None], x_TBD, h_TBD)  # stopped tokens stay frozen
        with torch.no_grad():  # the coda attends across tokens: the served states and the lookahead differ
            ahead_rows.append(ce(model.head_states(x_TBD, rope)))
            ce_rows.append(ahead_rows[-1] if bool(active_TB.all()) else ce(model.head_states(h_TBD, rope)))
        if keep is not None:
            keep.append(h_TBD)
        if j + 1 < loops:
            logit_TB = decider(h_TBD, emb_TBD, j)
            logits.append(logit_TB)
            active_TB = active_TB & (torch.sigmoid(logit_TB.detach().float()) >= cfg.threshold)
    return PerTokenRun(
        exit_ce_BT=ce(model.head_states(h_TBD, rope)),
        ce_L_BT=torch.stack(ce_rows),
        ahead_L_BT=torch.stack(ahead_rows),
        active_L_BT=torch.stack(active_rows),
        logit_LTB=torch.stack(logits),
    )


def per_token_bce(run: PerTokenRun, targets_L_BT: Tensor, pos_weight: float) -> tuple[Tensor, Tensor]:
    """(BCE summed over the labelled decisions, their count): stopped tokens' later passes have no label."""
    mask_LTB = run.labelled_LBT().transpose(1, 2)
    bce_LTB = F.binary_cross_entropy_with_logits(
        run.logit_LTB, targets_L_BT.transpose(1, 2).float(), reduction="none",
        pos_weight=torch.tensor(pos_weight, device=run.logit_LTB.device),
    )  # fmt: skip
    return torch.where(mask_LTB, bce_LTB, torch.zeros_like(bce_LTB)).sum(), mask_LTB.sum()


def passes_at(logit_L_N: Tensor, threshold: float) -> Tensor:
    """Passes each token runs when it stops at the first pass whose continue probability is < threshold,
    read off continue logits ``[L-1, ...]`` of one full-depth run (1 + the run of leading "continue")."""
    cont = (torch.sigmoid(logit_L_N.detach().float()) >= threshold).int()
    return 1 + torch.cumprod(cont, dim=0).sum(0)


# ---------------------------------------------------------------------------------------------------
def save_decider(path: Path, decider: IterationDecider) -> None:
    """A trained decider as plain tensors + config (loads with ``weights_only``), replacing ``path`` through a
    new file in the folder the caller named (files.py)."""
    from elastic_pretrain.files import atomic_file

    state = {
        "config": dataclasses.asdict(decider.cfg),
        "hidden_size": decider.norm_h.normalized_shape[0],
        "max_loops": decider.max_loops,
        "state": decider.state_dict(),
    }
    with atomic_file(Path(path), root=Path(path).parent) as f:
        torch.save(state, f)


def load_decider(path: Path, *, hidden_size: int | None = None, max_loops: int | None = None) -> IterationDecider:
    """A decider file of :func:`save_decider` (``--decider FILE``), for a model of ``hidden_size`` and
    ``max_loops`` (checked when given). Read weights-only; anything else — a pickle of objects, a file of
    another shape, a head too wide for its tensors — is one line before any module is built."""
    from elastic_pretrain.errors import UserError

    try:
        with warnings.catch_warnings():  # torch warns of a pickle protocol it did not write before refusing it
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            blob = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path}: no such decider file (give a file written by save_decider)") from None
    except Exception as err:  # a pickle of objects (weights-only refusal), not a torch file, truncated, a directory
        raise UserError(
            f"{path}: not a decider file ({_load_error(err)}); it is read weights-only, so nothing in it runs: "
            "give a file written by save_decider"
        ) from None
    try:
        decider = _decider_of(blob, hidden_size, max_loops)
        decider.load_state_dict(blob["state"])
    except (ConfigError, ValueError, TypeError, KeyError, RuntimeError) as err:
        raise UserError(
            f"{path}: not a decider file of this model ({_first_line(err)}): give a file written by save_decider for it"
        ) from None
    return decider.eval()


def _decider_of(blob: Any, hidden_size: int | None, max_loops: int | None) -> IterationDecider:
    """The (untrained) decider ``blob`` describes, after its sizes matched its tensors and the model."""
    from elastic_pretrain.config import build

    if not (isinstance(blob, dict) and isinstance(blob.get("state"), dict) and isinstance(blob.get("config"), dict)):
        raise ValueError("expected {config, hidden_size, max_loops, state}")
    cfg = build(DeciderConfig, blob["config"])
    d, loops = int(blob["hidden_size"]), int(blob["max_loops"])
    for name, got, want in (("hidden_size", d, hidden_size), ("max_loops", loops, max_loops)):
        if want is not None and got != want:
            raise ValueError(f"made for {name} {got}, the model has {want}")
    fc1, emb = blob["state"].get("fc1.weight"), blob["state"].get("pass_emb.weight")
    shapes = {"fc1.weight": (cfg.hidden_size, 2 * d), "pass_emb.weight": (loops, cfg.hidden_size)}
    for name, tensor in (("fc1.weight", fc1), ("pass_emb.weight", emb)):  # before building: sizes are the file's
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{name} is not a {shapes[name]} tensor")
    return IterationDecider(cfg, hidden_size=d, max_loops=loops)


def _load_error(err: BaseException) -> str:
    """torch's reason in one line: the weights-only unpickler's own, not the page of advice around it."""
    text = str(err)
    if "WeightsUnpickler error:" in text:
        reason = text.split("WeightsUnpickler error:", 1)[1].strip()
        return "weights-only read refused it: " + (reason.splitlines()[0][:120] if reason else "?")
    return f"{type(err).__name__}: {_first_line(err)}"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:160] if text else type(err).__name__
