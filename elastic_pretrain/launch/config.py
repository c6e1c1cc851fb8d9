"""``SlurmConfig``: how a training job is laid out on a Slurm cluster.

A job YAML may hold it under ``slurm:``; ``elastic-pretrain submit`` flags override it. Every
value is checked here, before anything reaches ``sbatch``, and a bad one raises a one-line
:class:`~elastic_pretrain.config.ConfigError` that names the key and the fix.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from elastic_pretrain.config import ConfigError, field, parse_bytes

# Signals the trainer handles as "checkpoint at the next step boundary, then exit 0".
PREEMPT_SIGNALS = ("TERM", "USR1", "USR2")

# sbatch options the template sets itself; `sbatch_args` may not override them.
MANAGED_SBATCH_OPTIONS = frozenset(
    {
        "job-name", "J", "nodes", "N", "ntasks", "n", "ntasks-per-node", "gpus-per-node", "gpus", "G",
        "cpus-per-task", "c", "time", "t", "partition", "p", "account", "A", "signal", "requeue",
        "no-requeue", "open-mode", "output", "o", "error", "e", "chdir", "D", "parsable", "wrap",
        "array", "a",
    }
)  # fmt: skip

_TIME_RE = re.compile(
    r"^(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)$"
)
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SBATCH_ARG_RE = re.compile(r"^--[a-z][a-z0-9-]*(=.*)?$", re.DOTALL)


def parse_time_limit(text: str) -> int | None:
    """Seconds in a Slurm time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``).

    ``None`` for ``UNLIMITED``/``INFINITE``; raises :class:`ConfigError` for anything else.
    """
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME_RE.match(text.strip())
    if not m:
        raise ConfigError(
            f"slurm.time (--time): {text!r} is not a Slurm time limit: write minutes (90), HH:MM:SS (01:30:00) "
            "or D-HH:MM:SS (2-00:00:00)"
        )
    g = {k: int(v) for k, v in m.groupdict().items() if v is not None}
    if "d" in g:
        return ((g["d"] * 24 + g["dh"]) * 60 + g.get("dm", 0)) * 60 + g.get("ds", 0)
    if "c" in g:  # HH:MM:SS
        return (g["a"] * 60 + g["b"]) * 60 + g["c"]
    return g["a"] * 60 + g.get("b", 0)  # MM or MM:SS


def normalize_signal(name: str) -> str:
    """``"SIGUSR1"``/``"usr1"``/``"10"``-style names to Slurm's short form (``"USR1"``)."""
    short = name.strip().upper().removeprefix("SIG")
    numbers = {"15": "TERM", "10": "USR1", "12": "USR2"}
    short = numbers.get(short, short)
    if short not in PREEMPT_SIGNALS:
        raise ConfigError(f"slurm.signal: {name!r} is not supported: use one of {', '.join(PREEMPT_SIGNALS)}")
    return short


