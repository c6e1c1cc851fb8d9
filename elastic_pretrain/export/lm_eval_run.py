"""lm-eval-harness on an exported model at several loop counts (``elastic-pretrain lm-eval``).

The export is loaded once as the package's own standalone model class (``export/folder.py``: the folder's
code files must equal the package's and are never imported; its config is checked before anything is
allocated) and wrapped in lm-eval's own Hugging Face model class (``HFLM``); for each ℓ the model's default loop
count (``config.loops``) is set and the tasks run. Tasks are lm-eval's registry plus the project's
local ones in ``export/tasks/`` (``elastic_tiny_mc``: files only, no network). The table has one row
per (task, metric) and one column per ℓ, with the forward matmul FLOPs per token at each ℓ
(``model/flops.py``'s formula, at the training sequence length).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from elastic_pretrain.errors import UserError
from elastic_pretrain.files import ensure_dir, write_atomic

log = logging.getLogger(__name__)
TASKS_DIR = Path(__file__).parent / "tasks"
METRICS = ("acc", "acc_norm", "exact_match", "perplexity", "word_perplexity")


@dataclasses.dataclass
class LmEvalResult:
    loops: list[int]
    flops_per_token: dict[int, float]
    scores: dict[tuple[str, str], dict[int, float]]  # (task, metric) -> {ℓ: value}
    samples: dict[int, dict[str, list[dict[str, Any]]]]  # ℓ -> task -> lm-eval's logged samples

    def markdown(self) -> str:
        head = "| task | metric | " + " | ".join(f"ℓ={ell}" for ell in self.loops) + " |"
        lines = [head, "|---|---|" + "---|" * len(self.loops)]
        flops = " | ".join(f"{self.flops_per_token[ell] / 1e6:,.2f}" for ell in self.loops)
        lines.append(f"| compute | MFLOPs/token | {flops} |")
        for (task, metric), by_loop in sorted(self.scores.items()):
            cells = " | ".join(f"{by_loop[ell]:.4f}" if ell in by_loop else "–" for ell in self.loops)
            lines.append(f"| {task} | {metric} | {cells} |")
        return "\n".join(lines) + "\n"

    def write(self, out: Path, *, root: Path) -> list[Path]:
        """``lm_eval.md`` and ``lm_eval.json`` in ``out`` (below ``root``: the export folder, or ``--out``); a
        link planted at ``out`` is refused, one at a file's name replaced, never written through (files.py)."""
        ensure_dir(out, root=root)
        payload = {
            "loops": self.loops, "flops_per_token": self.flops_per_token,
            "scores": [{"task": t, "metric": m, "by_loops": v} for (t, m), v in sorted(self.scores.items())],
        }  # fmt: skip
        return [write_atomic(out / "lm_eval.md", self.markdown(), root=root),
                write_atomic(out / "lm_eval.json", json.dumps(payload, indent=2) + "\n", root=root)]  # fmt: skip


def model_config_of(export_dir: Path) -> tuple[Any, int]:
    """(a ``ModelConfig`` with the export's built shape, the training sequence length) for FLOP counts."""
    from elastic_pretrain.export.folder import read_config, read_provenance
    from elastic_pretrain.model.config import ModelConfig

    hf = read_config(export_dir)
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_heads=hf["num_attention_heads"],
        ffn_hidden_size=hf["ffn_hidden_size"], prelude_layers=hf["prelude_layers"], core_layers=hf["core_layers"],
        coda_layers=hf["coda_layers"], loops=hf["max_loops"], num_experts=hf["num_experts"],
        moe_top_k=hf["moe_top_k"], moe_ffn_hidden_size=hf["moe_ffn_hidden_size"], flatten=1,
        edge_mlp=hf["edge_mlp"],
    )  # fmt: skip
    return cfg, int(read_provenance(export_dir).get("seq_len") or 2048)


def run_lm_eval(
    export_dir: Path,
    tasks: list[str],
    loops: list[int] | None,
    *,
    limit: int | None = None,
    batch_size: int = 8,
    include_path: list[str] | None = None,
    num_fewshot: int | None = None,
) -> LmEvalResult:
    from elastic_pretrain.export.folder import check_code, load_model, load_tokenizer, read_config, read_provenance
    from elastic_pretrain.model.flops import flops_per_token

    check_code(export_dir)  # an altered or malformed folder is refused before anything is loaded
    hf = read_config(export_dir)
    read_provenance(export_dir)
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise UserError("lm-eval is not installed: pip install 'elastic-pretrain[lm-eval]' "
                        "(or scripts/setup.sh, which installs requirements/lock-cpu.txt)") from None  # fmt: skip

    model = load_model(export_dir)  # the package's class: the folder's code is never imported
    tokenizer = load_tokenizer(export_dir, hf["eos_token_id"], hf["vocab_size"])
    max_loops = int(model.config.max_loops)
    loops = loops or list(range(1, max_loops + 1))
    if max(loops) > max_loops:
        raise UserError(f"--loops: {max(loops)} exceeds this model's L_max = {max_loops}")
    manager = TaskManager(include_path=[str(TASKS_DIR), *(include_path or [])])
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        raise UserError(f"--tasks: unknown lm-eval task(s) {', '.join(missing)} (local ones: elastic_tiny_mc; "
                        "add a folder of task YAMLs with --include-path)")  # fmt: skip
    cfg, seq_len = model_config_of(export_dir)
    result = LmEvalResult(loops=loops, flops_per_token={}, scores={}, samples={})
    for ell in loops:
        model.config.loops = ell  # the forward's default loop count: what HFLM's calls run
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, backend="causal")
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                      num_fewshot=num_fewshot, log_samples=True)  # fmt: skip
        assert out is not None
        result.flops_per_token[ell] = flops_per_token(cfg, ell, seq_len=seq_len)
        result.samples[ell] = out.get("samples", {})
        for task, metrics in out["results"].items():
            for key, value in metrics.items():
                metric, _, _filter = key.partition(",")
                if metric in METRICS and isinstance(value, int | float):
                    result.scores.setdefault((task, metric), {})[ell] = float(value)
        log.info("lm-eval at ℓ=%d: %s", ell, {f"{t}/{m}": v[ell] for (t, m), v in result.scores.items() if ell in v})
    return result
