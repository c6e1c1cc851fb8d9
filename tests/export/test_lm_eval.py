"""lm-eval-harness through its Hugging Face wrapper on an export, at several loop counts, offline, on the
project's local multiple-choice task: every log-likelihood lm-eval computes equals a direct computation
with the project's megatron model, and so do acc / acc_norm."""

from __future__ import annotations

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before lm_eval/datasets are imported: no network
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lm_eval", reason="the lm-eval extra is not installed (requirements/lock-cpu.txt has it)")

from elastic_pretrain.export.tasks.elastic_tiny_mc import docs
from elastic_pretrain.model.config import DeciderConfig
from tests.export.conftest import build, tiny

TASK = "elastic_tiny_mc"


@torch.no_grad()
def direct_loglikelihoods(net: Any, loops: int) -> list[list[float]]:
    """Σ log p(continuation byte | context, earlier bytes) per choice, with the project's model. As lm-eval
    does (``_encode_pair``), whitespace that ends the context is scored as part of the continuation."""
    out = []
    for doc in docs():
        context = doc["context"].rstrip()
        spaces = doc["context"][len(context) :]
        ctx = list(context.encode("utf-8"))
        row = []
        for choice in doc["choices"]:
            cont = list((spaces + choice).encode("utf-8"))
            logits = net(torch.tensor([ctx + cont]), loops=loops)[loops][0]
            logp = torch.log_softmax(logits.double(), dim=-1)
            row.append(float(sum(logp[len(ctx) - 1 + i, c] for i, c in enumerate(cont))))
        out.append(row)
    return out


def accuracies(lls: list[list[float]]) -> tuple[float, float]:
    """acc and acc_norm as lm-eval defines them (acc_norm: ll divided by the choice's length in characters)."""
    acc = norm = 0
    for doc, row in zip(docs(), lls):
        acc += max(range(len(row)), key=row.__getitem__) == doc["gold"]
        per_char = [ll / len(c) for ll, c in zip(row, doc["choices"])]
        norm += max(range(len(row)), key=per_char.__getitem__) == doc["gold"]
    return acc / len(lls), norm / len(lls)


def test_lm_eval_scores_equal_a_direct_computation(mesh1, tmp_path: Path) -> None:
    from elastic_pretrain.export.hf_export import write_export
    from elastic_pretrain.export.lm_eval_run import run_lm_eval

    net = build(tiny(route_replay=True), decider=DeciderConfig())
    write_export(net, __import__("elastic_pretrain.data.config", fromlist=["TokenizerConfig"]).TokenizerConfig(),
                 tmp_path / "hf", decider=DeciderConfig())  # fmt: skip
    result = run_lm_eval(tmp_path / "hf", [TASK], [1, 2, 4], batch_size=4)
    assert result.loops == [1, 2, 4]
    assert result.flops_per_token[1] < result.flops_per_token[2] < result.flops_per_token[4]
    differ = 0
    for ell in (1, 2, 4):
        samples = sorted(result.samples[ell][TASK], key=lambda s: s["doc_id"])
        assert len(samples) == len(docs()) == 16
        theirs = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
        ours = direct_loglikelihoods(net, ell)
        torch.testing.assert_close(
            torch.tensor(theirs, dtype=torch.float64), torch.tensor(ours, dtype=torch.float64), rtol=1e-5, atol=1e-4
        )
        acc, acc_norm = accuracies(ours)
        assert result.scores[(TASK, "acc")][ell] == pytest.approx(acc)
        assert result.scores[(TASK, "acc_norm")][ell] == pytest.approx(acc_norm)
        differ += ours != direct_loglikelihoods(net, 1)
    assert differ == 2  # the loop count changes what is scored (ℓ=2, ℓ=4 differ from ℓ=1)
    table = result.markdown()
    assert "| elastic_tiny_mc | acc |" in table and "| compute | MFLOPs/token |" in table and "ℓ=4" in table
