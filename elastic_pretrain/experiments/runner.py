"""Run an experiment: train (or reuse) each job of its set once per seed, evaluate, write the report.

An experiment is a job set ``jobs/experiments/<name>/*.yaml`` plus an analysis registered in
:mod:`elastic_pretrain.experiments.registry`; every arm trains with the same seeds, so a seed's arms are paired.
A finished run is **reused** only when its resolved config equals the job's and it was trained for the
experiment and job its directory names (issue 35 item 9); a directory the runner did not write is never deleted.
docs/experiments.md, "Seeds and pairing"; multi-process jobs and ``--scale``: "Multi-process job sets", "`--scale`".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from elastic_pretrain.config import ConfigError, build, flatten, load_yaml, show, to_dict
from elastic_pretrain.errors import UserError
from elastic_pretrain.experiments.stats import MIN_SEEDS, Claim, Metrics
from elastic_pretrain.files import LIMITS, check_regular, read_json_object
from elastic_pretrain.job import JobConfig, dump_job
from elastic_pretrain.job_loader import load_job
from elastic_pretrain.model.params import count_parameters
from elastic_pretrain.rundir import RunFiles

if TYPE_CHECKING:
    import torch

    from elastic_pretrain.model.looped import LoopedMoEModel

log = logging.getLogger(__name__)

JOBS_DIR = Path("jobs/experiments")
# What --quick changes in every job: a couple of steps, tiny evaluations (a smoke test of the pipeline).
QUICK_OVERRIDES = (
    "train.steps=2",
    "train.warmup_steps=1",
    "train.log_interval=1",
    "train.routing_interval=1",
    "train.eval_sequences=4",
)
# Keys that name a run rather than define it (left out of the reuse fingerprint and of the job diff).
_NAMING_KEYS = ("name", "run_dir")
MAX_CONFIG_BYTES = 1 << 20  # a run's config.yaml as the trainer writes it: a few KB


@dataclasses.dataclass(frozen=True)
class Run:
    """One trained job of an experiment."""

    name: str  # the job file's stem
    job: JobConfig
    job_path: Path
    run_dir: Path
    summary: dict[str, Any]
    status: Literal["trained", "resumed", "reused"]

    @property
    def seed(self) -> int:
        return self.job.train.seed

    @property
    def steps(self) -> int:
        return int(self.summary["steps"])

    @property
    def tokens(self) -> int:
        return int(self.summary["tokens"])

    @property
    def seconds_per_step(self) -> float:
        return float(self.summary["elapsed_s"]) / max(1, self.steps)


@dataclasses.dataclass
class Findings:
    """What an analysis hands back for one seed: markdown tables, plot, a factual reading, the raw numbers,
    and the scalar metrics per arm that the claims and the seed-noise table are computed from."""

    tables: list[str]
    reading: list[str]
    numbers: dict[str, Any]
    plot: Callable[[Path], Any]
    metrics: Metrics = dataclasses.field(default_factory=dict)  # arm -> metric -> value, this seed
    method: list[str] = dataclasses.field(default_factory=list)  # how the numbers were measured
    held_out: str | None = None  # replaces the report's default held-out tokens line when set


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A registered experiment: its job set is ``jobs/experiments/<name>/``; ``analyse`` evaluates the runs."""

    name: str
    title: str
    question: str  # what is compared, and what is held equal
    analyse: Callable[[Context], Findings]  # one seed's runs (one per arm) -> findings
    varies: tuple[str, ...] = ()  # train.*/data.* keys its jobs may differ in (all others are shared)
    claims: tuple[Claim, ...] = ()  # the papers' claims it tests, decided over the seeds
    # One seed's metrics recomputed from that seed's stored numbers and metrics (``numbers_by_seed[s]``,
    # ``metrics_by_seed[s]`` of the JSON report): `experiment NAME --from-json` applies a changed scoring to
    # finished runs without retraining; ``analyse`` computes its metrics through the same function.
    rescore: Callable[[dict[str, Any], Metrics], Metrics] | None = None
    # The plot from the first seed's stored numbers (``--from-json`` redraws it; ``analyse``'s plot calls it).
    replot: Callable[[dict[str, Any], Path], Any] | None = None


