"""``elastic-pretrain submit | status | cancel``: run a training job on a Slurm cluster."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_pretrain.errors import UserError
from elastic_pretrain.launch.config import SlurmConfig
from elastic_pretrain.launch.environment import job_environment
from elastic_pretrain.launch.preflight import Preflight, preflight
from elastic_pretrain.launch.render import LaunchSpec, render
from elastic_pretrain.launch.slurm import cancel, query_job, read_job_id, run_status, submit
from elastic_pretrain.rundir import RunFiles

if TYPE_CHECKING:  # annotations only: the command imports what it runs when it runs
    from elastic_pretrain.job import JobConfig

# submit flag -> SlurmConfig field
_FLAG_FIELDS = (
    "nodes", "gpus_per_node", "nproc_per_node", "cpus_per_task", "time", "partition", "account",
    "signal", "signal_lead_s", "retries", "on_failure",
)  # fmt: skip


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "submit",
        help="submit a training job to Slurm (requeues itself on preemption)",
        description="Render slurm/train.sbatch for a job into <run_dir>/slurm/train.sbatch and submit it with "
        "sbatch. The job YAML may hold a `slurm:` section (see SlurmConfig); flags override it. key=value "
        "overrides follow the job file and are passed on to `elastic-pretrain train`.",
    )
    p.add_argument("job", type=Path, help="job YAML (jobs/<name>.yaml)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides, e.g. train.steps=100")
    p.add_argument("--nodes", type=int, help="number of nodes")
    p.add_argument("--gpus-per-node", type=int, dest="gpus_per_node", help="GPUs per node (0: CPU nodes, gloo)")
    p.add_argument("--nproc-per-node", type=int, dest="nproc_per_node", help="trainer processes per node")
    p.add_argument("--cpus-per-task", type=int, dest="cpus_per_task", help="CPUs for each node's task")
    p.add_argument("--time", help="time limit per (re)start: 90, 01:30:00 or 2-00:00:00")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--account", help="Slurm account")
    p.add_argument("--signal", help="preemption signal: TERM (default), USR1 or USR2")
    p.add_argument("--signal-lead", type=int, dest="signal_lead_s", metavar="SECONDS", help="signal lead time")
    p.add_argument("--retries", type=int, help="how many times the job may requeue itself")
    p.add_argument("--on-failure", choices=["fail", "requeue"], dest="on_failure", help="after a trainer crash")
    p.add_argument("--run-dir", type=Path, dest="run_dir", help="run directory (default: run_dir in the YAML, "
                   "else runs/<name>)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the batch script, submit nothing")
    p.set_defaults(handler=cmd_submit)

    p = sub.add_parser("status", help="state of a run's Slurm job, restarts, last checkpoint")
    p.add_argument("run_dir", type=Path, help="the run directory given to submit")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_status)

    p = sub.add_parser("cancel", help="cancel a run's Slurm job (it is not requeued)")
    p.add_argument("run_dir", type=Path, help="the run directory given to submit")
    p.set_defaults(handler=cmd_cancel)


@dataclasses.dataclass(frozen=True)
class SubmitPlan:
    """Everything ``submit`` decided from the job YAML, the overrides and the flags."""

    config: SlurmConfig
    spec: LaunchSpec
    summary: tuple[str, ...] = ()  # layout and memory at the allocation's world size
    checks: Preflight = dataclasses.field(default_factory=lambda: Preflight((), ()))  # launch/preflight.py


def plan_submit(args: argparse.Namespace) -> SubmitPlan:
    from elastic_pretrain.job import snapshot_job
    from elastic_pretrain.job_loader import load_job

    job_path: Path = args.job.expanduser().absolute()
    # Validate the whole job here: a config error must not first surface on the compute nodes.
    job = load_job(job_path, list(args.overrides))
    cfg = job.slurm
    flags = {k: getattr(args, k) for k in _FLAG_FIELDS if getattr(args, k, None) is not None}
    if flags:
        cfg = dataclasses.replace(cfg, **flags)  # re-validates
    summary = check_allocation(job, cfg)
    run_dir = args.run_dir or job.run_path
    run_dir = run_dir.expanduser().absolute()
    env = job_environment(job.parallel, gpus=cfg.gpus_per_node > 0)
    spec = LaunchSpec(job_name=job.name, run_dir=run_dir, workdir=Path.cwd(), trainer=trainer_command(run_dir),
                      env=env, job_snapshot=snapshot_job(job), train_steps=job.train.steps)  # fmt: skip
    return SubmitPlan(cfg, spec, tuple(summary), preflight(job, cfg, run_dir))


def check_allocation(job: JobConfig, cfg: SlurmConfig) -> list[str]:
    """The job's layout and memory at the allocation's world size (nodes x processes per node), before
    anything reaches Slurm: a layout the mesh cannot take fails here, not on 128 GPUs. Returns the
    summary lines (layout, memory) that ``--dry-run`` prints."""
    from elastic_pretrain.config import ConfigError
    from elastic_pretrain.parallel.validate import check_layout, check_memory

    world = cfg.nodes * cfg.procs_per_node
    try:
        layout = check_layout(job, world)
        memory = check_memory(job, world, cfg.gpu_memory_bytes)
    except ConfigError as err:
        raise ConfigError(
            f"{err} [submit: world size {world} = --nodes {cfg.nodes} x {cfg.procs_per_node} process(es) per node]"
        ) from None
    return [f"layout: {layout.describe()}", memory]


def trainer_command(run_dir: Path) -> list[str]:
    """What torchrun starts on every node: ``elastic-pretrain train`` of the job as submitted (the snapshot in
    the run directory, overrides applied) into this run dir."""
    return ["-m", "elastic_pretrain.cli", "train", str(RunFiles(run_dir).job_snapshot), "--run-dir", str(run_dir)]


def cmd_submit(args: argparse.Namespace) -> int:
    plan = plan_submit(args)
    checks = plan.checks
    if args.dry_run:
        sys.stdout.write(render(plan.config, plan.spec))
        for line in (*plan.summary, *checks.notes):
            print(f"# {line}", file=sys.stderr)
        for line in checks.refusals:
            print(f"# refused: {line}", file=sys.stderr)
        files = RunFiles(plan.spec.run_dir)
        if checks.refusals:
            print(f"# dry run: the real submit would refuse this job ({len(checks.refusals)} refusal(s) above); "
                  "nothing written or submitted", file=sys.stderr)  # fmt: skip
            return 2
        print(f"# dry run: nothing written or submitted (would write {files.script} and {files.job_snapshot})",
              file=sys.stderr)  # fmt: skip
        return 0
    if checks.refusals:
        more = len(checks.refusals) - 1
        raise UserError(checks.refusals[0] + (f" (and {more} more: submit --dry-run lists them)" if more else ""))
    job_id = submit(plan.config, plan.spec)
    files = RunFiles(plan.spec.run_dir)
    run_dir = shlex.quote(str(files.run_dir))
    print(f"submitted job {job_id}: {plan.config.nodes} node(s), run dir {files.run_dir}")
    print(f"  job:    {files.job_snapshot} (what every restart trains)")
    print(f"  log:    {files.job_log(job_id)}")
    for line in checks.notes:  # after the submit: an error stays the only line
        print(f"  note:   {line}")
    print(f"  status: elastic-pretrain status {run_dir}")
    print(f"  cancel: elastic-pretrain cancel {run_dir}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    st = run_status(args.run_dir.expanduser().absolute())
    if args.json:
        print(json.dumps(st.as_dict(), sort_keys=True))
        return 0
    job = st.job
    if st.job_id is None:
        slurm = "no job submitted from here"
    elif job is None:
        slurm = f"job {st.job_id}: no longer known to Slurm (no accounting database?)"
    else:
        reason = f", {job.reason}" if job.reason and job.reason != "None" else ""
        slurm = f"job {job.job_id} ({job.name}): {job.state}{reason}, nodes {job.nodes or '-'}, ran {job.elapsed}"
        if job.state not in ("PENDING", "RUNNING"):
            slurm += f", exit {job.exit_code}"
    restarts = "unknown" if job is None or job.restarts is None else str(job.restarts)
    rows = [
        ("run dir", st.run_dir),
        ("slurm", slurm),
        ("restarts", restarts),
        ("last step", "no checkpoint yet" if st.last_step is None else str(st.last_step)),
        ("finished", "yes" if st.finished else "no"),
        ("mlflow run", st.mlflow_run_id or "-"),
        ("log", st.log),
    ]
    if st.latest_problem:
        rows.append(("warning", f"{st.latest_problem} (the next resumed run repairs it)"))
    for key, value in rows:
        print(f"{key + ':':<11} {value}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    run_dir = args.run_dir.expanduser().absolute()
    job_id = read_job_id(RunFiles(run_dir))
    state = query_job(job_id) if job_id else None
    if state is not None and not state.live:
        print(f"job {job_id} already ended ({state.state}); nothing to cancel")
        return 0
    job_id = cancel(run_dir)
    print(f"cancelled job {job_id}; it will not be requeued (submit again to resume from the last checkpoint)")
    return 0
