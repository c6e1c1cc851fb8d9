"""``experiment NAME --from-json`` (issue 32 item 2): a report re-decided from its stored numbers equals a fresh
render of the same numbers with today's claims — premise gates, labels and metrics recomputed from stored numbers
(``Experiment.rescore``) included — and a report that is not one, or of another experiment, is refused in one line.

Real runs' configs (the route-replay job set, replayed for the training-compute column), real models for the
parameter counts, the real report writer; the per-seed numbers are made up (nothing trains)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from elastic_pretrain.errors import UserError
from elastic_pretrain.experiments.report import Outcome, write_report
from elastic_pretrain.experiments.rerender import note, rerender
from elastic_pretrain.experiments.runner import Context, Experiment, Findings, Run
from elastic_pretrain.experiments.stats import Claim, Metrics, evaluate, paired
from elastic_pretrain.job_loader import load_job
from tests.conftest import REPO

SET = REPO / "jobs/experiments/route-replay"
ARMS = ("replay-off", "replay-on")
COMMAND = "elastic-pretrain experiment route-replay --seeds 3"

# yesterday's claim: replay costs loss at ℓ = 4 (the interval excludes 0: "yes")
COSTS = Claim(paper='"raising four-loop validation loss by 0.0038"', source="seeds/003 (ELR)", magnitude="+0.0038",
              measure="replay-on minus replay-off loss at ℓ = 4", value=paired("replay-on", "replay-off", "loss@4"),
              expect="positive")  # fmt: skip
# today's: the same claim gated on depth paying (a metric recomputed from the stored numbers), and a label
PAYS = Claim(paper="depth pays", source="seeds/003 (ELR)", magnitude="m", measure="replay-off depth gain",
             value=lambda m: m["replay-off"]["depth_gain"], expect="negative", kind="premise")  # fmt: skip
CHECK = Claim(paper="c", source="seeds/003 (ELR)", magnitude="m", measure="time ratio of the reference",
              value=lambda m: m["replay-off"]["time_ratio@max"] - 1.0, expect="equal", margin=1e-9,
              kind="implementation check")  # fmt: skip


def _numbers(seed: int) -> dict[str, Any]:
    """One seed's stored numbers: the loss by ℓ of both arms (ℓ = 4 no better than ℓ = 1: depth does not pay)."""
    off = {1: 2.0 + seed / 1000, 2: 1.99, 3: 1.995, 4: 2.0 + seed / 1000 + (seed % 2) * 0.001}
    return {"loss_by_loops": {"replay-off": off, "replay-on": {e: v + 0.01 for e, v in off.items()}}}


def _rescore(numbers: dict[str, Any], metrics: Metrics) -> Metrics:
    """From stored numbers (int ℓ keys here, str ones from JSON): the reference arm's depth gain."""
    loss = {int(k): float(v) for k, v in numbers["loss_by_loops"]["replay-off"].items()}
    return {**metrics, "replay-off": {**metrics["replay-off"], "depth_gain": loss[4] - loss[1]}}


def _metrics(numbers: dict[str, Any]) -> Metrics:
    out = {a: {f"loss@{e}": float(v) for e, v in numbers["loss_by_loops"][a].items()} for a in ARMS}
    out["replay-off"]["time_ratio@max"] = 1.0
    return out


YESTERDAY = Experiment(name="route-replay", title="Route replay", question="Does it cost loss?",
                       analyse=lambda ctx: None, claims=(COSTS,))  # type: ignore[arg-type,return-value]  # fmt: skip
TODAY = dataclasses.replace(YESTERDAY, question="Does it cost loss, where depth pays?", rescore=_rescore,
                            claims=(PAYS, dataclasses.replace(COSTS, premise=PAYS), CHECK))  # fmt: skip