class Context:
    """What an analysis sees: the runs of one seed (one per arm, in job-file order), loaded models,
    held-out tokens, quick mode."""

    def __init__(self, experiment: Experiment, runs: list[Run], *, quick: bool) -> None:  # one seed's runs
        if len({r.seed for r in runs}) > 1:
            raise ValueError("a Context holds the runs of one seed; use for_seed")
        self.experiment, self.runs, self.quick = experiment, runs, quick
        self.by_name = {r.name: r for r in runs}
        self._models: dict[str, LoopedMoEModel] = {}
        self._tokens: dict[int, torch.Tensor] = {}

    @property
    def eval_sequences(self) -> int:
        """Held-out sequences every loss in a report is measured on (the first N of the val split)."""
        return 4 if self.quick else 128

    def run(self, name: str) -> Run:
        if name not in self.by_name:
            raise ConfigError(
                f"experiment {self.experiment.name}: no job '{name}' in {JOBS_DIR / self.experiment.name}/ "
                f"(found: {', '.join(self.by_name)})"
            )
        return self.by_name[name]

    def model(self, name: str) -> LoopedMoEModel:
        """The run's final checkpoint as a one-process model in eval mode (cached)."""
        forget_moe_aux_losses()  # the model asked for may have another number of layers than the last one
        if name not in self._models:
            from elastic_pretrain.engine.restore import load_model

            self._models[name] = load_model(self.run(name).run_dir)[1]
        return self._models[name]

    def forget_models(self) -> None:
        """Drop the loaded models (an experiment analyses one seed after another)."""
        self._models.clear()

    def val_tokens(self, n: int | None = None) -> torch.Tensor:
        """The first ``n`` held-out sequences (default :attr:`eval_sequences`) of the first job's data."""
        from elastic_pretrain.data.loader import load_validation

        n = n or self.eval_sequences
        if n not in self._tokens:
            self._tokens[n] = load_validation(self.runs[0].job.data, num_sequences=n)
        return self._tokens[n]


def seeds_of(runs: list[Run]) -> list[int]:
    """The seeds the runs trained with, in first-seen order."""
    return list(dict.fromkeys(r.seed for r in runs))


MAX_SEED_COUNT = 100  # a larger "count" is a seed written without its comma: each seed is a set of runs


def parse_seeds(text: str, base: int) -> list[int]:
    """``--seeds``: a count N (seeds base, base+1, …, base+N−1; base is the job set's own train.seed) or
    a comma-separated list of seeds (one seed: ``--seeds 1234,``)."""
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",") if s.strip()]
        else:
            count = int(text)
            if count > MAX_SEED_COUNT:
                raise UserError(
                    f"--seeds {text}: a count of {count:,} seeds trains {count:,} runs per job; for the one seed "
                    f"{count} write --seeds {count}, (a list), or give a count up to {MAX_SEED_COUNT}"
                )
            seeds = [base + i for i in range(count)]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise UserError(
            f"--seeds {text}: give a count (e.g. --seeds {MIN_SEEDS}) or distinct seeds (e.g. --seeds 1234,1235,1236)"
        )
    return seeds


def scale_overrides(job: JobConfig, scale: int, *, tokens_per_param: float | None = None) -> list[str]:
    """``--scale k``: the same design k times wider, trained on tokens sized to its parameters (for a GPU).

    The rule (docs/experiments.md, "--scale"):

    * width x k: residual, FFN and expert widths (heads, layers, experts and loops unchanged), so the
      parameters grow ~k²;
    * tokens = R x the scaled model's total parameters, R = ``tokens_per_param`` or the design's own ratio at
      k = 1: the tokens per parameter stay put instead of falling ~1/k (k times the tokens for ~k² the
      parameters was the earlier rule);
    * batch x k sequences (micro-batch and global: the same micro-batches per step, each k times larger), so
      the steps grow ~k: steps = tokens / (batch x seq_len), rounded up;
    * lr and min_lr x 1/√k: μP's 1/width for Adam on hidden matrices, times √k for the k-times batch
      (square-root batch scaling for Adam); warmup the same fraction of the steps.
    """
    if scale < 1:
        raise UserError(f"--scale {scale}: must be a positive integer (1, 4, 16)")
    if tokens_per_param is not None and not (math.isfinite(tokens_per_param) and tokens_per_param > 0):
        raise UserError(f"--tokens-per-param {tokens_per_param}: must be a positive number, e.g. 20")
    if scale == 1 and tokens_per_param is None:
        return []
    m, t = job.model, job.train
    wide = dataclasses.replace(m, hidden_size=m.hidden_size * scale, ffn_hidden_size=m.ffn_hidden_size * scale,
                               moe_ffn_hidden_size=m.moe_ffn_hidden_size * scale)  # fmt: skip
    params_1, params_k = count_parameters(m).total, count_parameters(wide).total
    ratio = tokens_per_param if tokens_per_param is not None else t.steps * job.tokens_per_step / params_1
    steps = max(2, math.ceil(ratio * params_k / (job.tokens_per_step * scale)))
    warmup = min(steps - 1, round(t.warmup_steps * steps / t.steps))
    shrink = math.sqrt(scale)
    return [
        f"model.hidden_size={wide.hidden_size}",
        f"model.ffn_hidden_size={wide.ffn_hidden_size}",
        f"model.moe_ffn_hidden_size={wide.moe_ffn_hidden_size}",
        f"train.micro_batch_size={t.micro_batch_size * scale}",
        f"train.global_batch_size={t.global_batch_size * scale}",
        f"train.steps={steps}",
        f"train.warmup_steps={warmup}",
        f"train.lr={t.lr / shrink:.6g}",
        f"train.min_lr={t.min_lr / shrink:.6g}",
    ]


