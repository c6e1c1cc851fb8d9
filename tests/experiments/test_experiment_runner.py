"""The experiment command end to end (``--quick --seeds 3``, one subprocess): trains the kv-cache job set with
three seeds (its three arms, the trained last-loop mode's included), writes the report (claim table first),
tables (the parallel-prefill column included) and plot from those runs; a rerun after one job file changed
retrains that job only (every seed) and reuses the others.
Also: every experiment job file parses, and the registry names exactly the job sets that exist."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastic_pretrain.config import ConfigError, load_yaml
from elastic_pretrain.errors import UserError
from elastic_pretrain.experiments.runner import base_job, check_processes, fingerprint, job_diff, load_jobs
from elastic_pretrain.job import JobConfig, dump_job
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.provenance import code_identity, code_label, code_version
from tests.conftest import REPO
from tests.experiments.quick import quick_workspace, run_python

JOB_FILES = sorted((REPO / "jobs/experiments").glob("*/*.yaml"))

# Runs in a fresh process (the trainer owns the process group and tears it down): the command twice with
# three seeds, a job file edited in between, then an independent evaluation of two checkpoints.
CYCLE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from elastic_pretrain.cli import main

    def mtimes():
        runs = Path("runs/experiments-quick/kv-cache")
        return {p.parent.name: p.stat().st_mtime_ns for p in runs.glob("*/summary.json")}

    if __name__ == "__main__":
        out = {}
        assert main(["experiment", "kv-cache", "--quick", "--seeds", "3"]) == 0
        out["first"] = mtimes()
        out["first_metrics"] = json.loads(Path("runs/experiments-quick/results/kv-cache.json").read_text())[
            "metrics_by_seed"]
        job = Path("jobs/experiments/kv-cache/late-switch.yaml")
        job.write_text(job.read_text().replace("lr: 3.0e-3", "lr: 2.0e-3"))
        assert main(["experiment", "kv-cache", "--quick", "--seeds", "3"]) == 0
        out["third"] = mtimes()
        # the numbers the report shows, measured here independently from the checkpoints of two seeds
        import torch
        from elastic_pretrain.data.loader import load_validation
        from elastic_pretrain.engine.restore import load_model
        from elastic_pretrain.model.inference import teacher_forced_loss
        from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown
        init_mesh(ParallelConfig(), seed=0)
        for seed in (1234, 1235):
            job, model = load_model(Path(f"runs/experiments-quick/kv-cache/fixed-depth-seed{seed}"))
            tokens = load_validation(job.data, num_sequences=2)[:, :33]  # --quick: 2 x 32 predicted tokens
            out[f"per_loop_{seed}"] = teacher_forced_loss(model, tokens, loops=4, kv_cache="per-loop").loss
        # the trained arm after a parallel prefill of the first 16 tokens, scoring the 17 that follow
        _, model = load_model(Path("runs/experiments-quick/kv-cache/late-switch-kvtrained-seed1234"))
        pre = teacher_forced_loss(model, tokens, loops=4, kv_cache="last-loop", prompt_len=16)
        out["prefill_kvtrained_1234"] = [pre.loss, pre.tokens]
        teardown()
        print("CYCLE " + json.dumps(out))
    """
)


