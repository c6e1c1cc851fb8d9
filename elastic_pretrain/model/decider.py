"""The iteration decider (TaH2): after pass j, should this token run another pass?

Shape legend: B batch, T sequence, D hidden, L passes, N tokens (flattened), S new tokens.

A small head reads (hidden state after pass j, the token's input embedding, the pass index) and
outputs a *continue* probability. It is trained in a post-training stage with **lookahead labels**
(TaH2): run L_max passes with an exit at every pass, take each token's cross-entropy CE_j at exit j
and the gain g_j = CE_j − CE_{j+1} of one more pass; among the tokens of the batch with positive
gain, sorted by gain (largest first), the smallest prefix that covers ``coverage`` of the total
positive gain is labelled "continue", every other token "stop". A coverage below 1 drops the long
tail of tokens that gain almost nothing, which is where the compute saving comes from. The loss is
a weighted binary cross-entropy (``pos_weight`` on "continue") added to the LM loss with
``loss_weight``.

Adaptive-depth inference: a token stops at the first pass whose continue probability is below
``threshold`` (or at L_max); its hidden state is frozen and its K/V of the last pass it ran keep
serving the later passes of other tokens (``model/inference.py``). Threshold 0 runs every token to
L_max (the fixed-depth model); a threshold above 1 stops every token after one pass.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from elastic_pretrain.model.config import DeciderConfig  # re-exported: the config lives with ModelConfig
from elastic_pretrain.model.inference import StopFn
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
        z = F.silu(self.fc1(z) + self.pass_emb.weight[pass_idx])
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
def lookahead_labels(ce_L_N: Tensor, coverage: float) -> Tensor:
    """Continue labels ``[L-1, ...]`` from per-token CE at each pass ``[L, ...]`` (TaH2 lookahead).

    Per pass j: gain = CE_j − CE_{j+1}; tokens with positive gain are sorted by gain (largest first,
    ties in token order) and the shortest prefix whose gain sum reaches ``coverage`` × the total
    positive gain is labelled True. No positive gain → no True label at that pass.
    """
    if ce_L_N.shape[0] < 2:
        raise ValueError("lookahead labels need the CE of at least two passes")
    gain = (ce_L_N[:-1] - ce_L_N[1:]).double().flatten(1)  # [L-1, N]
    pos = gain.clamp(min=0)
    sorted_g, order = torch.sort(pos, dim=1, descending=True, stable=True)
    csum = torch.cumsum(sorted_g, dim=1)
    before = torch.cat([torch.zeros_like(csum[:, :1]), csum[:, :-1]], dim=1)
    need = coverage * csum[:, -1:]
    take = (sorted_g > 0) & (before < need)
    labels = torch.zeros_like(take).scatter(1, order, take)
    return labels.reshape(ce_L_N[:-1].shape)


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
    """LM loss at L_max + weighted BCE of the decider against lookahead labels from this batch.

    One L_max run of the model with an exit at every pass (``run_loops``) gives CE_j for all j (with
    active conditioning its target is L_max, the same target adaptive inference uses). ``decider`` need
    not be the model's own (``model.decider``): a head can be trained on a model built without one.
    One process (TP = 1): the job's distributed loss is ``train/decider.py``'s, tested against this.
    """
    cfg = decider.cfg
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
    lm = ce_L_BT[-1].mean()
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


def passes_at(logit_L_N: Tensor, threshold: float) -> Tensor:
    """Passes each token runs when it stops at the first pass whose continue probability is < threshold,
    read off continue logits ``[L-1, ...]`` of one full-depth run (1 + the run of leading "continue")."""
    cont = (torch.sigmoid(logit_L_N.detach().float()) >= threshold).int()
    return 1 + torch.cumprod(cont, dim=0).sum(0)


# ---------------------------------------------------------------------------------------------------
def save_decider(path: Path, decider: IterationDecider) -> None:
    """A trained decider as plain tensors + config (loads with ``weights_only``)."""
    torch.save(
        {
            "config": dataclasses.asdict(decider.cfg),
            "hidden_size": decider.norm_h.normalized_shape[0],
            "max_loops": decider.max_loops,
            "state": decider.state_dict(),
        },
        path,
    )


def load_decider(path: Path) -> IterationDecider:
    blob = torch.load(path, map_location="cpu", weights_only=True)
    decider = IterationDecider(
        DeciderConfig(**blob["config"]), hidden_size=int(blob["hidden_size"]), max_loops=int(blob["max_loops"])
    )
    decider.load_state_dict(blob["state"])
    return decider.eval()
