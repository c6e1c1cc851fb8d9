"""``elastic-pretrain eval <ckpt>`` and ``elastic-pretrain generate <ckpt>`` (one process, CPU or one GPU).

A checkpoint saved at any TP/EP/DP layout loads into a one-process model: the model tensors of
megatron-core ``dist_checkpointing`` are layout-independent (docs/checkpoints.md); only the model part
of the checkpoint is read (not the optimizer state), with the same restricted unpickling as resume.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from elastic_pretrain.checkpoint.store import resolve_checkpoint
from elastic_pretrain.errors import UserError
from elastic_pretrain.rundir import CheckpointFiles, RunFiles


def _eval(args: argparse.Namespace) -> int:
    from elastic_pretrain.checkpoint.tensors import load_model
    from elastic_pretrain.data.difficulty import load_difficulty
    from elastic_pretrain.data.loader import load_validation
    from elastic_pretrain.eval.adaptive import DEFAULT_THRESHOLDS, adaptive_sweep, plot_sweep
    from elastic_pretrain.eval.curves import compare
    from elastic_pretrain.eval.difficulty import by_difficulty
    from elastic_pretrain.eval.loss import quality_curve
    from elastic_pretrain.eval.report import comparison_table, markdown_table, plot
    from elastic_pretrain.model.inference import KV_POLICIES, teacher_forced_loss
    from elastic_pretrain.parallel.mesh import ParallelConfig, init_mesh, teardown

    init_mesh(ParallelConfig(), seed=0)
    try:
        ckpt = resolve_checkpoint(Path(args.checkpoint))
        job, model = load_model(ckpt)
        decider = pick_decider(model, ckpt, args.decider) if args.adaptive else None
        tokens = load_validation(job.data, num_sequences=args.sequences)
        layer = job.schedule.exit_axis == "layer"  # a non-looped stack with layer exits: the 'loops' column is k
        curve = quality_curve(model, tokens, name=f"{job.name} (exit after core layer k)" if layer else job.name,
                              batch_size=args.batch_size, exit_axis=job.schedule.exit_axis)
        lines = [markdown_table(curve)]
        labels = load_difficulty(job.data, num_sequences=args.sequences)  # a corpus that labels each token's steps
        by_level = by_difficulty(model, tokens, labels, batch_size=args.batch_size) if labels is not None else None
        if by_level is not None:
            lines += [by_level.markdown("loss"), by_level.markdown("accuracy")]
        if args.kv_gap:
            lines.append(f"| KV cache at ℓ={model.cfg.max_loops} | KV bytes/token | teacher-forced loss |")
            lines.append("|---|---|---|")
            for policy in KV_POLICIES:
                tf = teacher_forced_loss(model, tokens, kv_cache=policy, batch_size=args.batch_size)
                lines.append(f"| {policy} | {tf.kv_bytes_per_token:.0f} | {tf.loss:.4f} |")
        out = Path(args.out) if args.out else CheckpointFiles(ckpt).eval_dir
        out.mkdir(parents=True, exist_ok=True)
        written = [out / "eval.md", plot([curve], out / "quality.png")]
        if decider is not None:
            thresholds = args.threshold or DEFAULT_THRESHOLDS
            sweep = adaptive_sweep(model, decider, tokens, thresholds, batch_size=args.batch_size)
            lines.append(sweep.markdown())
            lines.append(comparison_table(compare(list(sweep.curves()))))
            written.append(plot_sweep(sweep, out / "adaptive.png"))
        report = "\n".join(lines) + "\n"
        (out / "eval.md").write_text(report)
        print(report + f"\nwritten: {', '.join(str(w) for w in written)}")
        if not args.no_track:
            adaptive = [sweep.curves()[0]] if decider is not None else []
            extra = by_level.metrics() if by_level is not None else {}
            track_eval(job, ckpt, curve, adaptive, written, uri=args.uri, extra=extra)
    finally:
        teardown()
    return 0


def track_eval(
    job: Any, ckpt: Path, curve: Any, adaptive: list[Any], files: list[Path], *, uri: str | None = None,
    extra: dict[str, float] | None = None,
) -> str | None:
    """Log an evaluation to MLflow: a run named ``<job> eval step_<N>`` nested under the training run
    (``mlflow.parentRunId``), with the loss and perplexity per ℓ, the AUC (and the adaptive curve's points)
    at step N, ``extra`` metrics (per difficulty, on a corpus that labels it), and the report files as
    artifacts. Returns the run id (None when tracking is off); never fails the evaluation.

    The store is ``uri`` (``--uri``), else ``$MLFLOW_TRACKING_URI``, else the local store of the
    checkpoint's run directory; never the ``tracking.uri`` saved in the checkpoint: a checkpoint from
    someone else must not choose the server that MLflow sends the user's credentials to."""
    import dataclasses
    import math

    from elastic_pretrain.checkpoint.store import read_trainer_state, saved_run_id
    from elastic_pretrain.tracking.config import redact_uri, resolve_uri
    from elastic_pretrain.tracking.tracker import create_tracker

    if job.tracking.backend == "none":
        return None
    step = int(ckpt.name.removeprefix("step_")) if ckpt.name.startswith("step_") else 0
    run_dir = CheckpointFiles(ckpt).run_dir
    stored = job.tracking.uri
    cfg = dataclasses.replace(job.tracking, uri=uri, run_name=f"{job.name} eval step_{step}", system_metrics=False)
    target = resolve_uri(cfg, run_dir)
    if stored and stored != target:
        print(
            f"eval: the checkpoint's job logged to {redact_uri(stored)}; logging this evaluation to "
            f"{redact_uri(target)} (a checkpoint does not choose the tracking server: pass --uri to pick one)",
            file=sys.stderr,
        )
    tracker = create_tracker(cfg, run_dir=run_dir, job_name=job.name, rank=0)
    id_file = RunFiles(run_dir).mlflow_run_id  # written at the end of training; the checkpoint's may be unset
    parent = saved_run_id(read_trainer_state(ckpt))
    parent = parent or (id_file.read_text().strip() if id_file.is_file() else None)
    tracker.set_tags({"elastic_pretrain.kind": "eval", "elastic_pretrain.checkpoint": str(ckpt.resolve()),
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


def pick_decider(model: Any, ckpt: Path, override: str | None) -> Any:
    """The iteration decider: ``--decider FILE`` if given, else the one inside the checkpoint."""
    from elastic_pretrain.model.decider import load_decider

    if override:
        return load_decider(Path(override))
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
    from elastic_pretrain.checkpoint.tensors import load_model
    from elastic_pretrain.data.tokenizer import load_tokenizer
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
        _check_context(len(prompt), args.max_new_tokens, job.data.seq_len)
        how = "per-token adaptive depth (the iteration decider)" if loops == "auto" else f"{loops} passes per token"
        print(f"[depth: {how}; L_max = {model.cfg.max_loops}; pass --loops N or auto to choose]", file=sys.stderr)
        out = generate(
            model, prompt, loops=loops, max_new_tokens=args.max_new_tokens, kv_cache=args.kv_cache,  # type: ignore[arg-type]
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
    if args.max_new_tokens < 1:
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
    p.add_argument("--sequences", type=int, default=64, help="held-out sequences (data.validation of the job)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--kv-gap", action="store_true", help="also teacher-forced loss with per-loop vs last-loop KV")
    p.add_argument("--out", help="output folder for eval.md and quality.png (default <checkpoint>/eval)")
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
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(handler=_generate)
