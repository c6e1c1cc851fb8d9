"""Talk to Slurm: submit a rendered job, read its state, cancel it.

Every Slurm command runs as an argument list (``subprocess.run([...])``), never through a shell,
so run directories, job names and option values reach Slurm exactly as given.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

from elastic_pretrain.checkpoint.latest import latest_problem
from elastic_pretrain.checkpoint.store import CheckpointStore
from elastic_pretrain.config import clip
from elastic_pretrain.errors import UserError
from elastic_pretrain.files import ensure_dir, read_bounded, read_text_or_none, write_atomic, write_private
from elastic_pretrain.launch.config import SlurmConfig
from elastic_pretrain.launch.layout import last_committed_step
from elastic_pretrain.launch.render import LaunchSpec, render
from elastic_pretrain.rundir import RunFiles
from elastic_pretrain.tracking.store import read_run_id

# States in which a job still holds (or waits for) resources.
LIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
     "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD"}
)  # fmt: skip
_NO_SLURM_HINT = (
    "run this where Slurm's commands are installed (a login node); for the local test cluster run "
    "slurm/local-cluster/up.sh, then `source /tmp/elastic-slurm/env.sh`"
)
# sbatch error text -> the flag that fixes it
_SBATCH_HINTS = (
    (re.compile(r"invalid partition", re.I), "check --partition (`sinfo -s` lists the partitions)"),
    (re.compile(r"invalid account|account.*(not|invalid)", re.I), "check --account (`sacctmgr show assoc user=$USER`)"),
    (re.compile(r"time limit|invalid --time", re.I), "check --time against the partition's MaxTime (`sinfo -s`)"),
    (
        re.compile(r"node configuration is not available|node count specification invalid|more processors", re.I),
        "the partition has no nodes that fit: lower --nodes / --gpus-per-node / slurm.cpus_per_task",
    ),
    (re.compile(r"qos", re.I), "check the --qos in slurm.sbatch_args"),
    (re.compile(r"invalid (generic resource|gres)", re.I), "this partition has no GPUs: use --gpus-per-node 0"),
)


@dataclasses.dataclass(frozen=True)
class JobState:
    """What Slurm knows about a job."""

    job_id: str
    state: str
    reason: str
    restarts: int | None
    exit_code: str
    nodes: str
    elapsed: str
    name: str

    @property
    def live(self) -> bool:
        return self.state.split()[0] in LIVE_STATES if self.state else False


def run_slurm(argv: list[str], *, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run one Slurm client command; a missing binary is a :class:`UserError`."""
    try:
        return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False, timeout=120)
    except FileNotFoundError:
        raise UserError(f"{argv[0]} not found: {_NO_SLURM_HINT}") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{argv[0]} did not answer within 120 s: is slurmctld up? (`scontrol ping`)") from None


# sbatch's own usage errors (getopt): the line names the option; "Try sbatch --help" after it does not
_SBATCH_USAGE = re.compile(r"unrecognized option|invalid option|unknown option|requires an argument", re.I)
_SBATCH_NOISE = re.compile(r"^Try .*--help", re.I)


