"""Loss and accuracy per ℓ and per true difficulty (issue 32): the per-level numbers add up to the model's own
held-out loss, count exactly the labelled tokens, and score a token under the difficulty of the token predicted."""

from __future__ import annotations

import pytest
import torch

from elastic_pretrain.eval.difficulty import ANSWERS, by_difficulty, passes_by_difficulty, spearman
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


def test_spearman_ranks_with_ties_and_refuses_mismatched_shapes() -> None:
    t = torch.tensor
    assert spearman(t([1.0, 2, 3, 4]), t([1.0, 3, 2, 4])) == pytest.approx(0.8, abs=1e-12)  # 1 - 6·2/(4·15)
    assert spearman(t([1.0, 1, 2]), t([1.0, 2, 3])) == pytest.approx(1.5 / 3**0.5, abs=1e-12)  # tie: mean rank 1.5
    assert spearman(t([3.0, 2, 1]), t([1.0, 5, 9])) == pytest.approx(-1.0, abs=1e-12)
    assert spearman(t([2.0, 2, 2]), t([1.0, 2, 3])) == 0.0  # constant: no ordering to agree with
    with pytest.raises(ValueError, match="not two equal 1-D tensors"):
        spearman(t([1.0, 2]), t([1.0, 2, 3]))


def test_passes_are_counted_under_the_difficulty_of_the_token_they_predict(model) -> None:
    """A stop rule that reads the *input* token (through its embedding) and runs exactly as many passes as the
    *next* token's difficulty: mean passes per level equal the level and ρ = 1 only if each prediction's passes
    are grouped under its label's difficulty (``difficulty[:, 1:]``), not its input's."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 257, (5, 33), generator=gen)
    need = torch.arange(257) % 4 + 1  # passes the token after id needs: 1..4 = L_max
    difficulty = torch.zeros_like(tokens)
    difficulty[:, 1:] = need[tokens[:, :-1]] * (tokens[:, :-1] % 3 != 0)  # a third are ordinary (0: one pass)
    with torch.no_grad():
        table_VD = model.embedding(input_ids=torch.arange(257)[None], position_ids=None)[:, 0]

    def stop(h_SBD, emb_SBD, j):  # stop after pass j once j + 1 passes cover the next token's difficulty
        ids_SB = torch.cdist(emb_SBD.flatten(0, 1)[None], table_VD[None])[0].argmin(-1).view(emb_SBD.shape[:2])
        return j + 1 >= need[ids_SB] * (ids_SB % 3 != 0)

    got = passes_by_difficulty(model, stop, tokens, difficulty, threshold=0.5)
    levels = sorted(difficulty[:, 1:].unique().tolist())
    assert levels == [0, 1, 2, 3, 4]
    assert got.mean_passes == {0: 1.0, 1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}
    assert got.count == {k: int((difficulty[:, 1:] == k).sum()) for k in levels}
    assert got.rho_answers == pytest.approx(1.0, abs=1e-12)
    assert 0.9 < got.rho_all < 1.0  # ordinary tokens and difficulty 1 both run one pass: tied, not ordered
    assert got.to_json()["mean_passes"]["4"] == 4.0 and got.row([1, 4, 5])[2] == ""
    with pytest.raises(ValueError, match="does not label tokens"):
        passes_by_difficulty(model, stop, tokens, difficulty[:, 1:], threshold=0.5)


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