# ---------------------------------------------------------------------------------------------------
# Job sets and reuse
def job_paths(name: str, jobs_dir: Path = JOBS_DIR) -> list[Path]:
    paths = sorted((jobs_dir / name).glob("*.yaml"))
    if not paths:
        raise UserError(f"experiment {name}: no job files in {jobs_dir / name}/ (run from the repository root)")
    return paths


def load_jobs(
    name: str,
    runs_root: Path,
    overrides: list[str],
    jobs_dir: Path = JOBS_DIR,
    *,
    seeds: str | None = None,
    scale: int = 1,
    tokens_per_param: float | None = None,
) -> list[tuple[Path, int, JobConfig | None]]:
    """Every (job, seed) of the set with the overrides applied, seed-major (all arms of the first seed
    first, so that an interrupted experiment holds complete pairs), run directories
    ``runs_root/<name>/<job>-seed<seed>``. ``seeds``: see :func:`parse_seeds` (None: the set's own seed).

    A job that post-trains another job of the set (``decider.init_from: <job>.yaml``) comes after it and
    is None here: :func:`load_post_training` loads it once that job's run of the same seed exists."""
    paths = job_paths(name, jobs_dir)
    bases = {p: base_job(p) for p in paths}
    for path, base in bases.items():
        if base is not None and bases.get(path.with_name(f"{base}.yaml"), "missing") is not None:
            raise ConfigError(
                f"{path}: decider.init_from: {base}.yaml is not a job of {jobs_dir / name}/ that trains from scratch "
                "(name a job file of this set, or a run directory)"
            )
    paths.sort(key=lambda p: bases[p] is not None)  # bases first
    own = load_job(paths[0], overrides).train.seed  # config errors before any training
    seed_list = parse_seeds(seeds, own) if seeds is not None else [own]

    def load(p: Path, seed: int) -> JobConfig:
        return _load(p, name, runs_root, overrides, seed=seed, scale=scale, tokens_per_param=tokens_per_param)

    return [(p, seed, None if bases[p] else load(p, seed)) for seed in seed_list for p in paths]


def base_job(path: Path) -> str | None:
    """The job of the same set that ``path`` post-trains (``decider.init_from: <job>.yaml``), if any."""
    section = load_yaml(path).get("decider")
    ref = section.get("init_from") if isinstance(section, dict) else None
    return ref.removesuffix(".yaml") if isinstance(ref, str) and ref.endswith(".yaml") and "/" not in ref else None


def load_post_training(
    path: Path,
    name: str,
    runs_root: Path,
    overrides: list[str],
    runs: list[Run],
    *,
    seed: int,
    scale: int = 1,
    tokens_per_param: float | None = None,
) -> JobConfig:
    """A job that post-trains a job of its set, on that job's run of the same seed (trained or reused)."""
    base = next(r for r in runs if r.name == base_job(path) and r.seed == seed)
    values = {"decider.init_from": str(base.run_dir)}
    return _load(path, name, runs_root, overrides, seed=seed, scale=scale, tokens_per_param=tokens_per_param,
                 values=values)  # fmt: skip