def explain_sbatch_error(stderr: str) -> str:
    """sbatch's own error line (one line) plus the flag that fixes it."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not _SBATCH_NOISE.match(ln.strip())]
    usage = [ln for ln in lines if _SBATCH_USAGE.search(ln)]
    if usage:  # e.g. "sbatch: unrecognized option '--jobid=4321'": an option in slurm.sbatch_args
        return f"sbatch rejected the job: {usage[0]}: fix or remove that option (slurm.sbatch_args)"
    errors = (
        [ln for ln in lines if "fatal" in ln.lower()]
        or [ln for ln in lines if "error" in ln.lower()]
        or lines
        or ["sbatch failed without a message"]
    )
    message = re.sub(r"^sbatch:\s*((error|fatal):\s*)?(Batch job submission failed:\s*)?", "", errors[-1])
    if re.search(r"configuration source|Unable to contact slurm controller|Connection refused", message, re.I):
        return f"sbatch cannot reach a Slurm cluster ({message}): {_NO_SLURM_HINT}"
    for pattern, hint in _SBATCH_HINTS:
        if pattern.search(message):
            return f"sbatch rejected the job: {message}: {hint}"
    return f"sbatch rejected the job: {errors[-1]}: fix the Slurm option it names"


def submit(cfg: SlurmConfig, spec: LaunchSpec) -> str:
    """Render the script into ``<run_dir>/slurm/``, snapshot the job there, submit, record and return the job id."""
    files = RunFiles(spec.run_dir)
    check_can_submit(files, spec.train_steps)
    script = render(cfg, spec)
    ensure_dir(files.slurm_dir, root=files.run_dir)  # a planted slurm -> elsewhere is refused, not followed
    write_private(files.script, script, root=files.run_dir)  # it holds slurm.env values and the overrides: owner-only
    if spec.job_snapshot is not None:  # what every (re)start trains; secrets included
        write_private(files.job_snapshot, spec.job_snapshot, root=files.run_dir)
    files.cancelled.unlink(missing_ok=True)
    # training further (check_can_submit let a finished run through): the batch script must not take an old
    # FINISHED for this job's, should the job end before the trainer's start removes it
    finished = _read_marker(files.finished)
    files.finished.unlink(missing_ok=True)
    proc = run_slurm(["sbatch", "--parsable", str(files.script)], cwd=spec.workdir)
    if proc.returncode != 0:
        if finished is not None:  # nothing was submitted: the run is as finished as before
            write_atomic(files.finished, finished, root=files.run_dir)
        raise UserError(explain_sbatch_error(proc.stderr or proc.stdout))
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise UserError(f"sbatch printed {proc.stdout.strip()!r} instead of a job id: check its output above")
    write_atomic(files.job_id, job_id + "\n", root=files.run_dir)
    return job_id


def _read_marker(path: Path) -> bytes | None:
    """A marker file's bytes (a link, FIFO or oversized file there: one line), None if there is none."""
    try:
        return read_bounded(path, "marker")
    except FileNotFoundError:
        return None


def read_job_id(files: RunFiles) -> str | None:
    """The job id ``submit`` recorded, or None. It is checked to be a number before any Slurm command
    sees it: a run directory may come from someone else, and a crafted value (``--user=...``) would be
    read by squeue/sacct/scancel as an option."""
    job_id = read_text_or_none(files.job_id, "job_id")  # a FIFO or /dev/zero there: one line, no hang
    if job_id is not None and not re.fullmatch(r"[0-9]{1,20}", job_id):
        raise UserError(
            f"{files.job_id}: holds {clip(job_id, 40)!r}, not a Slurm job id (a number): delete the file "
            "(its job is then unknown to status/cancel) or write the right id into it"
        )
    return job_id


def check_can_submit(files: RunFiles, steps: int | None = None) -> None:
    """Refuse to start a second job on a run directory that is finished (unless ``steps``, the job's
    train.steps, trains it further) or already has a live job."""
    refusal = finished_refusal(files, steps) or live_job_refusal(files)
    if refusal:
        raise UserError(refusal)


def finished_refusal(files: RunFiles, steps: int | None) -> str | None:
    """A finished run directory takes a job only to train further: ``steps`` above its last committed step."""
    if not files.finished.exists():
        return None
    done = last_committed_step(files)
    if steps is not None and done is not None and steps > done:
        return None
    at = f" at step {done}" if done is not None else ""
    further = f"raise train.steps above {done}" if done is not None else "delete that file"
    return (
        f"{files.run_dir} has finished training{at} ({files.finished} exists): to train it further {further} "
        "(docs/run-directory.md); for a new run pick another --run-dir"
    )


