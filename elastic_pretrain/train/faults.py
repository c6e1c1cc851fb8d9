"""Non-finite losses and loss spikes: decide before the optimizer applies a step, then skip, roll back or stop.

The decision is taken between backward and the optimizer update (:func:`guarded_step`), from the
step's loss (already reduced over every rank) and the global gradient norm, and agreed by one
all-reduce, so every rank skips, rolls back or stops at the same step. A vetoed update leaves the
parameters, the Adam state and the LR schedule bitwise untouched (the data position still moves on).

``ELASTIC_PRETRAIN_INJECT`` (tests only, like ``ELASTIC_PRETRAIN_CKPT_FAULT``) injects faults; see
:class:`Injection`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import torch
import torch.distributed as dist

from elastic_pretrain.config import show
from elastic_pretrain.errors import UserError
from elastic_pretrain.jsonsafe import StateError, count, mapping
from elastic_pretrain.parallel.device import device

if TYPE_CHECKING:  # train/step.py and train/session.py import this module
    from megatron.core.optimizer import MegatronOptimizer

    from elastic_pretrain.checkpoint.manager import Checkpointer
    from elastic_pretrain.job import JobConfig
    from elastic_pretrain.parallel.mesh import Mesh
    from elastic_pretrain.train.session import Session

log = logging.getLogger(__name__)

INJECT_ENV = "ELASTIC_PRETRAIN_INJECT"
INJECT_KINDS = ("nonfinite", "spike", "hang", "slow")
SPIKE_FACTOR = 3.0  # an injected spike reports the step's loss times this

EventKind = Literal["nonfinite", "spike"]


class FaultStop(UserError):
    """The fault policy stopped the run (``stop``, too many consecutive events, nothing to roll back to)."""


@dataclasses.dataclass(frozen=True)
class Injection:
    """Test-only fault injection: ``ELASTIC_PRETRAIN_INJECT=<kind>:<step>[:<rank>[:<arg>]],...``.

    ``nonfinite``: the loss and gradient norm of that step read NaN (what the decision sees);
    ``spike``: the loss of that step reads ``SPIKE_FACTOR`` times higher; ``hang``: the rank blocks
    forever before the step; ``slow``: the rank spins ``<arg>`` CPU seconds before every step from ``<step>`` on.
    Without ``<rank>`` every rank is hit. Each step fires once per process (not again after a rollback)."""

    kind: str
    step: int
    rank: int | None
    arg: float

    @staticmethod
    def parse(spec: str) -> list[Injection]:
        out = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            parts = item.split(":")
            try:
                if parts[0] not in INJECT_KINDS or not 2 <= len(parts) <= 4:
                    raise ValueError
                rank = int(parts[2]) if len(parts) > 2 and parts[2] != "" else None
                out.append(Injection(parts[0], int(parts[1]), rank, float(parts[3]) if len(parts) > 3 else 0.0))
            except ValueError:
                kinds = ", ".join(INJECT_KINDS)
                raise UserError(f"{INJECT_ENV}={spec}: write <kind>:<step>[:<rank>[:<arg>]] (kind: {kinds})") from None
        return out


class SpikeDetector:
    """Trailing window of accepted losses; ``is_spike(loss)`` once the window is full. Resumable."""

    def __init__(self, window: int, sigmas: float, min_rise: float) -> None:
        self.sigmas, self.min_rise = sigmas, min_rise
        self.losses: deque[float] = deque(maxlen=window)

    def is_spike(self, loss: float) -> bool:
        if len(self.losses) < (self.losses.maxlen or 0):
            return False
        mean = sum(self.losses) / len(self.losses)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.losses) / (len(self.losses) - 1))
        return loss - mean > max(self.sigmas * std, self.min_rise * abs(mean))

    def accept(self, loss: float) -> None:
        self.losses.append(loss)

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.losses.clear()
        self.losses.extend(self.check_state(d))

    @staticmethod
    def check_state(state: Any) -> list[float]:
        """The saved window: finite losses (only those are ever accepted), else :class:`StateError`."""
        losses = mapping(state, "faults.spike").get("losses", [])
        bad = next((x for x in losses if not _finite(x)), None) if isinstance(losses, list) else losses
        if bad is not None:
            raise StateError(f"faults.spike.losses is {show(bad)}, not a list of finite losses")
        return [float(x) for x in losses]


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _agree(flags: list[bool]) -> list[bool]:
    """Each flag True on every rank if it is True on any rank (one all-reduce)."""
    t = torch.tensor([int(f) for f in flags], dtype=torch.int64, device=device())  # NCCL: device tensors
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def guarded_step(optimizer: MegatronOptimizer, veto: Callable[[bool, float], bool]) -> tuple[bool, float]:
    """megatron-core's ``optimizer.step()`` with a veto between the gradient norm and the update.

    megatron 0.16.1 finds inf/NaN only through a loss scaler (fp16; bf16 with a scaler): fp32 and plain
    bf16 runs step on a NaN gradient. Here ``veto(found_inf, grad_norm)`` (collective, same answer on every
    rank) sees both before anything changes; if it passes, clipping and the update run as in
    ``ChainedOptimizer.step`` (the norm is computed once, as there). Returns (applied, grad norm)."""
    found_inf = bool(optimizer.prepare_grads())
    grad_norm = float(optimizer.get_grad_norm() or 0.0)
    if veto(found_inf, grad_norm):
        return False, grad_norm
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(
                params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )  # fmt: skip
    return bool(optimizer.step_with_ready_grads()), grad_norm


class FaultMonitor:
    """Owns the non-finite/spike policy of a run; the Trainer calls :meth:`before_step`, the step calls
    :meth:`veto`, the Trainer calls :meth:`after_step` (which may roll back or raise :class:`FaultStop`).

    Checkpointed as ``faults``: ``state_dict`` (in ``trainer.json``) holds the spike window and the event counts."""

    def __init__(self, job: JobConfig, mesh: Mesh, session: Session, ckpt: Checkpointer) -> None:
        t = job.train
        self.job, self.mesh, self.s, self.ckpt = job, mesh, session, ckpt
        self.policies: dict[EventKind, str] = {"nonfinite": t.on_nonfinite, "spike": t.spike.policy}
        self.spike = SpikeDetector(t.spike.window, t.spike.sigmas, t.spike.min_rise)
        self.counts = {"nonfinite": 0, "spike": 0, "rollback": 0}
        self.consecutive, self.last_event_step = 0, 0
        self.injections = Injection.parse(os.environ.get(INJECT_ENV, ""))
        self.fired: set[tuple[str, int]] = set()
        self.step = 0  # the step being computed (1-based)
        self.event: tuple[EventKind, str] | None = None
        self.log_metrics: Callable[[dict[str, float], int], None] = lambda metrics, step: None
        self.set_tags: Callable[[dict[str, str]], None] = lambda tags: None
        self.close_tracking: Callable[[], None] = lambda: None
        session.step.veto = self.veto

    # --- called around each step ------------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        """``step`` (1-based) is about to run: fire test injections that act before it."""
        self.step, self.event = step, None
        if self._inject("hang"):
            _injected_hang()
        slow = [i for i in self.injections if i.kind == "slow" and step >= i.step and self._mine(i)]
        if slow:  # CPU time, like slow compute (a sleeping rank would not look busy; wall time stretches under load)
            end = time.thread_time() + slow[0].arg
            while time.thread_time() < end:
                pass

    def veto(self, found_inf: bool, grad_norm: float, loss: float) -> bool:
        """Should this step's update be dropped? Collective; records the event for :meth:`after_step`."""
        if self._inject("nonfinite"):
            loss, grad_norm = math.nan, math.nan
        if self._inject("spike"):
            loss *= SPIKE_FACTOR
        nonfinite = found_inf or not (math.isfinite(loss) and math.isfinite(grad_norm))
        spike = self.policies["spike"] != "off" and not nonfinite and self.spike.is_spike(loss)
        nonfinite, spike = _agree([nonfinite, spike])
        if nonfinite:
            self.event = ("nonfinite", f"non-finite loss {loss} / grad norm {grad_norm}")
        elif spike:
            mean = sum(self.spike.losses) / len(self.spike.losses)
            self.event = ("spike", f"loss spike {loss:.4f} over the window mean {mean:.4f}")
        else:
            self.spike.accept(loss)
        return self.event is not None

    def after_step(self, state: Any) -> bool:
        """Count, print and log the event of the step that just ran, then apply its policy. True when the
        run rolled back (``state`` is now the checkpoint's). Raises :class:`FaultStop` to stop."""
        if self.event is None:
            if state.step > self.last_event_step:
                self.consecutive = 0
            return False
        kind, what = self.event
        policy = self.policies[kind]
        self.counts[kind] += 1
        self.consecutive += 1
        self.last_event_step = max(self.last_event_step, state.step)
        line = (
            f"fault at step {state.step}: {what}: update skipped, policy {policy} "
            f"({self.counts['nonfinite']} non-finite, {self.counts['spike']} spikes so far; "
            f"{self.consecutive} in a row of at most {self.job.train.max_consecutive_faults})"
        )
        if self.mesh.is_logging_rank:
            print(line, flush=True)
        self.log_metrics(
            {f"faults/{k}": float(v) for k, v in self.counts.items()} | {"faults/consecutive": float(self.consecutive)},
            state.step,
        )
        self.set_tags({"fault.last": line})
        if policy == "stop":
            self.halt(f"stopped at step {state.step} by train.{_key(kind)}=stop: {what}")
        if self.consecutive >= self.job.train.max_consecutive_faults:
            self.halt(
                f"stopped at step {state.step}: {self.consecutive} non-finite/spike events in a row "
                f"(train.max_consecutive_faults={self.job.train.max_consecutive_faults}); last: {what}"
            )
        if policy == "rollback":
            self.rollback(state)
            return True
        return False

    # --- policies -----------------------------------------------------------------------------------------
    def rollback(self, state: Any) -> None:
        """Reload the newest committed checkpoint, keep the data position (the window since that
        checkpoint is skipped) and the event counts. Collective."""
        from elastic_pretrain.train.resume import resumable

        self.ckpt.wait()  # an async save in flight commits first: it is the newest good state
        newest = self.ckpt.store.newest()
        if newest is None:
            self.halt(
                f"stopped at step {state.step}: rollback needs a committed checkpoint and there is none yet "
                "(lower checkpoint.interval, or use train.on_nonfinite=skip)"
            )
        bad_step, data, counts = state.step, self.s.batches.state_dict(), dict(self.counts)
        self.s.scheduler.num_steps = 0  # megatron's scheduler load_state_dict steps on from the current count
        self.ckpt.restore(newest.path, resumable(newest.path, self.job))  # state too: it is checkpointed
        self.s.batches.load_state_dict(data)
        self.counts = counts | {"rollback": counts["rollback"] + 1}
        if self.mesh.is_logging_rank:
            print(
                f"rolled back to step {state.step} ({newest.path.name}); skipping the data of steps "
                f"{state.step + 1}..{bad_step}",
                flush=True,
            )
        self.log_metrics({"faults/rollback": float(self.counts["rollback"])}, bad_step)

    def halt(self, reason: str) -> NoReturn:
        self.set_tags({"fault.stop_reason": reason})
        self.close_tracking()
        raise FaultStop(reason)

    # --- checkpointed state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"spike": self.spike.state_dict(), "counts": dict(self.counts)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        counts = self.check_state(d)
        self.spike.load_state_dict(d.get("spike", {}))
        self.counts.update({k: v for k, v in counts.items() if k in self.counts})

    @staticmethod
    def check_state(state: Any) -> dict[str, int]:
        """The saved event counts (each a count) after checking the spike window; else :class:`StateError`."""
        state = mapping(state, "faults")
        SpikeDetector.check_state(state.get("spike", {}))
        counts = mapping(state.get("counts", {}), "faults.counts")
        return {k: count(counts, k, "faults.counts") for k in counts}

    # --- injection ---------------------------------------------------------------------------------------
    def _mine(self, inj: Injection) -> bool:
        return inj.rank is None or inj.rank == self.mesh.rank

    def _inject(self, kind: str) -> bool:
        for inj in self.injections:
            if inj.kind == kind and inj.step == self.step and self._mine(inj) and (kind, inj.step) not in self.fired:
                self.fired.add((kind, inj.step))
                return True
        return False


def _key(kind: EventKind) -> str:
    return "on_nonfinite" if kind == "nonfinite" else "spike.policy"


def _injected_hang() -> None:
    """A rank that never finishes its step (``hang`` injection): the watchdog's dump names this frame."""
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()