def _load(
    path: Path,
    name: str,
    runs_root: Path,
    overrides: list[str],
    *,
    seed: int,
    scale: int = 1,
    tokens_per_param: float | None = None,
    values: dict[str, str] | None = None,
) -> JobConfig:
    # paths are set verbatim, not as key=value overrides that YAML would parse ('#', ': ', '~')
    stem = f"{path.stem}-seed{seed}"
    values = {**(values or {}), "run_dir": str(runs_root / name / stem), "name": f"{name}-{stem}"}
    overrides = [*overrides, f"train.seed={seed}"]
    job = load_job(path, overrides, values=values)
    if scale != 1 or tokens_per_param is not None:  # after the other overrides: --scale multiplies what they set
        rule = scale_overrides(job, scale, tokens_per_param=tokens_per_param)
        job = load_job(path, [*overrides, *rule], values=values)
    check_processes(path, job)
    return job


def processes(job: JobConfig) -> int:
    """Processes the runner trains ``job`` with: ``slurm.nproc_per_node`` (default 1 on CPU nodes), all on
    this machine — the count ``elastic-pretrain submit`` starts on each node."""
    return job.slurm.procs_per_node


def check_processes(path: Path, job: JobConfig) -> None:
    """The job's layout at :func:`processes` ranks, before anything trains (one line naming the fix)."""
    from elastic_pretrain.parallel.validate import check_layout

    if job.slurm.nodes != 1:
        raise ConfigError(
            f"{path}: slurm.nodes={job.slurm.nodes}: experiments train on this machine; set slurm.nodes: 1"
        )
    n = processes(job)
    try:
        check_layout(job, n)
    except ConfigError as e:
        raise ConfigError(
            f"{path}: at {n} process(es) (slurm.nproc_per_node: {job.slurm.nproc_per_node}): {e}"
        ) from None


def fingerprint(config: dict[str, Any]) -> str:
    """The config that defines a run, as canonical JSON (naming keys left out). A post-training job's base
    (``decider.init_from``) is compared as the directory it names, resolved: the same base run reached
    through ``--runs runs/experiments`` or an absolute or symlinked root is the same run."""
    kept = {k: v for k, v in config.items() if k not in _NAMING_KEYS}
    decider = kept.get("decider")
    if isinstance(decider, dict) and isinstance(decider.get("init_from"), str):
        kept["decider"] = {**decider, "init_from": str(Path(decider["init_from"]).resolve())}
    return json.dumps(kept, sort_keys=True)


def job_fingerprint(job: JobConfig) -> str:
    return fingerprint(yaml.safe_load(dump_job(job)))  # through YAML: what config.yaml holds (our own text)


def config_fingerprint(raw: dict[str, Any]) -> str:
    """A run's config through today's schema: a key added since it was trained (``decider: null``) reads as
    its default, so adding a config field does not retrain every finished run (new fields default to the old
    behaviour); a config that no longer builds (a key since removed) is compared as written."""
    try:
        return job_fingerprint(build(JobConfig, raw))
    except ConfigError:
        pass
    try:
        return fingerprint(raw)
    except (TypeError, ValueError):  # YAML's dates, sets or non-string keys: JSON has none, no job has them
        return "<a config no job has>"


_NOT_OURS = "move it out of --runs (the runner deletes only runs it wrote) and rerun"


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """A run directory's ``config.yaml`` through the job files' bounded YAML loader (alias bombs, deep
    nesting, huge integers, a FIFO or a 1 GB file: one line, never a hang)."""
    path = RunFiles(run_dir).config
    what = f"{run_dir} is not a run this runner wrote: {_NOT_OURS}"
    check_regular(path, what, limit=MAX_CONFIG_BYTES)
    try:
        return load_yaml(path)
    except RecursionError:
        raise UserError(f"{path}: nested too deeply to be read; {what}") from None
    except ConfigError as err:
        raise UserError(f"{err} ({what})") from None


def run_fingerprint(run_dir: Path) -> str | None:
    """The fingerprint of the run in ``run_dir`` (None: it has no ``config.yaml``)."""
    if not os.path.lexists(RunFiles(run_dir).config):
        return None
    return config_fingerprint(read_run_config(run_dir))