def live_job_refusal(files: RunFiles) -> str | None:
    job_id = read_job_id(files)
    if job_id is None:
        return None
    try:
        state = query_job(job_id)
    except UserError:
        return None  # no Slurm to ask: sbatch will report that itself
    if state is not None and state.live:
        return (
            f"{files.run_dir} already has job {job_id} ({state.state}): wait for it, or stop it with "
            f"`elastic-pretrain cancel {files.run_dir}`"
        )
    return None


def query_job(job_id: str) -> JobState | None:
    """The job's state from slurmctld (``squeue``), else from accounting (``sacct``); ``None`` if unknown."""
    if not re.fullmatch(r"[0-9]{1,20}", job_id):  # never an option to squeue/sacct (see read_job_id)
        raise UserError(f"{clip(job_id, 40)!r} is not a Slurm job id (a number)")
    fields = "JobID:|,State:|,Reason:|,RestartCnt:|,exit_code:|,NodeList:|,TimeUsed:|,Name:|"
    proc = run_slurm(["squeue", "-h", "-j", job_id, "--states=all", "-O", fields])
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"{job_id}|")]
    if proc.returncode == 0 and rows:
        jid, state, reason, restarts, code, nodes, used, name = (rows[0].rstrip("|").split("|", 7) + [""] * 8)[:8]
        return JobState(
            jid, state, reason, int(restarts) if restarts.isdigit() else None, _exit_code(code), nodes, used, name
        )
    # Ended long ago: slurmctld forgot it; the accounting database (if any) still knows.
    proc = run_slurm(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State,ExitCode,NodeList,Elapsed,JobName"])
    rows = [ln for ln in proc.stdout.splitlines() if ln.split("|", 1)[0] == job_id]
    if proc.returncode == 0 and rows:
        jid, state, code, nodes, elapsed, name = (rows[0].split("|", 5) + [""] * 6)[:6]
        return JobState(jid, state, "", None, code, nodes, elapsed, name)
    return None


def _exit_code(raw: str) -> str:
    """squeue's exit_code is a wait status: show it as Slurm's ``code:signal``."""
    if not raw.isdigit():
        return raw
    status = int(raw)
    return f"{(status >> 8) & 0xFF}:{status & 0x7F}"


@dataclasses.dataclass(frozen=True)
class RunStatus:
    """``elastic-pretrain status``: the job, its restarts, and how far training got."""

    run_dir: str
    job_id: str | None
    job: JobState | None
    last_step: int | None
    finished: bool
    mlflow_run_id: str | None
    log: str
    latest_problem: str | None = None  # ``checkpoints/latest`` is stale: what is wrong with it, in one line

    def as_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out["job"] = dataclasses.asdict(self.job) if self.job else None
        return out


def run_status(run_dir: Path) -> RunStatus:
    files = RunFiles(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory (give the --run-dir the job was submitted with)")
    job_id = read_job_id(files)
    return RunStatus(
        run_dir=str(run_dir),
        job_id=job_id,
        job=query_job(job_id) if job_id else None,
        last_step=last_committed_step(files),
        latest_problem=latest_problem(CheckpointStore(files.checkpoints)),
        finished=files.finished.exists(),
        mlflow_run_id=read_run_id(files.mlflow_run_id),  # a link, FIFO or junk there: one line
        log=str(files.job_log(job_id) if job_id else files.job_log("<id>")),
    )


def cancel(run_dir: Path) -> str:
    """Cancel the run's job for good: mark it so the batch script does not requeue, then ``scancel``."""
    files = RunFiles(run_dir)
    job_id = read_job_id(files)
    if job_id is None:
        raise UserError(f"{run_dir}: no Slurm job recorded ({files.job_id} is missing): was it submitted from here?")
    write_atomic(files.cancelled, job_id + "\n", root=run_dir)
    proc = run_slurm(["scancel", job_id])
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise UserError(f"scancel {job_id} failed: {msg[-1] if msg else 'no message'}")
    return job_id
