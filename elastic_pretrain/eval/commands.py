"""``elastic-pretrain eval <ckpt>`` and ``elastic-pretrain generate <ckpt>`` (one process, CPU or one GPU).

A checkpoint saved at any TP/EP/DP layout loads into a one-process model: the model tensors of
megatron-core ``dist_checkpointing`` are layout-independent (docs/checkpoints.md); only the model part
of the checkpoint is read (not the optimizer state), with the same restricted unpickling as resume.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_pretrain.checkpoint.store import resolve_checkpoint
from elastic_pretrain.errors import UserError
from elastic_pretrain.files import ensure_dir, write_atomic
from elastic_pretrain.rundir import CheckpointFiles, RunFiles

if TYPE_CHECKING:  # annotations only: the command imports what it runs when it runs
    from elastic_pretrain.eval.curves import QualityCurve
    from elastic_pretrain.job import JobConfig
    from elastic_pretrain.model.decider import IterationDecider
    from elastic_pretrain.model.looped import LoopedMoEModel
    from elastic_pretrain.tracking.config import TrackingConfig

DEFAULT_NEW_TOKENS = 128  # generate --max-new-tokens unset (within the model's context)


def _eval(args: argparse.Namespace) -> int:
    from elastic_pretrain.data.difficulty import load_difficulty
    from elastic_pretrain.data.loader import load_validation
    from elastic_pretrain.data.recipes import check_eval_recipe, load_recipe, matching_recipe
    from elastic_pretrain.engine.restore import load_model
    from elastic_pretrain.eval.adaptive import DEFAULT_THRESHOLDS, adaptive_sweep
    from elastic_pretrain.eval.curves import compare
    from elastic_pretrain.eval.difficulty import by_difficulty
    from elastic_pretrain.eval.loss import quality_curve
    from elastic_pretrain.eval.report import comparison_table, markdown_table
    from elastic_pretrain.model.inference import KV_POLICIES, teacher_forced_loss
    from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown

    _check_sizes(args)
    data = load_recipe(args.data) if args.data else None  # the user's: a checkpoint never chooses where data is read
    ckpt = resolve_checkpoint(Path(args.checkpoint))
    run_dir = run_dir_of(ckpt)
    # --out is the user's folder; the default is beside the checkpoints of the run (or beside a bare step folder)
    out, root = (Path(args.out), Path(args.out)) if args.out else report_dir(ckpt, run_dir)
    ensure_dir(out, root=root)  # a planted eval -> elsewhere is refused before the evaluation, not after
    init_mesh(ParallelConfig(), seed=0)
    try:
        job, model = load_model(ckpt)
        if data is None:
            found = matching_recipe(job.data)
            if found is None:
                raise UserError(
                    "eval: give --data RECIPE (e.g. --data stdlib-code): the checkpoint's data section equals none of "
                    "your recipes in data/, and a checkpoint never chooses where held-out data is read or cached"
                )
            print(f"[held-out data: your recipe {found[0]}, identical to the checkpoint's; --data to choose another]",
                  file=sys.stderr)  # fmt: skip
            data = found[1]
        check_eval_recipe(data, job.data, job.model.vocab_size)
        tracking = None if args.no_track else eval_tracking(job, ckpt, uri=args.uri)  # refused before any compute
        decider = pick_decider(model, ckpt, args.decider) if args.adaptive else None
        # one default, the job's own (issue 33: eval used 64 where the job's table used train.eval_sequences)
        tokens = load_validation(data, num_sequences=args.sequences or job.train.eval_sequences)
        layer = job.schedule.exit_axis == "layer"  # a non-looped stack with layer exits: the 'loops' column is k
        curve = quality_curve(
            model,
            tokens,
            name=f"{job.name} (exit after core layer k)" if layer else job.name,
            batch_size=args.batch_size,
            exit_axis=job.schedule.exit_axis,
        )
        lines = [markdown_table(curve), sample_line(tokens.shape, flag=args.sequences is not None)]
        labels = load_difficulty(data, num_sequences=tokens.shape[0])  # a corpus that labels each token's steps
        by_level = by_difficulty(model, tokens, labels, batch_size=args.batch_size) if labels is not None else None
        if by_level is not None:
            lines += [by_level.markdown("loss"), by_level.markdown("accuracy")]
        if args.kv_gap:
            lines.append(f"| KV cache at ℓ={model.cfg.max_loops} | KV bytes/token | teacher-forced loss |")
            lines.append("|---|---|---|")
            for policy in KV_POLICIES:
                tf = teacher_forced_loss(model, tokens, kv_cache=policy, batch_size=args.batch_size)
                lines.append(f"| {policy} | {tf.kv_bytes_per_token:.0f} | {tf.loss:.4f} |")
        sweep = None
        if decider is not None:
            thresholds = args.threshold or DEFAULT_THRESHOLDS
            sweep = adaptive_sweep(model, decider, tokens, thresholds, batch_size=args.batch_size)
            lines.append(sweep.markdown())
            lines.append(comparison_table(compare(list(sweep.curves()))))
        report = "\n".join(lines) + "\n"
        written = write_report(out, root, report, curve, sweep)
        print(report + f"\nwritten: {', '.join(str(w) for w in written)}")
        if tracking is not None:
            adaptive = [sweep.curves()[0]] if sweep is not None else []
            extra = by_level.metrics() if by_level is not None else {}
            track_eval(job, ckpt, curve, adaptive, written, uri=args.uri, extra=extra)
    finally:
        teardown()
    return 0


def write_report(out: Path, root: Path, report: str, curve: Any, sweep: Any) -> list[Path]:
    """``eval.md``, ``quality.png`` (and with a ``sweep``, ``adaptive.png``) in ``out``, below ``root``: a link
    planted at ``out`` or below ``root`` is refused, a link at a file's name replaced, never written through
    (files.py; issue 35). Returns the files written."""
    from elastic_pretrain.eval.adaptive import plot_sweep
    from elastic_pretrain.eval.report import plot

    ensure_dir(out, root=root)
    written = [write_atomic(out / "eval.md", report, root=root), plot([curve], out / "quality.png", root=root)]
    if sweep is not None:
        written.append(plot_sweep(sweep, out / "adaptive.png", root=root))
    return written


def _check_sizes(args: argparse.Namespace) -> None:
    if args.sequences is not None and args.sequences < 1:
        raise UserError(f"--sequences {args.sequences}: must be >= 1 (unset: the job's train.eval_sequences)")
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: must be >= 1")


def sample_line(shape: Any, *, flag: bool) -> str:
    """What the numbers above average over: ``shape`` is (sequences, seq_len + 1) stored tokens per row."""
    n, row = int(shape[0]), int(shape[1])
    source = "--sequences" if flag else "the job's train.eval_sequences; --sequences N to change"
    return (f"\nevaluated {n} held-out sequences x {row - 1} predicted tokens = {n * (row - 1):,} tokens per loop "
            f"count ({source})\n")  # fmt: skip


def run_dir_of(ckpt: Path) -> Path | None:
    """The run directory ``ckpt`` is a checkpoint of: ``<run>/checkpoints/step_<N>`` beside the ``config.yaml``
    every run writes at its start; None for a step folder anywhere else (a bare copy or download)."""
    run_dir = CheckpointFiles(Path(os.path.abspath(ckpt))).run_dir
    return run_dir if run_dir is not None and os.path.lexists(RunFiles(run_dir).config) else None


def report_dir(ckpt: Path, run_dir: Path | None) -> tuple[Path, Path]:
    """Where ``eval`` writes its report without ``--out``, and the folder below which no link is followed
    (files.py): ``<run>/eval/step_<N>/`` below the run directory, beside the checkpoints (a report inside
    ``step_<N>/`` went when rotation deleted the checkpoint; issue 33); for a bare step folder,
    ``eval/step_<N>/`` beside it."""
    ckpt = Path(os.path.abspath(ckpt))
    if run_dir is not None:
        return RunFiles(run_dir).eval_dir(ckpt.name), run_dir
    return ckpt.parent / "eval" / ckpt.name, ckpt.parent


def eval_tracking(job: JobConfig, ckpt: Path, *, uri: str | None) -> TrackingConfig | None:
    """The tracking config an evaluation of ``ckpt`` logs with, or None when it does not log — the job does not
    track, or ``ckpt`` is in no run directory and no URI was given (its grandparent folder is not a place to
    create an MLflow store in; issue 35). A run directory's own store is checked here, before the evaluation
    runs: a foreign one is a one-line error (tracking/store.py)."""
    import dataclasses

    from elastic_pretrain.tracking import store
    from elastic_pretrain.tracking.config import ENV_TRACKING_URI, local_store_uri, resolve_uri

    if job.tracking.backend == "none":
        return None
    step = CheckpointFiles(ckpt).step or 0
    cfg = dataclasses.replace(job.tracking, uri=uri, run_name=f"{job.name} eval step_{step}", system_metrics=False)
    run_dir = run_dir_of(ckpt)
    if run_dir is None:
        if uri or os.environ.get(ENV_TRACKING_URI, "").strip():
            return cfg
        print(f"eval: {ckpt} is not in a run directory (<run>/checkpoints/step_<N> beside config.yaml): not logged "
              "to MLflow (pass --uri URI to log it there)", file=sys.stderr)  # fmt: skip
        return None
    if resolve_uri(cfg, run_dir) == local_store_uri(run_dir):
        store.claim_locations(run_dir, experiment=cfg.experiment or job.name)
    return cfg


def track_eval(
    job: JobConfig,
    ckpt: Path,
    curve: QualityCurve,
    adaptive: list[Any],
    files: list[Path],
    *,
    uri: str | None = None,
    extra: dict[str, float] | None = None,
) -> str | None:
    """Log an evaluation to MLflow: a run named ``<job> eval step_<N>`` nested under the training run
    (``mlflow.parentRunId``), with the loss and perplexity per ℓ, the AUC (and the adaptive curve's points)
    at step N, ``extra`` metrics (per difficulty, on a corpus that labels it), and the report files as
    artifacts. Returns the run id (None when tracking is off); never fails the evaluation.

    The store is ``uri`` (``--uri``), else ``$MLFLOW_TRACKING_URI``, else the local store of the
    checkpoint's run directory; never the ``tracking.uri`` saved in the checkpoint: a checkpoint from
    someone else must not choose the server that MLflow sends the user's credentials to."""
    import tempfile

    cfg = eval_tracking(job, ckpt, uri=uri)
    if cfg is None:
        return None
    run_dir = run_dir_of(ckpt)
    if run_dir is not None:
        return _track_eval(job, ckpt, cfg, run_dir, curve, adaptive, files, extra=extra)
    with tempfile.TemporaryDirectory(prefix="elastic-pretrain-eval-") as tmp:  # the tracker's staging files only
        return _track_eval(job, ckpt, cfg, Path(tmp), curve, adaptive, files, in_run=False, extra=extra)


def _track_eval(
    job: JobConfig, ckpt: Path, cfg: TrackingConfig, run_dir: Path, curve: QualityCurve, adaptive: list[Any],
    files: list[Path], *,
    in_run: bool = True, extra: dict[str, float] | None = None,
) -> str | None:  # fmt: skip
    import math

    from elastic_pretrain.checkpoint.store import read_trainer_state, saved_run_id
    from elastic_pretrain.tracking.config import redact_uri, resolve_uri
    from elastic_pretrain.tracking.store import is_run_id, read_run_id
    from elastic_pretrain.tracking.tracker import create_tracker

    step = CheckpointFiles(ckpt).step or 0
    stored, target = job.tracking.uri, resolve_uri(cfg, run_dir)
    if stored and stored != target:
        print(
            f"eval: the checkpoint's job logged to {redact_uri(stored)}; logging this evaluation to "
            f"{redact_uri(target)} (a checkpoint does not choose the tracking server: pass --uri to pick one)",
            file=sys.stderr,
        )
    tracker = create_tracker(cfg, run_dir=run_dir, job_name=job.name, rank=0)
    # the training run: the checkpoint's id, else the one written when training closed (both possibly
    # someone else's: only a well-formed run id becomes a tag; read_run_id refuses links, FIFOs, junk)
    parent = saved_run_id(read_trainer_state(ckpt))
    if not is_run_id(parent):
        try:
            parent = read_run_id(RunFiles(run_dir).mlflow_run_id) if in_run else None
        except UserError as err:  # the evaluation is done; it is logged, without the link to its training run
            print(f"eval: {err}", file=sys.stderr)
            parent = None
    where = Path(os.path.abspath(ckpt)).relative_to(run_dir).as_posix() if in_run else str(ckpt.resolve())
    tracker.set_tags({"elastic_pretrain.kind": "eval", "elastic_pretrain.checkpoint": where,
                      **({"mlflow.parentRunId": parent} if parent else {})})  # fmt: skip
    metrics = {"eval/auc": curve.auc}
    for p in curve.points:
        metrics[f"eval/loss_loops_{int(p.loops)}"] = p.loss
        metrics[f"eval/ppl_loops_{int(p.loops)}"] = math.exp(min(p.loss, 50))
    for c in adaptive:
        metrics["eval/adaptive_auc"] = c.auc
    metrics.update(extra or {})
    tracker.log_metrics(metrics, step=step)
    for f in files:
        if f.is_file():
            tracker.log_artifact(f, "eval")
    tracker.close(job.tracking.close_timeout_s)
    return tracker.run_id


def pick_decider(model: LoopedMoEModel, ckpt: Path, override: str | None) -> IterationDecider:
    """The iteration decider: ``--decider FILE`` if given, else the one inside the checkpoint."""
    from elastic_pretrain.model.decider import load_decider

    if override:  # a file from anywhere: read weights-only, and its sizes must be this model's
        return load_decider(Path(override), hidden_size=model.cfg.hidden_size, max_loops=model.cfg.max_loops)
    if model.decider is None:
        raise _no_decider(ckpt)
    return model.decider.eval()


def _no_decider(ckpt: Path) -> UserError:
    return UserError(
        f"{ckpt}: this checkpoint has no iteration decider: train a decider job on it "
        f"(elastic-pretrain train jobs/tiny-decider.yaml decider.init_from={ckpt}) or pass --decider FILE"
    )


def _generate(args: argparse.Namespace) -> int:
    import torch

    from elastic_pretrain.checkpoint.store import read_trainer_state
    from elastic_pretrain.data.tokenizer import load_tokenizer
    from elastic_pretrain.engine.restore import load_model
    from elastic_pretrain.model.inference import generate
    from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown

    _check_sampling(args)
    ckpt = resolve_checkpoint(Path(args.checkpoint))
    has_decider = bool(args.decider) or read_trainer_state(ckpt).get("config", {}).get("decider") is not None
    # Unset --loops: the decider's adaptive depth where there is one, else every pass (L_max) — a pretrained
    # checkpoint has no decider, and 'auto' used to fail on every one of them (issue 33).
    loops: int | str = ("auto" if has_decider else "max") if args.loops is None else args.loops
    loops = loops if loops in ("auto", "max") else _int_loops(str(loops))
    if loops == "auto" and not has_decider:
        raise _no_decider(ckpt)  # before building anything
    init_mesh(ParallelConfig(), seed=args.seed)
    try:
        job, model = load_model(ckpt)
        if loops == "max":
            loops = model.cfg.max_loops
        if isinstance(loops, int) and not 1 <= loops <= model.cfg.max_loops:
            top = model.cfg.max_loops
            raise UserError(f"--loops {loops}: this model runs 1..{top} passes: pick one of them, 'max' or 'auto'")
        tok = load_tokenizer(job.data.tokenizer)
        stop = pick_decider(model, ckpt, args.decider).stopper(args.threshold) if loops == "auto" else None
        prompt = tok.encode(args.prompt) or [tok.eos_id]
        # unset: 128 tokens, or what the context leaves after the prompt (a 128-token model with the default
        # prompt could otherwise never run with the default: README, issue 33)
        new_tokens = args.max_new_tokens or max(1, min(DEFAULT_NEW_TOKENS, job.data.seq_len - len(prompt)))
        _check_context(len(prompt), new_tokens, job.data.seq_len)
        how = "per-token adaptive depth (the iteration decider)" if loops == "auto" else f"{loops} passes per token"
        print(f"[depth: {how}; L_max = {model.cfg.max_loops}; pass --loops N or auto to choose]", file=sys.stderr)
        out = generate(
            model, prompt, loops=loops, max_new_tokens=new_tokens, kv_cache=args.kv_cache,  # type: ignore[arg-type]
            temperature=args.temperature, stop=stop, eos_id=tok.eos_id,
            generator=torch.Generator().manual_seed(args.seed),
        )  # fmt: skip
        print(tok.decode(out.tokens_BT[0].tolist()))
        passes = out.passes_BN.float()
        mean = f"{passes.mean().item():.2f}" if passes.numel() else "-"
        print(f"\n[{out.tokens_BT.shape[1] - len(prompt)} tokens, mean passes/token {mean}, "
              f"KV cache {args.kv_cache}: {out.kv_bytes_per_token:.0f} bytes/token]")  # fmt: skip
    finally:
        teardown()
    return 0


def _int_loops(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--loops: {text!r} is neither a loop count, 'max' nor 'auto'") from None


def _check_sampling(args: argparse.Namespace) -> None:
    """Sampling flags the decoder would otherwise take silently (issue 33)."""
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UserError(f"--temperature {args.temperature}: must be a finite number >= 0 (0 = greedy)")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")


def _check_context(prompt_tokens: int, new_tokens: int, context: int) -> None:
    """The model was trained on positions 0..seq_len-1: RoPE positions past them were never seen."""
    if prompt_tokens + new_tokens > context:
        raise UserError(
            f"the prompt ({prompt_tokens} tokens) plus --max-new-tokens {new_tokens} exceeds the model's context of "
            f"{context} tokens (data.seq_len it was trained at): shorten the prompt or lower --max-new-tokens to "
            f"{max(context - prompt_tokens, 0)}"
        )


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="loss/perplexity per loop count, quality-budget AUC and plot of a checkpoint")
    p.add_argument("checkpoint", help="step_<N> directory, or a run directory (its newest committed step)")
    p.add_argument(
        "--data",
        metavar="RECIPE",
        help="data recipe (YAML or preset name in data/, e.g. stdlib-code) whose validation stream is read; default: "
        "your recipe in data/ identical to the checkpoint's data section; never the locations saved in the checkpoint",
    )
    p.add_argument(
        "--sequences",
        type=int,
        default=None,
        help="held-out sequences of the recipe's validation stream (default: the job's train.eval_sequences, as its "
        "training-time validation)",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--kv-gap", action="store_true", help="also teacher-forced loss with per-loop vs last-loop KV")
    p.add_argument(
        "--out",
        help="output folder for eval.md and quality.png (default <run>/eval/step_<N>, beside the checkpoints; for a "
        "step folder outside a run directory, eval/step_<N> beside it)",
    )
    p.add_argument("--no-track", action="store_true", help="do not log to MLflow (default: when the job tracks)")
    p.add_argument(
        "--uri",
        help="MLflow tracking URI to log the evaluation to (default: $MLFLOW_TRACKING_URI, else the local store "
        "of the checkpoint's run directory; never the URI saved in the checkpoint)",
    )
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="also per-token adaptive depth (the checkpoint's iteration decider) vs fixed depth at "
        "matched compute: table in eval.md, adaptive.png",
    )
    p.add_argument(
        "--threshold",
        type=float,
        nargs="+",
        metavar="T",
        help="--adaptive: decider thresholds (default: a sweep 0, 0.1, ..., 0.9, 1.01)",
    )
    p.add_argument("--decider", help="--adaptive: a decider file (save_decider) instead of the checkpoint's")
    p.set_defaults(handler=_eval)

    g = sub.add_parser("generate", help="sample from a checkpoint at a fixed loop count or with adaptive depth")
    g.add_argument("checkpoint", help="step_<N> directory, or a run directory (its newest committed step)")
    g.add_argument("--prompt", default="def ", help="prompt text")
    g.add_argument(
        "--loops",
        default=None,
        help="passes per token, 'max' (L_max) or 'auto' (the iteration decider); default: auto where the checkpoint "
        "has a decider (or --decider is given), else max",
    )
    g.add_argument("--decider", help="--loops auto: a decider file (save_decider) instead of the checkpoint's")
    g.add_argument("--threshold", type=float, default=None, help="decider threshold (default: its config)")
    g.add_argument("--kv-cache", choices=["last-loop", "per-loop"], default="last-loop")
    g.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help=f"tokens to generate (default: {DEFAULT_NEW_TOKENS}, or what the model's context leaves after "
                   "the prompt)")  # fmt: skip
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(handler=_generate)