def trained_for(raw: dict[str, Any], run_dir: Path) -> bool:
    """The run's ``config.yaml`` says it was trained for the experiment and job its directory names:
    ``run_dir`` ends in ``<experiment>/<job>-seed<seed>`` and ``name`` is ``<experiment>-<job>-seed<seed>``
    (what :func:`_load` sets). A run copied or linked in from elsewhere says otherwise."""
    recorded, name = raw.get("run_dir"), raw.get("name")
    if not isinstance(recorded, str) or not isinstance(name, str):
        return False
    where = run_dir.parts[-2:]
    return Path(recorded).parts[-2:] == where and name == "-".join(where)


def is_finished(run_dir: Path) -> bool:
    files = RunFiles(run_dir)
    return files.finished.is_file() and files.summary.is_file()


def read_summary(run_dir: Path) -> dict[str, Any]:
    """``summary.json`` of a finished run, with the counters the report reads checked."""
    path = RunFiles(run_dir).summary
    summary = read_json_object(path, _NOT_OURS, limit=LIMITS["history"])  # it holds every step: 1 MiB is ~5k
    for key in ("steps", "tokens", "elapsed_s"):
        value = summary.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 2**63:
            raise UserError(f"{path}: {key}={show(value, 40)} is not a non-negative number; {_NOT_OURS}")
    return summary


def own_run(job: JobConfig) -> Literal["none", "finished", "unfinished", "changed"]:
    """What the job's own run directory holds. Anything the runner did not write there is refused in one
    line (it would be deleted or trained into otherwise): a link, a file, a folder without ``config.yaml``
    or one whose ``config.yaml`` names another run."""
    own = job.run_path
    if own.is_symlink():
        raise UserError(f"{own}: a symbolic link where {job.name}'s run directory goes; {_NOT_OURS}")
    if not own.exists():
        return "none"
    if not own.is_dir():
        raise UserError(f"{own}: a file where {job.name}'s run directory goes; {_NOT_OURS}")
    if not os.path.lexists(RunFiles(own).config):
        if any(own.iterdir()):
            raise UserError(f"{own}: holds no config.yaml, so it is not a run of {job.name}; {_NOT_OURS}")
        return "none"  # an empty folder: train into it
    raw = read_run_config(own)
    if not trained_for(raw, own):
        raise UserError(
            f"{own}: its config.yaml says it is run {show(raw.get('name'), 60)} of {show(raw.get('run_dir'), 80)}, "
            f"not {job.name}; {_NOT_OURS}"
        )
    if config_fingerprint(raw) != job_fingerprint(job):
        return "changed"
    if is_finished(own):
        read_summary(own)
        return "finished"
    return "unfinished"


def shared_runs(job: JobConfig, runs_root: Path, jobs_dir: Path) -> list[Path]:
    """Where another job set's job of the same seed would have its run: ``<runs>/<set>/<job>-seed<seed>``
    for every job file in ``jobs_dir`` (the user's own files), never any other folder under ``--runs``."""
    suffix = f"-seed{job.train.seed}"
    dirs = [runs_root / p.parent.name / f"{p.stem}{suffix}" for p in sorted(jobs_dir.glob("*/*.yaml"))]
    return [d for d in dirs if d != job.run_path]


def reusable_elsewhere(job: JobConfig, runs_root: Path, jobs_dir: Path) -> Path | None:
    """A finished run of another job set's job trained with this job's config, or None. Such a run is the
    other experiment's: one that is not well-formed is skipped (its experiment's next run says why)."""
    want = job_fingerprint(job)
    for run_dir in shared_runs(job, runs_root, jobs_dir):
        if run_dir.is_symlink() or not run_dir.is_dir() or not is_finished(run_dir):
            continue
        try:
            raw = read_run_config(run_dir)
            if trained_for(raw, run_dir) and config_fingerprint(raw) == want:
                read_summary(run_dir)
                return run_dir
        except UserError as err:
            log.info("%s: not reused (%s)", run_dir, err)
    return None


def find_reusable(job: JobConfig, runs_root: Path, jobs_dir: Path = JOBS_DIR) -> Path | None:
    """A finished run with this job's config, trained for this job or another job set's: its own run
    directory first (:func:`own_run`), then :func:`reusable_elsewhere`."""
    if own_run(job) == "finished":
        return job.run_path
    return reusable_elsewhere(job, runs_root, jobs_dir)


