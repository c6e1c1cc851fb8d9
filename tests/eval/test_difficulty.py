"""Loss and accuracy per ℓ and per true difficulty (issue 32): the per-level numbers add up to the model's own
held-out loss, count exactly the labelled tokens, and score a token under the difficulty of the token predicted."""

from __future__ import annotations

import pytest
import torch

from elastic_pretrain.eval.difficulty import ANSWERS, by_difficulty
from elastic_pretrain.eval.loss import loss_by_loops

TOL = dict(rtol=1e-5, atol=1e-6)  # fp32 logits: the model's own vocab-parallel CE vs log-softmax of the same logits


def test_per_difficulty_numbers_add_up_to_the_held_out_loss(model) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 257, (6, 17), generator=gen)
    labels = torch.randint(0, 4, (6, 17), generator=gen) * (torch.rand(6, 17, generator=gen) < 0.5)
    tab = by_difficulty(model, tokens, labels, batch_size=4)
    assert tab.loops == [1, 2, 3, 4] and tab.levels == sorted(labels[:, 1:].unique().tolist())
    whole = loss_by_loops(model, tokens, batch_size=4)
    for ell in tab.loops:
        cells = tab.cells[ell]
        for level in tab.levels:  # a prediction counts under its label's difficulty: the column it predicts
            assert cells[level].count == int((labels[:, 1:] == level).sum())
        assert cells[ANSWERS].count == int((labels[:, 1:] > 0).sum())
        mean = sum(cells[k].loss * cells[k].count for k in tab.levels) / labels[:, 1:].numel()
        torch.testing.assert_close(torch.tensor(mean), torch.tensor(whole[ell]), **TOL)
        with torch.no_grad():  # accuracy of the answers: argmax of the ℓ-pass logits
            logits = model(tokens[:, :-1], loops=ell)[ell]
        hit = (logits.argmax(-1) == tokens[:, 1:])[labels[:, 1:] > 0].double().mean().item()
        assert cells[ANSWERS].accuracy == pytest.approx(hit, abs=1e-12)
    text = tab.markdown("loss") + tab.markdown("accuracy")
    assert "| ℓ | d=1 (" in text and "answers (" in text and "ordinary (" in text and text.count("\n| 4 | ") == 2
    metrics = tab.metrics()
    assert metrics["eval/loss_loops_4_difficulty_answers"] == tab.cells[4][ANSWERS].loss
    assert set(tab.to_json()["2"]) == {"0", "1", "2", "3", "answers"}


def test_a_difficulty_that_does_not_label_the_tokens_is_refused(model) -> None:
    with pytest.raises(ValueError, match=r"difficulty \(2, 9\) does not label tokens \(2, 8\)"):
        by_difficulty(model, torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 9, dtype=torch.long))


@pytest.mark.slow
def test_eval_command_reports_per_difficulty_numbers_on_the_depth_pays_corpus(tmp_path) -> None:
    import yaml

    from elastic_pretrain.config import load_yaml
    from tests.conftest import REPO
    from tests.eval.conftest import cli

    raw = load_yaml(REPO / "data" / "depth-pays.yaml")
    out = str(tmp_path / "depth-pays")
    raw["streams"], raw["validation"] = [{"path": out}], {"path": out, "split": "val"}
    raw["prepare"].update(output=out, max_tokens=40_000, val_fraction=0.1)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    cli("prepare-data", str(recipe), "--quiet")
    run = tmp_path / "run"
    cli("train", "jobs/experiments/depth-premise/fixed-1.yaml", "--run-dir", str(run), f"data={recipe}",
        "train.steps=2", "train.warmup_steps=1", "train.eval_sequences=4")  # fmt: skip
    proc = cli("eval", str(run), "--data", str(recipe), "--sequences", "8", "--out", str(tmp_path / "eval"))
    report = (tmp_path / "eval" / "eval.md").read_text()
    assert "loss per true difficulty" in report and "accuracy per true difficulty" in report
    assert "| ℓ | d=1 (" in report and "answers (" in report and report.count("\n| 4 | ") == 3  # curve + 2 tables
    assert "loss per true difficulty" in proc.stdout