@pytest.mark.slow
def test_quick_experiment_reports_reuses_and_retrains(tmp_path: Path) -> None:
    # a private copy of the repository's declarative side, so that editing a job file touches nothing here
    quick_workspace(tmp_path, "kv-cache")
    (tmp_path / "cycle.py").write_text(CYCLE)
    proc = run_python(tmp_path, "cycle.py", timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    cycle = json.loads(proc.stdout.split("CYCLE ", 1)[1])

    # every arm with every seed; reuse when unchanged, retrain only the job whose file changed (all its seeds)
    arms = ("fixed-depth", "late-switch", "late-switch-kvtrained")  # the trained mode's arm (issue #18) included
    runs = {f"{job}-seed{s}" for job in arms for s in (1234, 1235, 1236)}
    assert set(cycle["first"]) == runs
    for s in (1234, 1235, 1236):
        for same in ("fixed-depth", "late-switch-kvtrained"):
            assert cycle["third"][f"{same}-seed{s}"] == cycle["first"][f"{same}-seed{s}"]
        assert cycle["third"][f"late-switch-seed{s}"] > cycle["first"][f"late-switch-seed{s}"]
    assert proc.stdout.count("fixed-depth: reused") == 3 and "late-switch: reused" not in proc.stdout
    assert proc.stdout.count("late-switch-kvtrained: reused") == 3 and proc.stdout.count("late-switch: trained") == 6
    # --quick's 2 steps are all in the one-loop phase, where the trained mode is same-pass attention (loss and
    # gradient): before the edit, the trained arm and late-switch are the same model, every metric equal
    for s in ("1234", "1235", "1236"):
        first = cycle["first_metrics"][s]
        assert first["late-switch-kvtrained"] == first["late-switch"] != first["fixed-depth"]

    results = tmp_path / "runs/experiments-quick/results"
    report = (results / "kv-cache.md").read_text()
    numbers = json.loads((results / "kv-cache.json").read_text())
    assert "elastic-pretrain experiment kv-cache --quick --seeds 3" in report and "Seeds** 1234, 1235, 1236" in report
    assert (results / "kv-cache.png").read_bytes()[:4] == b"\x89PNG"
    # the claim table comes first, then how the report was made (command, wall time, tokens), then seed noise
    order = [report.index(h) for h in ("## Claims", "## How this report was made", "## Seed noise", "## Setup")]
    assert order == sorted(order) and numbers["tokens_trained"] == 3 * 4096 and numbers["wall_s"] > 0
    assert f"**tokens trained** {3 * 4096:,} by this command" in report
    # every run trained by this checkout's code (provenance.py), said once and per run
    here = {"code": code_identity()}
    code = code_label(here)
    assert (
        f"- **Code**: every run was trained by one version of the code ({code_version(here)}: commits `{code}`;"
        in report
    )
    assert {run["code"] for run in numbers["runs"]} == {code} and f"| `{code}` | reused |" in report
    # the table's numbers are the runs': steps and tokens from summary.json, losses from the checkpoint
    for run in numbers["runs"]:
        summary = json.loads((tmp_path / run["run_dir"] / "summary.json").read_text())
        assert (run["steps"], run["tokens"]) == (summary["steps"], summary["tokens"]) == (2, 4096)
        assert f"| {run['job']} | {run['seed']} | `{run['file']}` | {run['parameters']:,} |" in report
    assert f"| fixed-depth | 4 | {cycle['per_loop_1234']:.4f} | " in report  # seed 1234's detail
    assert "| fixed-depth | 4 | 3,072 | 1,536 | 1,536 | 2,048 | 512 | 512 | 0.2500 (1/ℓ = 0.2500) |" in report
    by_seed = numbers["metrics_by_seed"]
    assert by_seed["1235"]["fixed-depth"]["per_loop@max"] == pytest.approx(cycle["per_loop_1235"])
    # the prefill column: last-loop after a parallel prefill, the continuation only, as measured here
    prefill = numbers["numbers_by_seed"]["1234"]["teacher_forced"]["late-switch-kvtrained"]["4"]["prefill"]
    assert [prefill["loss"], prefill["tokens"]] == pytest.approx(cycle["prefill_kvtrained_1234"])
    assert prefill["tokens"] == 2 * 17 and f"| {prefill['loss']:.4f} | " in report
    # each claim: one paired value per seed, from that seed's numbers; the interval and verdict from them
    from elastic_pretrain.experiments.stats import decide, t_interval

    claims = {c["measure"].split(":")[0]: c for c in numbers["claims"] if "(token by token) minus" in c["measure"]}
    seeds = ("1234", "1235", "1236")
    for arm in arms:
        tf = {s: numbers["numbers_by_seed"][s]["teacher_forced"][arm]["4"] for s in seeds}
        want = [t["last-loop"]["loss"] - t["per-loop"]["loss"] for t in tf.values()]
        assert claims[arm]["values"] == pytest.approx(want)
        iv = t_interval(want)
        assert (claims[arm]["interval"]["lo"], claims[arm]["interval"]["hi"]) == pytest.approx((iv.lo, iv.hi))
        assert claims[arm]["verdict"] == decide(iv, "positive")[0]
        assert f"**{claims[arm]['verdict']}**" in report
    assert all(c["values"] for c in numbers["claims"]), numbers["claims"]  # every claim measured, every arm there
    shrink = next(c for c in numbers["claims"] if c["measure"].startswith("late-switch minus late-switch-kvtrained"))
    gaps = [by_seed[s]["late-switch"]["last_minus_per@max"] - by_seed[s]["late-switch-kvtrained"]["last_minus_per@max"]
            for s in seeds]  # fmt: skip
    assert shrink["values"] == pytest.approx(gaps)
    lr = json.loads((tmp_path / "runs/experiments-quick/kv-cache/late-switch-seed1235/summary.json").read_text())
    config = (tmp_path / "runs/experiments-quick/kv-cache/late-switch-seed1235/config.yaml").read_text()
    assert lr["steps"] == 2 and "lr: 0.002" in config and "seed: 1235" in config


@pytest.mark.parametrize("path", JOB_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_experiment_job_files_parse(path: Path) -> None:
    base = base_job(path)
    if base is not None:  # post-trains a job of its set: loads once that job has a run (the runner does it)
        with pytest.raises(ConfigError, match=r"decider.init_from: .*\.yaml is a job file .*decider.init_from=runs/"):
            load_job(path)
        path = path.with_name(f"{base}.yaml")
        assert base_job(path) is None
    job = load_job(path)
    check_processes(path, job)  # the layout fits the processes the runner starts (slurm.nproc_per_node)
    assert job.tracking.backend == "none"


def test_registry_matches_job_sets_and_jobs_of_a_set_share_tokens_and_seed() -> None:
    from elastic_pretrain.experiments.registry import EXPERIMENTS

    sets = {p.parent.name for p in JOB_FILES}
    assert set(EXPERIMENTS) == sets
    for path in filter(base_job, JOB_FILES):  # a post-training job trains on its base's tokens, in their order:
        base, post = load_yaml(path.with_name(f"{base_job(path)}.yaml")), load_yaml(path)  # all or a prefix of them
        assert post["data"] == base["data"], path
        same = ("seed", "micro_batch_size", "global_batch_size")
        assert {k: post["train"][k] for k in same} == {k: base["train"][k] for k in same}, path
        assert post["train"]["steps"] <= base["train"]["steps"], path
    for name in sets:
        jobs = [load_job(p) for p in JOB_FILES if p.parent.name == name and base_job(p) is None]
        assert len({j.train.seed for j in jobs}) == 1, f"{name}: the runner gives every job the same seeds"
        assert len({(j.train.steps, j.tokens_per_step, j.data.shuffle_seed) for j in jobs}) == 1
        differing = {k for k in job_diff(jobs) if k.startswith(("data.", "train."))}
        assert differing == set(EXPERIMENTS[name].varies), name


def test_a_post_training_job_loads_after_its_base(tmp_path: Path) -> None:
    # the decider set: the base first (loaded now), the decider job after it (loaded once the base has a run)
    jobs = load_jobs("decider", tmp_path, [], jobs_dir=REPO / "jobs/experiments")
    assert [(p.name, s, j is None) for p, s, j in jobs] == [
        ("late-switch.yaml", 1234, False),
        ("decider-per-token-coverage.yaml", 1234, True),
        ("decider-per-token.yaml", 1234, True),
        ("decider-uniform.yaml", 1234, True),
        ("decider.yaml", 1234, True),
    ]
    assert jobs[0][2] is not None and jobs[0][2].run_path == tmp_path / "decider/late-switch-seed1234"
    bad = tmp_path / "jobs/bad"
    bad.mkdir(parents=True)
    (bad / "a.yaml").write_text("decider:\n  init_from: nope.yaml\n")
    with pytest.raises(ConfigError, match=r"a.yaml: decider.init_from: nope.yaml is not a job of .*bad/"):
        load_jobs("bad", tmp_path, [], jobs_dir=tmp_path / "jobs")


def test_fingerprint_ignores_the_run_name_only() -> None:
    a = load_job(REPO / "jobs/experiments/kv-cache/late-switch.yaml", ["name=a", "run_dir=/x"])
    b = load_job(REPO / "jobs/experiments/late-switch/switch-0.75.yaml", ["name=b", "run_dir=/y"])
    c = load_job(REPO / "jobs/experiments/route-replay/replay-on.yaml")
    from elastic_pretrain.experiments.runner import job_fingerprint

    assert job_fingerprint(a) == job_fingerprint(b) != job_fingerprint(c)
    assert fingerprint({"name": "x", "train": {"lr": 1}}) == fingerprint({"name": "y", "train": {"lr": 1}})


def test_fingerprint_compares_the_base_run_as_the_directory_it_names(tmp_path: Path, monkeypatch) -> None:
    """A decider job's base reached through a relative, absolute or symlinked runs root is one run (a rerun with
    --runs /abs/path must not retrain finished post-training runs); another base is another run."""
    real = tmp_path / "store/experiments/late-switch/switch-seed1/checkpoints/step_200"
    real.mkdir(parents=True)
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo/runs").symlink_to(tmp_path / "store")
    monkeypatch.chdir(tmp_path / "repo")

    def job(init_from: str) -> str:
        return fingerprint({"name": "d", "decider": {"init_from": init_from, "backbone": "joint"}})

    base = "runs/experiments/late-switch/switch-seed1/checkpoints/step_200"
    relative = job(base)
    assert relative == job(str(real)) == job(str(tmp_path / "repo" / base))
    assert relative != job(base.replace("seed1", "seed2"))


def test_a_run_from_before_a_config_field_existed_is_reused(tmp_path: Path) -> None:
    from elastic_pretrain.experiments.runner import job_fingerprint, run_fingerprint

    job = load_job(REPO / "jobs/experiments/kv-cache/late-switch.yaml")
    old = yaml.safe_load(dump_job(job))
    del old["decider"]  # a run trained before the decider section existed
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert run_fingerprint(tmp_path) == job_fingerprint(job)
    old["train"]["lr"] = 1.0
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert run_fingerprint(tmp_path) != job_fingerprint(job)
    old["removed_key"] = 1  # no longer builds: compared as written, never equal
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert run_fingerprint(tmp_path) not in (None, job_fingerprint(job))


def test_cli_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from elastic_pretrain.cli import main

    assert main(["experiment", "nope"]) == 2
    known = "unknown experiment 'nope' (known: depth-premise, depth-premise-long, exit-schedules"
    assert known in capsys.readouterr().err
    assert main(["experiment", "kv-cache", "--quick", "modle.loops=2"]) == 2
    assert "unknown key 'modle'" in capsys.readouterr().err
    assert main(["experiment", "--list"]) == 0 and "route-replay" in capsys.readouterr().out
    assert main(["experiment", "kv-cache", "--seeds", "two"]) == 2
    assert "--seeds two: give a count (e.g. --seeds 3)" in capsys.readouterr().err
    assert main(["experiment", "kv-cache", "--seeds", "5,5,6"]) == 2
    assert "distinct seeds" in capsys.readouterr().err
    assert main(["experiment", "kv-cache", "--scale", "0"]) == 2
    assert "--scale 0: must be a positive integer" in capsys.readouterr().err


def test_every_arm_trains_with_every_seed_paired_and_seed_major(tmp_path: Path) -> None:
    jobs = load_jobs("decider", tmp_path, [], jobs_dir=REPO / "jobs/experiments", seeds="3")
    assert [(p.stem, s) for p, s, _ in jobs] == [
        (stem, seed)
        for seed in (1234, 1235, 1236)
        for stem in ("late-switch", "decider-per-token-coverage", "decider-per-token", "decider-uniform", "decider")
    ]
    for path, seed, job in jobs:
        if job is not None:  # the same job file, only the seed and the run directory differ
            assert job.train.seed == seed and job.run_path == tmp_path / f"decider/{path.stem}-seed{seed}"
    listed = load_jobs("kv-cache", tmp_path, [], jobs_dir=REPO / "jobs/experiments", seeds="7,3")
    arms = ("fixed-depth", "late-switch-kvtrained", "late-switch")  # job-file order
    assert [(p.stem, s) for p, s, _ in listed] == [(arm, seed) for seed in (7, 3) for arm in arms]
    a, b = (j for p, s, j in listed[:3] if p.stem != "late-switch-kvtrained")
    assert (
        a is not None
        and b is not None
        and job_diff([a, b])
        == job_diff(
            [
                load_job(REPO / "jobs/experiments/kv-cache/fixed-depth.yaml"),
                load_job(REPO / "jobs/experiments/kv-cache/late-switch.yaml"),
            ]
        )
    )


def test_post_training_runs_on_its_base_of_the_same_seed(tmp_path: Path) -> None:
    from elastic_pretrain.experiments.runner import Run, load_post_training

    jobs = load_jobs("decider", tmp_path, [], jobs_dir=REPO / "jobs/experiments", seeds="2")
    bases = [
        Run(name="late-switch", job=j, job_path=p, run_dir=tmp_path / f"base-{s}", summary={}, status="trained")
        for p, s, j in jobs
        if j is not None
    ]
    post = next(p for p, _, j in jobs if j is None)
    # load_job checks that the base run holds a checkpoint: the error names the run it was pointed at
    with pytest.raises(ConfigError, match=r"decider.init_from: .*/base-1235: no committed checkpoint"):
        load_post_training(post, "decider", tmp_path, [], bases, seed=1235)


def _scaled(tmp_path: Path, path: Path, overrides: list[str], **rule: Any) -> JobConfig:
    [(_, _, job)] = [
        t
        for t in load_jobs(path.parent.name, tmp_path, overrides, jobs_dir=REPO / "jobs/experiments", seeds="1", **rule)
        if t[0] == path
    ]
    assert job is not None
    return job


def test_scale_keeps_tokens_per_parameter_and_scales_batch_and_lr_with_the_width(tmp_path: Path) -> None:
    """--scale k (issue 32 item 4): k times wider (~k² parameters), trained on the design's own tokens per
    parameter (k times the tokens left the ratio falling ~1/k), batch x k, lr / √k; the job still builds."""
    from elastic_pretrain.experiments.runner import parse_seeds, scale_overrides
    from elastic_pretrain.model.params import count_parameters

    path = REPO / "jobs/experiments/late-switch/switch-0.75.yaml"
    one = load_job(path)
    assert scale_overrides(one, 1) == []
    big = _scaled(tmp_path, path, [], scale=4)
    m1, m4, t1, t4 = one.model, big.model, one.train, big.train
    assert (m4.hidden_size, m4.ffn_hidden_size, m4.moe_ffn_hidden_size) == (
        4 * m1.hidden_size,
        4 * m1.ffn_hidden_size,
        4 * m1.moe_ffn_hidden_size,
    )
    assert m4.num_heads == m1.num_heads and m4.max_loops == m1.max_loops
    assert (t4.micro_batch_size, t4.global_batch_size) == (4 * t1.micro_batch_size, 4 * t1.global_batch_size)
    assert t4.lr == pytest.approx(t1.lr / 2, rel=1e-5) and t4.min_lr == pytest.approx(t1.min_lr / 2, rel=1e-5)
    p1, p4 = count_parameters(m1).total, count_parameters(m4).total
    assert 10 < p4 / p1 < 16  # ~k² (the byte embedding grows only k-fold)
    ratio = lambda job, p: job.train.steps * job.tokens_per_step / p  # noqa: E731
    # the same tokens per parameter, up to rounding the steps up to whole batches
    assert ratio(one, p1) <= ratio(big, p4) < ratio(one, p1) + big.tokens_per_step / p4
    assert t4.warmup_steps / t4.steps == pytest.approx(t1.warmup_steps / t1.steps, abs=1 / t4.steps)
    # a target ratio instead of the design's; and the rule applies after the user's overrides
    twenty = _scaled(tmp_path, path, ["data.seq_len=256"], scale=4, tokens_per_param=20)
    assert twenty.data.seq_len == 256 and twenty.tokens_per_step == 4 * t1.global_batch_size * 256
    assert 20 <= ratio(twenty, p4) < 20 + twenty.tokens_per_step / p4
    same_width = _scaled(tmp_path, path, [], scale=1, tokens_per_param=2.0)
    assert same_width.model.hidden_size == m1.hidden_size and same_width.train.lr == t1.lr
    assert 2.0 <= ratio(same_width, p1) < 2.0 + one.tokens_per_step / p1
    with pytest.raises(UserError, match=r"--tokens-per-param -1\.0: must be a positive number"):
        scale_overrides(one, 4, tokens_per_param=-1.0)
    assert parse_seeds("3", 10) == [10, 11, 12] and parse_seeds("5,1", 10) == [5, 1]
    # one seed is a list of one; a "count" of 1234 is that seed without its comma, not 1,234 sets of runs
    assert parse_seeds("1234,", 10) == [1234] and len(parse_seeds("100", 10)) == 100
    with pytest.raises(UserError, match=r"--seeds 1234: a count of 1,234 seeds .* write --seeds 1234, \(a list\)"):
        parse_seeds("1234", 10)
    for bad in ("", ",", "0", "1,1", "x"):
        with pytest.raises(UserError, match="give a count"):
            parse_seeds(bad, 10)


def test_every_claim_reads_arms_of_its_own_job_set() -> None:
    from collections import defaultdict

    from elastic_pretrain.experiments.registry import EXPERIMENTS
    from elastic_pretrain.experiments.stats import evaluate

    for name, experiment in EXPERIMENTS.items():
        arms = {p.stem for p in JOB_FILES if p.parent.name == name}
        # every arm has every metric (value 0.1 + seed): only an arm name outside the set can be missing
        # (arms differ by 0.01 x their index, so ratios of differences are defined)
        by_seed = {
            s: {a: defaultdict(lambda s=s, i=i: 0.1 + s + 0.01 * i) for i, a in enumerate(sorted(arms))}
            for s in (0, 1, 2)
        }
        for claim in experiment.claims:
            result = evaluate(claim, by_seed)  # type: ignore[arg-type]
            assert result.interval is not None, f"{name}: {claim.measure}: {result.reason}"
            assert claim.paper.count('"') % 2 == 0 and claim.source.startswith("seeds/"), claim.paper


def test_gpu_smoke_is_the_premise_probe_at_scale_4_and_is_refused_without_cuda() -> None:
    import argparse

    from elastic_pretrain.experiments.commands import gpu_smoke

    def args(**kw: Any) -> argparse.Namespace:
        return argparse.Namespace(**{"scale": 1, "tokens_per_param": None, "quick": False, "seeds": None,
                                     "out": None, **kw})  # fmt: skip

    a = args()
    gpu_smoke(a, ["depth-premise"], cuda=True)
    assert (a.scale, a.tokens_per_param, a.seeds, a.out) == (4, 1.0, "3", "docs/results/gpu-smoke")
    for names, kw, cuda, words in (
        (["depth-premise"], {}, False, "no CUDA device"),
        (["late-switch"], {}, True, "name depth-premise alone"),
        (["depth-premise"], {"scale": 8}, True, "drop --scale"),
    ):
        with pytest.raises(UserError, match=words) as err:
            gpu_smoke(args(**kw), names, cuda=cuda)
        assert "\n" not in str(err.value)
