"""``elastic-pretrain export CHECKPOINT OUT`` and ``elastic-pretrain lm-eval CHECKPOINT_OR_EXPORT``."""

from __future__ import annotations

import argparse
from pathlib import Path

from elastic_pretrain.errors import UserError


def _export(args: argparse.Namespace) -> int:
    from elastic_pretrain.export.hf_export import export_hf

    out = export_hf(Path(args.checkpoint), Path(args.out))
    print(f"exported {args.checkpoint} -> {out} (load with transformers.AutoModelForCausalLM.from_pretrained("
          f"'{out}', trust_remote_code=True))")  # fmt: skip
    return 0


def parse_loops(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        loops = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--loops: {text!r} is not a comma-separated list of loop counts, e.g. 1,2,4") from None
    if not loops or min(loops) < 1:
        raise UserError(f"--loops: {text!r} needs loop counts >= 1, e.g. 1,2,4")
    return loops


def _lm_eval(args: argparse.Namespace) -> int:
    import tempfile

    from elastic_pretrain.export.hf_export import export_hf, is_export
    from elastic_pretrain.export.lm_eval_run import run_lm_eval

    source = Path(args.model)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UserError("--tasks: name at least one lm-eval task (e.g. elastic_tiny_mc)")
    loops = parse_loops(args.loops)
    with tempfile.TemporaryDirectory(prefix="elastic-export-") as tmp:
        # a checkpoint: export it first (one-process load, any layout)
        model_dir = source if is_export(source) else export_hf(source, Path(tmp) / "hf")
        # --out is the user's folder; the default is inside the export or checkpoint, which may come from others
        out, root = (Path(args.out), Path(args.out)) if args.out else (source / "lm_eval", source)
        result = run_lm_eval(model_dir, tasks, loops, limit=args.limit, batch_size=args.batch_size,
                             include_path=args.include_path, num_fewshot=args.num_fewshot)  # fmt: skip
    written = result.write(out, root=root)
    print(result.markdown() + f"\nwritten: {', '.join(str(w) for w in written)}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model folder (safetensors, config, "
                                      "tokenizer, modelling code; loads without megatron)")  # fmt: skip
    p.add_argument("checkpoint", help="step_<N> directory, or a run directory (its newest committed step)")
    p.add_argument("out", help="output folder (new or empty)")
    p.add_argument("--format", choices=["hf"], default="hf", help="export format (Hugging Face transformers)")
    p.set_defaults(handler=_export)

    e = sub.add_parser("lm-eval", help="lm-eval-harness tasks at each loop count (optional extra: lm-eval)")
    e.add_argument("model", help="a checkpoint (step_<N> or run directory; exported on the fly) or an export folder")
    e.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (local: elastic_tiny_mc)")
    e.add_argument("--loops", help="comma-separated loop counts, e.g. 1,2,4 (default: every ℓ up to L_max)")
    e.add_argument("--limit", type=int, help="at most this many documents per task")
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--num-fewshot", type=int, default=None)
    e.add_argument("--include-path", action="append", default=[], help="another folder of task YAMLs (repeatable)")
    e.add_argument("--out", help="folder for lm_eval.md / lm_eval.json (default <model>/lm_eval)")
    e.set_defaults(handler=_lm_eval)