def check_runs_root(runs_root: Path) -> None:
    """``--runs``: a folder this user can list and write into (created if missing), else one line."""
    if runs_root.exists() and not runs_root.is_dir():
        raise UserError(f"--runs {runs_root}: a file, not a folder: name a folder for the run directories")
    try:
        runs_root.mkdir(parents=True, exist_ok=True)
        with os.scandir(runs_root):
            pass
    except OSError as err:
        raise UserError(f"--runs {runs_root}: {err.strerror}: name a folder you can read and write") from None
    if not os.access(runs_root, os.R_OK | os.W_OK | os.X_OK):
        raise UserError(f"--runs {runs_root}: not writable by you: name a folder you can read and write")


def ensure_trained(path: Path, job: JobConfig, runs_root: Path) -> Run:
    """Reuse a finished run with the same config (:func:`find_reusable`), else train this job here (resuming
    its own unfinished run of the same config; its own run directory holding another config is deleted
    first)."""
    from elastic_pretrain.engine import build_session
    from elastic_pretrain.train.trainer import train

    own = job.run_path
    state = own_run(job)
    found = own if state == "finished" else reusable_elsewhere(job, runs_root, path.parent.parent)
    status: Literal["trained", "resumed", "reused"] = "reused"
    if found is None:
        status = "resumed" if state == "unfinished" else "trained"
        if state == "changed":
            log.info("%s: config changed, training again from scratch", own)
            shutil.rmtree(own)
        t0 = time.perf_counter()
        nproc = processes(job)
        if nproc > 1:
            train_processes(path, job, nproc)
        else:
            forget_moe_aux_losses()
            if train(job, build_session) is None:
                raise UserError(f"{path.stem}: training stopped before the end; rerun the experiment to continue it")
        where = f" ({nproc} processes)" if nproc > 1 else ""
        print(f"{path.stem}: {status} in {time.perf_counter() - t0:.0f}s{where} -> {own}", flush=True)
        found = own
    else:
        print(f"{path.stem}: reused {found} (same config{_other_code(found)})", flush=True)
    return Run(name=path.stem, job=job, job_path=path, run_dir=found, summary=read_summary(found), status=status)


def _other_code(run_dir: Path) -> str:
    """``, trained by other code: …`` when a reused run's code version (provenance.py) is not this
    checkout's, else ``""``."""
    from elastic_pretrain.provenance import code_identity, code_label, code_version

    theirs, ours = read_summary(run_dir), {"code": code_identity()}
    if code_version(theirs) == code_version(ours):
        return ""
    return (
        f", trained by other code: {code_label(theirs)} ({code_version(theirs)}); "
        f"this checkout: {code_label(ours)} ({code_version(ours)})"
    )


def train_processes(path: Path, job: JobConfig, nproc: int) -> None:
    """Train ``job`` in ``nproc`` local ranks: the resolved job (overrides, seed and run directory applied;
    secrets kept: a private 0600 file, deleted afterwards) through ``elastic-pretrain train
    --nproc-per-node`` in a child process (the user's own launcher; commands modules stay leaves that only
    cli.py imports), so a rank's user error prints there once, and Ctrl-C reaches every rank (same process
    group), which save and stop (rerun the experiment to resume)."""
    import subprocess
    import sys
    import tempfile

    from elastic_pretrain.files import write_private

    with tempfile.TemporaryDirectory(prefix="elastic-pretrain-experiment-") as folder:
        resolved = Path(folder) / f"{path.stem}.yaml"
        write_private(resolved, yaml.safe_dump(to_dict(job), sort_keys=False), root=Path(folder))
        cmd = [sys.executable, "-m", "elastic_pretrain.cli", "train", str(resolved), "--nproc-per-node", str(nproc)]
        code = subprocess.run(cmd, check=False).returncode
    if code != 0:
        raise UserError(
            f"{path.stem}: the {nproc} training processes exited with status {code} (their output is above)"
        )
    if not is_finished(job.run_path):
        raise UserError(f"{path.stem}: training stopped before the end; rerun the experiment to continue it")


def forget_moe_aux_losses() -> None:
    """Empty megatron-core's process-global MoE aux-loss tracker. It sizes its per-layer buffers on first
    use, so the next model in this process with more layers would index past them."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


def job_diff(jobs: list[JobConfig]) -> list[str]:
    """Dotted config keys whose values differ between the jobs (naming keys left out)."""
    flat = [flatten(to_dict(j)) for j in jobs]
    keys = sorted({k for f in flat for k in f} - set(_NAMING_KEYS))
    return [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1]
