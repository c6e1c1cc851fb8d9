"""Fill the sbatch template (``slurm/train.sbatch``) for one run.

Placeholders are ``{{NAME}}``. How a value is quoted depends on the line it sits on, so a
template author cannot get it wrong:

* on an ``#SBATCH`` line, sbatch's own parser reads the value: anything beyond a small safe set
  of characters is wrapped in double quotes with ``\\`` and ``"`` backslash-escaped (inside quotes
  sbatch keeps spaces, ``'``, ``#`` and ``$`` literally; an escaped space outside quotes would end
  the argument); a list gives one ``#SBATCH`` line per item;
* anywhere else the value is shell text: :func:`shlex.quote`, a list becomes quoted words;
* ``None`` drops the whole line (an option that is not set);
* :class:`Lines` (pre-rendered, already quoted) replace the whole line.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import string
import sys
from pathlib import Path

from elastic_pretrain.config import ConfigError
from elastic_pretrain.launch.config import SlurmConfig
from elastic_pretrain.launch.environment import export_lines, run_environment
from elastic_pretrain.launch.local import ERRORS_ENV
from elastic_pretrain.rundir import RunFiles

PLACEHOLDER_RE = re.compile(r"\{\{([A-Z][A-Z0-9_]*)\}\}")
DEFAULT_TEMPLATE = Path(__file__).resolve().parents[2] / "slurm" / "train.sbatch"
# A template may hard-code other values (a site's account, say) but not leave these out.
REQUIRED_PLACEHOLDERS = frozenset(
    {"NODES", "SIGNAL", "SIGNAL_LEAD_S", "LOG", "RUN_DIR", "PYTHON", "RETRIES", "TRAINER"}
)
_SBATCH_SAFE = frozenset(string.ascii_letters + string.digits + "_-.,:=@+/")


class Lines(tuple[str, ...]):
    """Whole lines, already quoted, that replace the line holding the placeholder."""


Value = str | int | list[str] | Lines | None


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """What to run: the job's name, where its files go, and the trainer command torchrun starts."""

    job_name: str
    run_dir: Path
    workdir: Path
    trainer: list[str]  # torchrun's training script + its arguments, e.g. ["-m", "elastic_pretrain.cli", "train", ...]
    # variables derived from the job (launch/environment.py: CUDA_DEVICE_MAX_CONNECTIONS); slurm.env wins
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # the resolved job (job.snapshot_job), written to <run_dir>/slurm/job.yaml at submit: what the trainer reads
    job_snapshot: str | None = None
    train_steps: int | None = None  # the job's train.steps: a finished run is submitted again only to train further