def _outcome(experiment: Experiment, tmp: Path) -> tuple[Context, Outcome]:
    """The runs of seeds 1234..1236 (configs from the job files, summaries as training writes them), the first
    seed's context with real models, and each seed's findings as ``experiment``'s analysis would give them."""
    from elastic_pretrain.parallel.config import ParallelConfig
    from elastic_pretrain.parallel.megatron import build_model

    runs = [
        Run(a, load_job(SET / f"{a}.yaml", [f"train.seed={s}"], values={"run_dir": str(tmp / f"{a}-{s}")}),
            SET / f"{a}.yaml", tmp / f"{a}-{s}", {"steps": 200, "tokens": 409_600, "elapsed_s": 60.0}, "trained")
        for s in (1234, 1235, 1236) for a in ARMS
    ]  # fmt: skip
    ctx = Context(experiment, runs[:2], quick=False)
    for r in ctx.runs:  # the parameter counts come from the models (real ones, initial weights)
        ctx._models[r.name] = build_model(r.job.model, ParallelConfig())
    findings = {}
    for s in (1234, 1235, 1236):
        numbers = _numbers(s)
        metrics = _metrics(numbers)
        metrics = experiment.rescore(numbers, metrics) if experiment.rescore else metrics
        findings[s] = Findings(tables=["| a |\n|---|\n| 1 |"], reading=["a reading"], numbers=numbers,
                               plot=lambda path: path.write_bytes(b"png"), metrics=metrics)  # fmt: skip
    claims = [evaluate(c, {s: f.metrics for s, f in findings.items()}) for c in experiment.claims]
    return ctx, Outcome(experiment, runs, findings, claims, COMMAND, False, 1, 100.0, 90.0)


def test_a_report_decided_again_from_its_json_equals_a_fresh_render(tmp_path: Path, mesh1) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    ctx, outcome = _outcome(YESTERDAY, tmp_path)
    md = write_report(old, ctx, outcome)
    assert "**yes** —" in md.read_text()  # yesterday's verdict: replay costs loss
    fresh = write_report(new, *_outcome(TODAY, tmp_path))
    command = "elastic-pretrain experiment route-replay --from-json old/route-replay.json"
    assert rerender(TODAY, old / "route-replay.json", command=command) == md
    text = md.read_text()
    line = note("route-replay.json", command)
    assert text.count(line) == 1 and "**not resolved — premise absent**" in text and "**yes** —" not in text
    assert text.replace(line + "\n\n", "") == fresh.read_text()  # everything else: exactly today's fresh render
    redone, made = json.loads(md.with_suffix(".json").read_text()), json.loads(fresh.with_suffix(".json").read_text())
    assert redone.pop("rerendered") == command
    assert redone == made  # claims (kinds, premises, values, verdicts) and every seed's metrics
    # a second pass changes nothing
    rerender(TODAY, old / "route-replay.json", command=command)
    assert md.read_text() == text


