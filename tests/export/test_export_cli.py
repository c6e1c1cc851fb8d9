"""End to end on trained checkpoints: the default job two steps in one process, at EP=2 (the default
job's own layout, two processes) and at TP=2. ``elastic-pretrain export`` writes the same files for
each (the checkpoint is resharded into one process); the exported tensors equal the checkpoint's
(read independently, with torch's DCP converter); the transformers model's logits equal the
project's at every ℓ on held-out tokens; greedy ``generate`` gives the tokens of
``elastic-pretrain generate``; ``elastic-pretrain lm-eval`` takes the checkpoint itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_pretrain.export.hf_export import _TE_RENAMES
from tests.checkpoint.runs import tensors
from tests.conftest import REPO, VENV_BIN
from tests.export.conftest import TOL

pytestmark = pytest.mark.slow
CLI = str(VENV_BIN / "elastic-pretrain")
LAYOUTS = {"single": ["parallel=single"], "ep2": ["--nproc-per-node", "2"],
           "tp2": ["--nproc-per-node", "2", "parallel=cpu-tp2"]}  # fmt: skip


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


class Exported(dict[str, tuple[Path, Path]]):
    """{layout: (run directory, export folder)}, each trained and exported when first asked for (the
    ``long`` layouts only run with ``--long``)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> tuple[Path, Path]:
        run, hf = self.root / name, self.root / f"{name}-hf"
        cli("train", "jobs/tiny-cpu.yaml", "--run-dir", str(run), *LAYOUTS[name], "train.steps=2",
            "train.warmup_steps=1", "train.eval_sequences=4", "train.eval_interval=0",
            "tracking.backend=none")  # fmt: skip
        cli("export", str(run), str(hf), "--format", "hf")
        self[name] = (run, hf)
        return run, hf


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    cli("prepare-data", "stdlib-code")
    return Exported(tmp_path_factory.mktemp("export-runs"))


def load_hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True).eval()


# TP=2 reshards like EP=2 does (tests/checkpoint/test_reshard.py covers TP on its own): a long test
@pytest.mark.parametrize("layout", [pytest.param(n, marks=pytest.mark.long) if n == "tp2" else n for n in LAYOUTS])
def test_export_equals_the_checkpoint(exported, layout: str, mesh1, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from elastic_pretrain.checkpoint.store import resolve_checkpoint
    from elastic_pretrain.data.loader import load_validation
    from elastic_pretrain.engine.restore import load_model

    run, hf_dir = exported[layout]
    assert sorted(p.name for p in hf_dir.iterdir()) == sorted(p.name for p in exported["single"][1].iterdir())
    ckpt = resolve_checkpoint(run)
    # the exported tensors are the checkpoint's global tensors (read with torch's own DCP converter)
    saved = tensors(ckpt, tmp_path / "full.pt")
    ours = load_file(str(hf_dir / "model.safetensors"))
    assert len(ours) > 20
    for key, t in ours.items():
        name = "output_layer.weight" if key == "lm_head.weight" else key.removeprefix("model.")
        for te, local in _TE_RENAMES:  # megatron's checkpoint keys name the norms as Transformer Engine does
            name = name.replace(local, te) if name.replace(local, te) in saved else name
        expert = re.fullmatch(r"(.*\.experts)\.local_experts\.(\d+)\.(.*)", name)
        if expert:  # ... and stack the experts of a layer into one [E, ...] tensor
            name, index = f"{expert[1]}.experts.{expert[3]}", int(expert[2])
            assert torch.equal(t, saved[name][index]), key
            continue
        assert name in saved, (name, sorted(saved)[:5])
        assert torch.equal(t, saved[name][: t.shape[0]]), key
    # logits at every ℓ on held-out tokens: the transformers model vs the project's (resharded) model
    job, net = load_model(ckpt)
    hf = load_hf(hf_dir)
    ids = load_validation(job.data, num_sequences=2)[:, :-1]
    for ell in range(1, net.cfg.max_loops + 1):
        with torch.no_grad():
            torch.testing.assert_close(hf(ids, loops=ell).logits, net(ids, loops=ell)[ell], **TOL)


def test_generate_equals_the_cli(exported) -> None:
    from elastic_pretrain.data.tokenizer import ByteTokenizer

    _, hf_dir = exported["single"]
    run = exported["single"][0]
    hf, tok = load_hf(hf_dir), ByteTokenizer()
    prompt = torch.tensor([tok.encode("def ")])
    for loops, policy in (("2", "last-loop"), ("4", "per-loop")):
        proc = cli("generate", str(run), "--prompt", "def ", "--loops", loops, "--kv-cache", policy,
                   "--max-new-tokens", "24")  # fmt: skip
        tokens = hf.generate(prompt, max_new_tokens=24, do_sample=False, loops=int(loops), kv_cache=policy,
                             attention_mask=torch.ones_like(prompt))  # fmt: skip
        assert proc.stdout.startswith(tok.decode(tokens[0].tolist()) + "\n\n["), proc.stdout[:200]


@pytest.mark.long  # lm-eval's scores are checked in-process by tests/export/test_lm_eval.py
def test_lm_eval_command_on_a_checkpoint(exported, mesh1, tmp_path: Path) -> None:
    """The CLI exports the checkpoint on the fly, runs the local task at ℓ = 1, 2, 4 offline and writes
    one table; its acc equals the project model's own choice of the most likely continuation."""
    pytest.importorskip("lm_eval")
    from elastic_pretrain.checkpoint.store import resolve_checkpoint
    from elastic_pretrain.engine.restore import load_model
    from tests.export.test_lm_eval import accuracies, direct_loglikelihoods

    run, _ = exported["single"]
    out = tmp_path / "lm"
    proc = cli("lm-eval", str(run), "--tasks", "elastic_tiny_mc", "--loops", "1,2,4", "--out", str(out),
               env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert "| compute | MFLOPs/token |" in proc.stdout and (out / "lm_eval.md").read_text() in proc.stdout
    table = json.loads((out / "lm_eval.json").read_text())
    assert table["loops"] == [1, 2, 4]
    _, net = load_model(resolve_checkpoint(run))
    scores = {(s["task"], s["metric"]): s["by_loops"] for s in table["scores"]}
    for ell in (1, 2, 4):
        acc, acc_norm = accuracies(direct_loglikelihoods(net, ell))
        assert scores[("elastic_tiny_mc", "acc")][str(ell)] == pytest.approx(acc)
        assert scores[("elastic_tiny_mc", "acc_norm")][str(ell)] == pytest.approx(acc_norm)