def sbatch_escape(value: str) -> str:
    """Quote ``value`` for an ``#SBATCH`` line, as sbatch's directive parser reads it back."""
    if any(c in value for c in "\n\r\0"):
        raise ConfigError(f"{value!r} contains a line break, which an #SBATCH line cannot hold: rename it")
    if value and all(c in _SBATCH_SAFE for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def output_pattern(path: Path) -> str:
    """``--output`` value for a literal path: ``%`` starts a Slurm filename pattern unless doubled
    (a path containing a backslash disables patterns altogether, so it is then left alone)."""
    text = str(path)
    return text if "\\" in text else text.replace("%", "%%")


def log_output(files: RunFiles) -> str:
    """``--output``: one log per Slurm job id (``train-%j.log``; a requeued job keeps its id and appends)."""
    if "\\" in str(files.slurm_dir):
        raise ConfigError(
            f"the run directory {str(files.run_dir)!r} contains a backslash, which turns off sbatch's --output "
            "patterns (the job's log is named by its id, %j): choose another --run-dir"
        )
    return output_pattern(files.slurm_dir) + "/" + files.job_log("%j").name


def fill(template: str, values: dict[str, Value]) -> str:
    """Substitute every ``{{NAME}}``; unknown names and unused required ones are errors."""
    used: set[str] = set()
    out: list[str] = []
    for lineno, line in enumerate(template.splitlines(), 1):
        names = PLACEHOLDER_RE.findall(line)
        unknown = [n for n in names if n not in values]
        if unknown:
            raise ConfigError(f"sbatch template line {lineno}: unknown placeholder {{{{{unknown[0]}}}}}")
        used.update(names)
        if any(values[n] is None for n in names):
            continue
        lines = [v for n in names if isinstance(v := values[n], Lines)]
        if lines:
            if len(names) != 1 or line.strip() != f"{{{{{names[0]}}}}}":
                raise ConfigError(f"sbatch template line {lineno}: a block placeholder must stand alone on its line")
            out.extend(lines[0])
            continue
        out.extend(_fill_line(line, values))
    missing = sorted(REQUIRED_PLACEHOLDERS & set(values) - used)
    if missing:
        raise ConfigError(f"sbatch template does not use {{{{{missing[0]}}}}}: compare it with slurm/train.sbatch")
    return "\n".join(out) + "\n"


def _fill_line(line: str, values: dict[str, Value]) -> list[str]:
    is_sbatch = line.lstrip().startswith("#SBATCH")
    lists = [values[n] for n in PLACEHOLDER_RE.findall(line) if isinstance(values[n], list)]
    if is_sbatch and lists:  # one #SBATCH line per item
        (name,) = PLACEHOLDER_RE.findall(line)
        items = values[name]
        assert isinstance(items, list)
        return [line.replace(f"{{{{{name}}}}}", sbatch_escape(item)) for item in items]

    def quote(m: re.Match[str]) -> str:
        value = values[m.group(1)]
        if isinstance(value, list):
            return " ".join(shlex.quote(v) for v in value)
        text = str(value)
        return sbatch_escape(text) if is_sbatch else shlex.quote(text)

    return [PLACEHOLDER_RE.sub(quote, line)]


def template_values(cfg: SlurmConfig, spec: LaunchSpec) -> dict[str, Value]:
    """The placeholder values of ``slurm/train.sbatch`` for one run."""
    for what, path in (("run dir", spec.run_dir), ("working directory", spec.workdir)):
        if not path.is_absolute():
            raise ConfigError(f"the {what} must be an absolute path, got {path}")
        if any(c in str(path) for c in "\n\r\0"):
            raise ConfigError(f"the {what} {str(path)!r} contains a line break: choose another --run-dir")
    files = RunFiles(spec.run_dir)
    exports = Lines(
        export_lines(gpus=cfg.gpus_per_node > 0, derived=spec.env, user=cfg.env, defaults=run_environment(spec.run_dir))
    )
    return {
        "JOB_NAME": spec.job_name,
        "NODES": cfg.nodes,
        "GPUS_PER_NODE": cfg.gpus_per_node or None,
        "CPUS_PER_TASK": cfg.cpus_per_task,
        "TIME": cfg.time,
        "PARTITION": cfg.partition,
        "ACCOUNT": cfg.account,
        "SIGNAL": cfg.signal,
        "SIGNAL_LEAD_S": cfg.signal_lead_s,
        "LOG": log_output(files),
        "SBATCH_ARGS": list(cfg.sbatch_args) or None,
        "RUN_DIR": str(spec.run_dir),
        "WORKDIR": str(spec.workdir),
        "PYTHON": cfg.python or ("python" if cfg.container_image else sys.executable),
        "NPROC_PER_NODE": cfg.procs_per_node,
        "RETRIES": cfg.retries,
        "ON_FAILURE": cfg.on_failure,
        "TRAINER": list(spec.trainer),
        "SETUP": list(cfg.setup),
        "ENV_EXPORTS": exports,
        "ERRORS_ENV": ERRORS_ENV,  # where the node launcher and its ranks leave user errors (launch/local.py)
        **node_launch_values(cfg, spec),
    }


def node_launch_values(cfg: SlurmConfig, spec: LaunchSpec) -> dict[str, Value]:
    """Extra ``srun`` options (GPUs, container) and ``torchrun`` options (NUMA binding) of each node's task."""
    srun: list[str] = []
    if cfg.gpus_per_node:
        # One task per node runs torchrun, which gives local rank i GPU i: the task must see all of the
        # node's GPUs, whatever binding the site sets by default (e.g. --gpu-bind=closest would hide some).
        srun += [f"--gpus-per-node={cfg.gpus_per_node}", "--gpu-bind=none"]
    if cfg.container_image:
        workdir = cfg.container_workdir or str(spec.workdir)
        inside = cfg.container_paths()
        for what, path in (("run directory", str(spec.run_dir)), ("working directory", workdir)):
            if not any(path == dst or path.startswith(dst.rstrip("/") + "/") for dst in inside):
                top = "/" + path.strip("/").split("/")[0]
                raise ConfigError(
                    f"slurm.container_mounts: the {what} {path} is not mounted into the container: add a mount "
                    f"that holds it at the same path (e.g. {top}:{top})"
                )
        srun += [f"--container-image={cfg.container_image}", f"--container-workdir={workdir}"]
        if cfg.container_mounts:
            srun.append(f"--container-mounts={','.join(cfg.container_mounts)}")
    torchrun = [] if cfg.numa_binding == "none" else [f"--numa-binding={cfg.numa_binding}"]
    return {"SRUN_EXTRA": srun, "TORCHRUN_EXTRA": torchrun}


def render(cfg: SlurmConfig, spec: LaunchSpec) -> str:
    """The batch script for ``spec`` under ``cfg`` (from ``cfg.template`` or ``slurm/train.sbatch``)."""
    path = Path(cfg.template) if cfg.template else DEFAULT_TEMPLATE
    try:
        template = path.read_text()
    except OSError as err:
        raise ConfigError(
            f"cannot read the sbatch template {path} ({err.strerror}): set slurm.template to a copy of "
            "slurm/train.sbatch, or run from a checkout of the repository"
        ) from None
    values = template_values(cfg, spec)
    for name in ("SRUN_EXTRA", "TORCHRUN_EXTRA", "SETUP"):  # an older site template would drop them silently
        if values[name] and f"{{{{{name}}}}}" not in template:
            what = "slurm.setup lines" if name == "SETUP" else "GPU/container/NUMA settings"
            raise ConfigError(
                f"sbatch template {path} does not use {{{{{name}}}}}, so the job's {what} would be ignored: add it "
                "as slurm/train.sbatch does"
            )
    return fill(template, values)