def test_from_json_refuses_what_is_not_the_experiments_report(tmp_path: Path) -> None:
    from elastic_pretrain.cli import main

    src = REPO / "docs/results"
    for name in ("route-replay", "flattening"):
        for ext in ("json", "md"):
            shutil.copy(src / f"{name}.{ext}", tmp_path / f"{name}.{ext}")
    with pytest.raises(UserError, match=r"a report of 'flattening', not of 'route-replay': name its own JSON"):
        rerender(TODAY, tmp_path / "flattening.json", command="x")
    with pytest.raises(UserError, match=r"no such file"):
        rerender(TODAY, tmp_path / "none.json", command="x")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match=r"not a JSON report"):
        rerender(TODAY, tmp_path / "bad.json", command="x")
    data = json.loads((tmp_path / "route-replay.json").read_text())
    data["metrics_by_seed"]["1234"]["replay-on"]["loss@4"] = "2.0"
    (tmp_path / "route-replay.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match=r"metrics_by_seed\['1234'\] is not arm -> metric -> number"):
        rerender(TODAY, tmp_path / "route-replay.json", command="x")
    (tmp_path / "flattening.md").unlink()
    cmd = ["experiment", "flattening", "--from-json", str(tmp_path / "flattening.json")]
    assert main(cmd) == 2  # the one-line error of the command (printed by cli.main)
    assert main([*cmd, "train.steps=5"]) == 2 and main(["experiment", "all", "--from-json", "x.json"]) == 2


def test_rerender_rewrites_every_stored_report_from_its_own_numbers(tmp_path: Path) -> None:
    """``--rerender`` over every report of docs/results: each decided again with today's claims, nothing else."""
    from elastic_pretrain.cli import main

    shutil.copytree(REPO / "docs/results", tmp_path / "results")
    assert main(["experiment", "all", "--rerender", "--out", str(tmp_path / "results")]) == 0
    for path in sorted((tmp_path / "results").glob("*.json")):
        data = json.loads(path.read_text())
        assert data["rerendered"].endswith(f"--from-json {path}")
        # nothing but the claim and seed-noise tables (and the question above them) changed in the report
        before = (REPO / "docs/results" / path.name).with_suffix(".md").read_text()
        after = path.with_suffix(".md").read_text()
        assert (
            before.split("## How this report was made")[1].split("## Seed noise")[0]
            == after.split("## How this report was made")[1].split("## Seed noise")[0]
        )
        assert before.split("## Setup", 1)[1] == after.split("## Setup", 1)[1]


def test_rerender_all_skips_an_experiment_never_run_and_refuses_an_empty_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from elastic_pretrain.cli import main

    shutil.copytree(REPO / "docs/results", tmp_path / "results")
    (tmp_path / "results" / "kv-cache.json").unlink()
    assert main(["experiment", "all", "--rerender", "--out", str(tmp_path / "results")]) == 0
    assert f"kv-cache: no stored report {tmp_path / 'results' / 'kv-cache.json'}" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["experiment", "all", "--rerender", "--out", str(tmp_path / "empty")]) == 2
    assert "--rerender: no stored report in" in capsys.readouterr().err


def _without_arm(doc: Any, arm: str) -> Any:
    """A stored report's numbers as a report from before ``arm`` (a job-name prefix) existed stored them."""
    if isinstance(doc, dict):
        return {k: _without_arm(v, arm) for k, v in doc.items() if not k.startswith(arm)}
    if isinstance(doc, list):
        return [
            _without_arm(v, arm) for v in doc if not (isinstance(v, dict) and str(v.get("job", "")).startswith(arm))
        ]
    return doc


def test_rerender_of_reports_stored_before_new_arms_reads_them_not_measured(tmp_path: Path) -> None:
    """late-switch's tied-* arms and flattening's flatten1-untied (issue 32 item 3) were not in the reports stored
    before them: their claims read "not measured" (or premise absent, the premise not measured); the other rows
    are decided."""
    from elastic_pretrain.experiments.registry import EXPERIMENTS

    for name, arm in (("late-switch", "tied-"), ("flattening", "flatten1-untied")):
        shutil.copy(REPO / "docs/results" / f"{name}.md", tmp_path / f"{name}.md")
        stored = json.loads((REPO / "docs/results" / f"{name}.json").read_text())
        (tmp_path / f"{name}.json").write_text(json.dumps(_without_arm(stored, arm)))
        rerender(EXPERIMENTS[name], tmp_path / f"{name}.json", command="x")
        rows = json.loads((tmp_path / f"{name}.json").read_text())["claims"]
        new = [r for r in rows if arm in r["measure"]]
        assert new and all(r["interval"] is None and not r["values"] for r in new), name
        assert all(f"no '{arm}" in r["reason"] for r in new), name
        assert all(r["verdict"] == "not measured" or f"not measured: no '{arm}" in r["reason"] for r in new), name
        assert any(r["values"] for r in rows if r not in new), name  # the arms that ran are still decided
        assert "**not measured** — no '" in (tmp_path / f"{name}.md").read_text()