@dataclasses.dataclass(kw_only=True)
class SlurmConfig:
    """Resources, time limit, preemption and retry policy of a multi-node training job."""

    nodes: int = field(1, doc="Number of nodes; one torchrun per node (`--nodes`).")
    gpus_per_node: int = field(0, doc="GPUs per node (`--gpus-per-node`); 0 for CPU nodes (gloo instead of NCCL).")
    gpu_memory: str | None = field(
        None,
        doc="Memory of one GPU, e.g. 80GiB (H100/A100 80 GB), 141GB (H200): `config --world-size` and `submit` "
        "refuse a job whose memory estimate per GPU exceeds 90% of it; unset: not checked.",
    )
    nproc_per_node: int | None = field(
        None, doc="Trainer processes per node; default: gpus_per_node on GPU nodes, 1 on CPU nodes."
    )
    cpus_per_task: int | None = field(
        None, doc="CPUs for each node's task (all its trainer processes together); default: the cluster's."
    )
    time: str | None = field(
        None, doc="Time limit per (re)start, in Slurm format: 90, 01:30:00 or 2-00:00:00; default: the partition's."
    )
    partition: str | None = field(None, doc="Partition (`--partition`); default: the cluster's default partition.")
    account: str | None = field(None, doc="Account to charge (`--account`); default: the user's default account.")
    signal: str = field(
        "TERM",
        doc="Signal that asks the trainer to checkpoint and stop: TERM (default), USR1 or USR2. It is sent "
        "signal_lead_s before the time limit, on preemption, and forwarded by the batch script to the "
        "processes of the training step (each node's launcher passes it on to its ranks and never acts on it). "
        "TERM is the safe default: NCCL has been known to "
        "swallow USR1, and TERM is also what Slurm sends when it finally kills a job.",
    )
    signal_lead_s: int = field(
        300,
        doc="Seconds before the time limit to send `signal` (Slurm may send it up to 60 s earlier); must "
        "cover one training step plus a checkpoint save.",
    )
    retries: int = field(
        3, doc="How many times the job requeues itself (preemption, time limit, failures if on_failure=requeue)."
    )
    on_failure: Literal["fail", "requeue"] = field(
        "fail",
        doc="When the trainer exits non-zero without being signalled: 'fail' ends the job FAILED at once; "
        "'requeue' restarts it from the last checkpoint (counts against retries).",
    )
    sbatch_args: list[str] = field(
        factory=list,
        doc="Extra sbatch options, one per item, as --name=value (e.g. --qos=high, --mem=0, "
        "--exclusive); options the template sets (nodes, time, signal, ...) have their own keys.",
    )
    env: dict[str, str] = field(factory=dict, doc="Environment variables exported in the job (e.g. NCCL_DEBUG: INFO).")
    python: str | None = field(
        None,
        doc="Python interpreter on the compute nodes; default: the one running `submit` (shared filesystem). A GPU "
        "job needs one with CUDA torch: submit refuses a CPU-only default. `python` after a slurm.setup line that "
        "activates an environment.",
    )
    setup: list[str] = field(
        factory=list,
        doc="Site shell lines the batch script runs before any node starts, one command per item (module load "
        "cuda/12.4, source /shared/venv/bin/activate); srun passes the environment they set on to every node. A "
        "failing line ends the job (exit 1) with its text in the log.",
    )
    template: str | None = field(
        None, doc="sbatch template to render instead of slurm/train.sbatch (same @@PLACEHOLDERS@@)."
    )
    # GPU clusters: container, binding ------------------------------------------------------------
    container_image: str | None = field(
        None,
        doc="Run each node's task in this container (pyxis/enroot `srun --container-image`): a registry "
        "image (nvcr.io#nvidia/pytorch:25.10-py3) or a squashfs file; elastic-pretrain must be installed in it "
        "(docs/install.md). Unset: the nodes' own Python.",
    )
    container_mounts: list[str] = field(
        factory=list,
        doc="With container_image: host paths mounted into the container (`--container-mounts`), each SRC:DST, "
        "SRC:DST:FLAGS or one path mounted at itself; the working directory and the run directory must be inside one.",
    )
    container_workdir: str | None = field(
        None, doc="With container_image: the working directory inside the container; default: the submit directory."
    )
    numa_binding: Literal["none", "node", "socket", "exclusive", "core-complex"] = field(
        "none",
        doc="torchrun --numa-binding: pin each rank to CPUs near its GPU ('node' is the safe choice). Needs torch "
        ">= 2.9 and `numactl` on the nodes (or in the container); 'none' leaves placement to the OS.",
    )

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"slurm.nodes must be >= 1 (got {self.nodes}): pass --nodes N with N >= 1")
        if self.gpus_per_node < 0:
            raise ConfigError(f"slurm.gpus_per_node must be >= 0 (got {self.gpus_per_node}); use 0 for CPU nodes")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise ConfigError(
                f"slurm.nproc_per_node must be >= 1 (got {self.nproc_per_node}); leave it unset for the default"
            )
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ConfigError(f"slurm.cpus_per_task must be >= 1 (got {self.cpus_per_task}); leave it unset")
        self.signal = normalize_signal(self.signal)
        if self.gpu_memory is not None:
            self.gpu_memory_bytes  # noqa: B018  (parses it: a bad size fails when the job loads)
        if not 0 <= self.signal_lead_s <= 65535:
            raise ConfigError(f"slurm.signal_lead_s must be in 0..65535 (got {self.signal_lead_s})")
        if self.retries < 0:
            raise ConfigError(f"slurm.retries must be >= 0 (got {self.retries}); 0 disables requeueing")
        if self.time is not None:
            limit = parse_time_limit(self.time)
            if limit == 0:
                raise ConfigError("slurm.time (--time): a limit of 0 would never run: give minutes, e.g. --time 60")
            if limit is not None and self.signal_lead_s >= limit:
                raise ConfigError(
                    f"slurm.signal_lead_s={self.signal_lead_s} is not below slurm.time={self.time} ({limit} s): "
                    "lower --signal-lead or raise --time"
                )
        for name, value in (("partition", self.partition), ("account", self.account)):
            if value is not None and not re.fullmatch(r"[A-Za-z0-9_.,+-]+", value):
                raise ConfigError(f"slurm.{name}: {value!r} is not a Slurm {name} name (letters, digits, _ . , + -)")
        for arg in self.sbatch_args:
            _check_sbatch_arg(arg)
        for line in self.setup:
            if not isinstance(line, str) or not line.strip() or any(c in line for c in "\n\r\0"):
                raise ConfigError(
                    f"slurm.setup: {line!r} is not one shell command: give one line per item, e.g. "
                    "[module load cuda/12.4, source /shared/venv/bin/activate]"
                )
        self._check_container()
        for key, value in self.env.items():
            if not _ENV_KEY_RE.match(key):
                raise ConfigError(f"slurm.env: {key!r} is not a variable name (letters, digits, _; not first a digit)")
            if "\0" in str(value):
                raise ConfigError(f"slurm.env.{key}: the value contains a NUL byte")

    def _check_container(self) -> None:
        if self.container_image is None:
            if self.container_mounts or self.container_workdir:
                raise ConfigError(
                    "slurm.container_mounts/container_workdir: set only with slurm.container_image (pyxis); "
                    "remove them or name the image"
                )
            return
        if not self.container_image or any(c in self.container_image for c in " \t\n\r\0,"):
            raise ConfigError(
                f"slurm.container_image: {self.container_image!r} is not an image name or path "
                "(e.g. nvcr.io#nvidia/pytorch:25.10-py3 or /shared/images/train.sqsh)"
            )
        for mount in self.container_mounts:
            parts = mount.split(":")
            if "," in mount or not 1 <= len(parts) <= 3 or not all(p.startswith("/") for p in parts[:2]):
                raise ConfigError(
                    f"slurm.container_mounts: {mount!r} is not SRC:DST[:FLAGS] with absolute paths (one mount per "
                    "item, e.g. /lustre:/lustre)"
                )
        if self.container_workdir is not None and not self.container_workdir.startswith("/"):
            raise ConfigError(f"slurm.container_workdir: {self.container_workdir!r} must be an absolute path")

    def container_paths(self) -> list[str]:
        """Where the mounts appear inside the container (DST of each SRC:DST, or the path itself)."""
        return [m.split(":")[1] if ":" in m else m for m in self.container_mounts]

    @property
    def gpu_memory_bytes(self) -> int | None:
        """``gpu_memory`` in bytes (None when unset)."""
        if self.gpu_memory is None:
            return None
        try:
            return parse_bytes(str(self.gpu_memory))
        except ConfigError:
            raise ConfigError(
                f"slurm.gpu_memory: cannot read {self.gpu_memory!r}: write a size such as 80GiB, 141GB or 96G"
            ) from None

    @property
    def procs_per_node(self) -> int:
        """Trainer processes per node (``nproc_per_node`` or its default)."""
        if self.nproc_per_node is not None:
            return self.nproc_per_node
        return self.gpus_per_node if self.gpus_per_node > 0 else 1


