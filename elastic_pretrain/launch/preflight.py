"""``submit``'s pre-flight: what the job will meet on the cluster, checked on the submit host before
anything reaches Slurm (issue 33, item 10). ``submit --dry-run`` prints every finding; the real submit
refuses on the first refusal, in one line.

Refused: what would fail on the nodes after queueing (a GPU job on the submit host's CPU-only interpreter,
missing shards or tokenizer, a run directory finished, running or of another model shape). Said, not refused:
what the cluster or the nodes decide (partition, account, remote streams). docs/slurm.md, "Submit" (Pre-flight).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from elastic_pretrain.data.config import DataConfig, StreamConfig, is_remote, local_path
from elastic_pretrain.errors import UserError
from elastic_pretrain.launch.config import SlurmConfig
from elastic_pretrain.launch.slurm import finished_refusal, live_job_refusal
from elastic_pretrain.rundir import RunFiles

if TYPE_CHECKING:  # annotations only: submit loads the job
    from elastic_pretrain.job import JobConfig


@dataclasses.dataclass(frozen=True)
class Preflight:
    refusals: tuple[str, ...]
    notes: tuple[str, ...]


def preflight(job: JobConfig, cfg: SlurmConfig, run_dir: Path) -> Preflight:
    """Every finding for ``job`` submitted under ``cfg`` into ``run_dir`` (absolute)."""
    refusals: list[str] = []
    notes: list[str] = []
    python = python_refusal(cfg)
    if python:
        refusals.append(python)
    data_refusals, data_notes = data_findings(job.data)
    refusals += data_refusals
    notes += data_notes
    refusals += run_dir_refusals(job, run_dir)
    for key, flag, default in (("partition", "--partition", "the cluster's default partition"),
                               ("account", "--account", "your default account")):  # fmt: skip
        if getattr(cfg, key) is None:
            notes.append(f"slurm.{key} is not set ({flag}): the job goes to {default}")
    return Preflight(tuple(refusals), tuple(notes))


def python_refusal(cfg: SlurmConfig) -> str | None:
    """A GPU job that would run on the nodes with this (the submit host's) interpreter, whose torch has no CUDA."""
    if not cfg.gpus_per_node or cfg.python or cfg.container_image:
        return None
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    if "+cpu" not in torch and torch != "not installed":
        return None
    return (
        f"slurm.python: the job asks for {cfg.gpus_per_node} GPUs per node, but its nodes would run this "
        f"interpreter ({sys.executable}, torch {torch}: no CUDA): set slurm.python to the python of the nodes' "
        "CUDA environment (docs/install.md; `python` after a slurm.setup line that activates it), or "
        "slurm.container_image"
    )


def data_findings(data: DataConfig) -> tuple[list[str], list[str]]:
    """(refusals, notes) for the recipe's streams and tokenizer."""
    refusals: list[str] = []
    notes: list[str] = []
    streams = [*data.streams, *([data.validation] if data.validation is not None else [])]
    for stream in streams:
        if stream in streams[: streams.index(stream)]:
            continue
        if is_remote(stream.path):
            notes.append(f"data: {stream.path} is remote: not checked here (the nodes fetch it into {stream.local})")
            continue
        problem = stream_problem(stream)
        if problem and problem not in refusals:  # the train and val splits share one manifest
            refusals.append(problem)
    tok = data.tokenizer
    if tok.path is not None and not local_path(tok.path).is_file():
        refusals.append(
            f"data.tokenizer.path: {local_path(tok.path)}: no such file (the job reads its "
            f"{tok.kind} tokenizer there; the data recipe says where it comes from)"
        )
    elif tok.kind == "tiktoken" and tok.path is None:
        notes.append(f"data.tokenizer: tiktoken encoding {tok.name!r}: fetched into tiktoken's cache, not checked here")
    return refusals, notes


def stream_problem(stream: StreamConfig) -> str | None:
    """A local stream's manifest, split and shard files (sizes against the manifest; contents are the
    trainer's to verify)."""
    from elastic_pretrain.data.manifest import read_manifest

    root = local_path(stream.path)
    try:
        info = read_manifest(root).split(stream.split, str(root))
    except UserError as err:
        return str(err)
    missing = [s.name for s in info.shards if not _has_size(root / stream.split / s.name, s.bytes)]
    if not missing:
        return None
    return (
        f"{root / stream.split}: {len(missing)} of {len(info.shards)} shards missing or of another size "
        f"than the manifest says (first: {missing[0]}): run `elastic-pretrain prepare-data` again"
    )


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def run_dir_refusals(job: JobConfig, run_dir: Path) -> list[str]:
    """The run directory as the job will meet it: finished, a live job, past train.steps, another shape."""
    from elastic_pretrain.train.resume import check_before_launch

    files = RunFiles(run_dir)
    found = [r for r in (finished_refusal(files, job.train.steps), live_job_refusal(files)) if r]
    if not found:  # a finished run is said above; otherwise the trainer's own checks, before it starts
        try:
            check_before_launch(dataclasses.replace(job, run_dir=str(run_dir)))
        except UserError as err:
            found.append(str(err))
    return found
