"""Routing health per (core layer, pass) — Foil: watch routing *confidence*, not only load balance.

A :class:`RoutingProbe` is attached to the shared routers while one forward runs (every N steps); it
recomputes the router logits of the tokens it sees (no grad, cheap) and accumulates, per (layer, pass),
confidence, top-k margin, entropy, load CV, MaxVio and top-k overlap with pass 0.
docs/elastic-depth.md, "Routing health (Foil)" (each statistic defined).
Shapes: ``S`` = number of statistics, ``K`` core layers, ``L`` passes, ``N`` tokens, ``E`` experts.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

STATS = ("confidence", "margin", "entropy", "load_cv", "maxvio", "overlap")


class RoutingProbe:
    """Accumulates per-(layer, pass) routing statistics as sums + token counts (reducible over DP)."""

    def __init__(self, num_layers: int, max_loops: int, top_k: int) -> None:
        self.top_k = top_k
        self.sums_KLS = torch.zeros(num_layers, max_loops, len(STATS), dtype=torch.float64)
        self.counts_KL = torch.zeros(num_layers, max_loops, dtype=torch.float64)
        self._pass0_topk: dict[tuple[int, Hashable], torch.Tensor] = {}
        self._where: tuple[Hashable, int] | None = None
        self._handles: list[Any] = []

    def attach(self, routers: list[torch.nn.Module], *, first: int = 0) -> None:
        """Observe ``routers`` as core layers ``first, first+1, …`` (a pipeline stage holds a range)."""
        for layer, router in enumerate(routers, start=first):
            self._handles.append(router.register_forward_hook(self._hook(layer, router)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def at(self, pass_idx: int | None, key: Hashable = None) -> None:
        """The pass the next router calls belong to (None: ghost calls, not observed), and the micro-batch
        (``key``: the pipeline schedule interleaves micro-batches, and overlap compares with pass 0 of
        the same one)."""
        self._where = None if pass_idx is None else (key, pass_idx)

    def _hook(self, layer: int, router: Any) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self._where is None:
                return
            x = args[0]
            with torch.no_grad():
                logits_NE = router.gating(x.reshape(-1, x.shape[-1]).detach()).float()
                self.observe(layer, self._where[1], logits_NE, key=self._where[0])

        return hook

    def observe(self, layer: int, pass_idx: int, logits_NE: torch.Tensor, key: Hashable = None) -> None:
        probs_NE = torch.softmax(logits_NE, dim=-1)
        n, e = probs_NE.shape
        k = min(self.top_k, e)
        top_NK = probs_NE.topk(min(k + 1, e), dim=-1)
        margin = (top_NK.values[:, k - 1] - top_NK.values[:, k]) if k < e else top_NK.values[:, k - 1]
        topk_NK = top_NK.indices[:, :k]
        dev = logits_NE.device  # the router's device: CUDA kernels do not mix in CPU buffers
        load_E = torch.zeros(e, dtype=torch.float64, device=dev).index_add_(
            0, topk_NK.reshape(-1), torch.ones(topk_NK.numel(), dtype=torch.float64, device=dev)
        )
        mean_load = load_E.mean()
        if pass_idx == 0:
            self._pass0_topk[(layer, key)] = topk_NK
            overlap = torch.ones((), device=dev)
        else:
            ref = self._pass0_topk.get((layer, key))
            if ref is not None and ref.shape == topk_NK.shape:
                overlap = _topk_overlap(topk_NK, ref)
            else:
                overlap = torch.ones((), device=dev)
        entropy = -(probs_NE * probs_NE.clamp_min(1e-12).log()).sum(-1)
        values = torch.stack(
            [
                probs_NE.max(-1).values.double().mean(),
                margin.double().mean(),
                entropy.double().mean(),
                load_E.std(unbiased=False) / mean_load,
                load_E.max() / mean_load - 1,
                overlap.double(),
            ]
        )
        if self.sums_KLS.device != dev:  # first observation: the sums live where the router runs
            self.sums_KLS, self.counts_KL = self.sums_KLS.to(dev), self.counts_KL.to(dev)
        self.sums_KLS[layer, pass_idx] += values * n
        self.counts_KL[layer, pass_idx] += n

    def means(self) -> dict[tuple[int, int], dict[str, float]]:
        """{(layer, pass): {stat: mean}} over what was observed."""
        out = {}
        for layer in range(self.counts_KL.shape[0]):
            for p in range(self.counts_KL.shape[1]):
                n = float(self.counts_KL[layer, p])
                if n > 0:
                    out[(layer, p)] = {s: float(self.sums_KLS[layer, p, i] / n) for i, s in enumerate(STATS)}
        return out


def _topk_overlap(a_NK: torch.Tensor, b_NK: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of |topk_a ∩ topk_b| / k."""
    same = (a_NK.unsqueeze(-1) == b_NK.unsqueeze(-2)).any(-1)
    return same.double().mean()