def managed_option(name: str) -> str | None:
    """The managed option ``--name`` means to sbatch, else None. sbatch (getopt_long) takes any unambiguous
    prefix of a long option (``--outp`` is ``--output``), so a prefix of a managed option counts as it."""
    if name in MANAGED_SBATCH_OPTIONS:
        return name
    matches = sorted(o for o in MANAGED_SBATCH_OPTIONS if len(o) > 1 and o.startswith(name))
    return matches[0] if matches else None


def _check_sbatch_arg(arg: str) -> None:
    if "\n" in arg or "\r" in arg or "\0" in arg:
        raise ConfigError(f"slurm.sbatch_args: {arg!r} contains a line break; give one option per item")
    if not _SBATCH_ARG_RE.match(arg):
        raise ConfigError(
            f"slurm.sbatch_args: {arg!r} is not a long sbatch option: write it as --name=value (e.g. --qos=high)"
        )
    name = managed_option(arg[2:].split("=", 1)[0])
    if name is not None:
        key = {
            "nodes": "nodes",
            "time": "time",
            "partition": "partition",
            "account": "account",
            "signal": "signal / signal_lead_s",
            "gpus-per-node": "gpus_per_node",
            "cpus-per-task": "cpus_per_task",
        }.get(name)
        fix = f"set slurm.{key} instead" if key else "the template sets it; remove it"
        given = arg[2:].split("=", 1)[0]
        what = f"--{name}" if given == name else f"--{given} (sbatch reads it as --{name})"
        raise ConfigError(f"slurm.sbatch_args: {what} is managed by elastic-pretrain: {fix}")
