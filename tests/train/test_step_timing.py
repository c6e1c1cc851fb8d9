"""Straggler timing on GPU by contract (issue 31 item 6; docs/gpu.md, "Straggler timing").

On CUDA each step is timed by a pair of ``torch.cuda.Event(enable_timing=True)`` on the current stream, read
once per report. No GPU here: :class:`StandInStream` hands out events that behave as torch's do where the
contract matters — ``elapsed_time`` raises until both events completed, and they complete only when the host
waits (``synchronize``) on one recorded at or after them — and whose timestamps are a device clock the test
advances (kernels that take device time while the host thread does nothing). The events reach the report
through the seams the code uses: ``open_span``'s ``event`` factory and the ``BusyClock``'s device.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import torch

from elastic_pretrain.model.config import ModelConfig
from elastic_pretrain.parallel.megatron import build_model
from elastic_pretrain.parallel.mesh import ParallelConfig
from elastic_pretrain.parallel.pipeline import MicroBatch
from elastic_pretrain.schedule import DepthPlan
from elastic_pretrain.train import step as step_module
from elastic_pretrain.train.config import TrainConfig
from elastic_pretrain.train.session import build_optimizer
from elastic_pretrain.train.step import TrainStep
from elastic_pretrain.train.step_timing import BusyClock, StepSpan, open_span
from elastic_pretrain.train.stragglers import StragglerReport
from tests.dist.equivalence import wrap_ddp_for_test

CUDA = torch.device("cuda", 0)


class StandInStream:
    """One CUDA stream: a device clock in ms (advanced by :meth:`run`) and its recorded, unfinished events."""

    def __init__(self) -> None:
        self.now_ms, self.pending, self.waits, self.log = 0.0, [], 0, []

    def run(self, ms: float) -> None:  # kernels enqueued that take ``ms`` of device time
        self.now_ms += ms

    def event(self) -> StandInEvent:
        return StandInEvent(self)


class StandInEvent:
    def __init__(self, stream: StandInStream, enable_timing: bool = True) -> None:
        self.stream, self.t_ms, self.done = stream, None, False

    def record(self) -> None:
        self.t_ms, self.done = self.stream.now_ms, False
        self.stream.pending.append(self)
        self.stream.log.append(("record", self))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:  # the host waits until this event and every one recorded before it ran
        self.stream.waits += 1
        upto = self.stream.pending.index(self) + 1
        for e in self.stream.pending[:upto]:
            e.done = True
        del self.stream.pending[:upto]

    def elapsed_time(self, end: StandInEvent) -> float:
        if self.t_ms is None or end.t_ms is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.done and end.done):
            raise RuntimeError("CUDA error: device not ready")  # what torch raises for an unfinished event
        return end.t_ms - self.t_ms


def _cuda_report(stream: StandInStream, interval: int, cpu_clock: Any) -> StragglerReport:
    clock = BusyClock(CUDA, cpu_clock=cpu_clock)
    return StragglerReport(interval, rank=0, is_logging_rank=True, clock=clock)


def test_on_cuda_the_report_times_steps_with_events_read_once_per_report() -> None:
    stream = StandInStream()
    cpu = iter(range(0, 10**6, 7))  # the host thread's CPU time: must not be what is reported on CUDA
    report = _cuda_report(stream, interval=4, cpu_clock=lambda: float(next(cpu)))
    for step in range(1, 9):
        stream.run(5.0)  # the data wait and evaluation of other steps: outside any span
        span = open_span(CUDA, event=stream.event)
        stream.run(100.0 + 50.0 * (step % 4))  # the step's kernels: 150, 200, 250, 100 ms
        assert span is not None
        span.close()
        result = SimpleNamespace(aux={}, span=span)
        report.on_step(SimpleNamespace(step=step), result, step_s=1.0)
        assert stream.waits == step // 4, "a host wait per step: only one per report is allowed"
    # (150 + 200 + 250 + 100) ms over 4 steps, the device clock's own numbers: 0.175 s, exactly in binary
    assert report.last["busy_s"] == [0.175]
    assert report.last["step"] == 8 and stream.pending == []


def test_unread_spans_are_dropped_at_evaluation_without_a_wait() -> None:
    stream = StandInStream()
    report = _cuda_report(stream, interval=3, cpu_clock=lambda: 0.0)
    for step in (1, 2):
        span = open_span(CUDA, event=stream.event)
        stream.run(1000.0)
        assert span is not None
        span.close()
        report.on_step(SimpleNamespace(step=step), SimpleNamespace(aux={}, span=span), step_s=1.0)
    report.on_eval(SimpleNamespace(step=2), {})  # evaluation time is not step time
    span = open_span(CUDA, event=stream.event)
    stream.run(40.0)
    assert span is not None
    span.close()
    report.on_step(SimpleNamespace(step=3), SimpleNamespace(aux={}, span=span), step_s=1.0)
    assert stream.waits == 1 and report.last["busy_s"] == [0.04]


def test_on_cpu_the_report_keeps_the_threads_cpu_time_and_opens_no_span() -> None:
    assert open_span(torch.device("cpu"), event=StandInStream().event) is None
    ticks = iter([0.0, 10.0, 11.5, 12.0])  # the clock's reset, the report's reset, the report, its reset
    clock = BusyClock(torch.device("cpu"), cpu_clock=lambda: next(ticks))
    report = StragglerReport(2, rank=0, is_logging_rank=True, clock=clock)
    for step in (1, 2):
        report.on_step(SimpleNamespace(step=step), SimpleNamespace(aux={}, span=None), step_s=1.0)
    assert report.last["busy_s"] == [0.75]  # (11.5 − 10.0) CPU seconds over 2 steps


def test_the_real_step_records_its_span_around_the_step_without_a_host_wait(mesh1, monkeypatch) -> None:
    """``measured_step`` (both engines' step) opens the span before the step and closes it after, on the
    device the seam names; nothing in the step waits on the events."""
    cfg = ModelConfig(
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=64,
        prelude_layers=1,
        coda_layers=1,
        core_layers=1,
        num_experts=4,
        loops=2,
        flatten=1,
        moe_top_k=2,
        moe_ffn_hidden_size=32,
    )
    net = build_model(cfg, ParallelConfig(), recompute="none")
    model = wrap_ddp_for_test(net)
    job = SimpleNamespace(
        model=cfg, train=TrainConfig(steps=2, warmup_steps=0, lr=1e-3, clip_grad=1.0, distributed_optimizer=False)
    )
    optimizer, scheduler = build_optimizer(job, model)  # type: ignore[arg-type]
    step = TrainStep(model, optimizer, scheduler, seq_len=16, micro_batch_size=2, max_loops=cfg.max_loops)
    stream = StandInStream()
    inner = step._step

    def timed_step(micro: list[MicroBatch]) -> Any:
        stream.log.append(("step", None))
        return inner(micro)

    monkeypatch.setattr(step, "_step", timed_step)
    monkeypatch.setattr(step_module, "open_span", functools.partial(open_span, CUDA, event=stream.event))
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    result = step([MicroBatch(tokens, DepthPlan(2, (2,), group_loops=2))])
    assert isinstance(result.span, StepSpan) and result.span.end is not None
    assert [kind for kind, _ in stream.log] == ["record", "step", "record"]
    assert stream.log[0][1] is result.span.start and stream.log[2][1] is result.span.end
    assert stream.waits == 0 and len(stream.pending) == 2
    monkeypatch.undo()  # the seam as shipped: this process's device, the CPU
    assert step([MicroBatch(tokens, DepthPlan(1, (1,), group_loops=1))]).span is None
