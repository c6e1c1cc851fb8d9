"""Hostile export folders (issue 35 items 2 and 8): ``elastic-pretrain lm-eval FOLDER`` on a folder from
someone else. Each test builds the exact input — code appended to ``modeling_elastic.py``, an ``auto_map``
naming another file, a ``config.json`` that lacks a key, is not an object, nests 100,000 deep, asks for a
model of 10**6 hidden units, or does not match the weights — and checks that no code from the folder runs
and that the user gets one line naming the file (exit code 2), before anything large is allocated.
A good export keeps loading (here, and in tests/export/test_lm_eval.py through lm-eval itself)."""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_pretrain.data.config import TokenizerConfig
from elastic_pretrain.model.config import DeciderConfig
from tests.conftest import REPO
from tests.export.conftest import build, tiny

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # no network, whatever lm-eval would fetch
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def good(mesh1, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny export with a decider (every optional part present) and the model it was exported from."""
    from elastic_pretrain.export.hf_export import write_export

    net = build(tiny(route_replay=True), decider=DeciderConfig())
    out = tmp_path_factory.mktemp("export") / "hf"
    write_export(net, TokenizerConfig(), out, decider=DeciderConfig())
    return out, net


@pytest.fixture
def copy(good: tuple[Path, Any], tmp_path: Path) -> Path:
    """A private copy of the good export, to tamper with."""
    return Path(shutil.copytree(good[0], tmp_path / "shared-export"))


def lm_eval(export: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``elastic-pretrain lm-eval EXPORT`` in this process: (exit code, stderr)."""
    from elastic_pretrain.cli import main

    code = main(["lm-eval", str(export), "--tasks", "elastic_tiny_mc", "--loops", "1", "--limit", "1",
                 "--out", str(export.parent / "lm_eval-out")])  # fmt: skip
    return code, capsys.readouterr().err


def one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2 and "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and all(n in lines[0] for n in needles), err[-3000:]


def edit_config(export: Path, **changes: Any) -> None:
    cfg = json.loads((export / "config.json").read_text())
    for key, value in changes.items():
        if value is KeyError:
            del cfg[key]
        else:
            cfg[key] = value
    (export / "config.json").write_text(json.dumps(cfg))


PAYLOAD = "\nopen({marker!r}, 'w').write('ran')  # appended by whoever shared the folder\n"


@pytest.mark.parametrize("file", ["modeling_elastic.py", "configuration_elastic.py"])
def test_code_appended_to_the_folder_never_runs(copy: Path, file: str, capsys) -> None:
    marker = copy.parent / "MARKER"
    with (copy / file).open("a") as f:
        f.write(PAYLOAD.format(marker=str(marker)))
    code, err = lm_eval(copy, capsys)
    assert not marker.exists()  # before: the command imported the file, ran it and printed a normal table
    one_line(code, err, f"{copy / file}: not the file elastic-pretrain exports", "re-export the checkpoint")


def test_an_auto_map_naming_other_code_is_refused(copy: Path, capsys) -> None:
    marker = copy.parent / "MARKER"
    (copy / "extra.py").write_text(PAYLOAD.format(marker=str(marker)) + "from .modeling_elastic import *\n")
    edit_config(copy, auto_map={"AutoConfig": "configuration_elastic.ElasticLoopedConfig",
                                "AutoModelForCausalLM": "extra.ElasticLoopedForCausalLM"})  # fmt: skip
    code, err = lm_eval(copy, capsys)
    assert not marker.exists()
    one_line(code, err, "config.json: auto_map names other code than the exported files")


def test_the_model_class_is_the_packages_even_past_the_code_check(copy: Path, monkeypatch) -> None:
    """Second line of defence: with the byte comparison switched off, the folder's code still never runs."""
    marker = copy.parent / "MARKER"
    with (copy / "modeling_elastic.py").open("a") as f:
        f.write(PAYLOAD.format(marker=str(marker)))
    from elastic_pretrain.export import folder

    monkeypatch.setattr(folder, "check_code", lambda export_dir: None)
    model = folder.load_model(copy)
    assert not marker.exists()
    assert type(model).__module__ == "elastic_pretrain.export.hf.modeling_elastic"


def deep(n: int) -> str:
    return "[" * n + "]" * n


CONFIG_CASES = {
    # name: (what to do to config.json, words the one line holds)
    "missing-key": (dict(hidden_size=KeyError), "config.json: no 'hidden_size'"),
    "not-an-object": ("[1, 2, 3]", "config.json: a JSON list, not an object"),
    "deep-nesting": (deep(100_000), "config.json: nested too deeply"),
    "5000-digits": ('{"vocab_size": ' + "9" * 5000 + "}", "config.json: not valid JSON"),
    "not-utf8": (b'{"a": "\xff"}', "config.json: not UTF-8"),
    "huge-hidden": (dict(hidden_size=10**6), "hidden_size=1000000 is not in [1, 65,536]"),
    "billion-layers": (dict(core_layers=10**9), "core_layers=1000000000 is not in [1, 1,024]"),
    "many-passes": (dict(core_layers=1024, max_loops=256), "max_loops=256 is not at most 4096 / core_layers"),
    "string-size": (dict(num_experts="8"), "num_experts='8' is not an integer"),
    "bool-size": (dict(moe_top_k=True), "moe_top_k=True is not an integer"),
    "nan-eps": (dict(norm_eps=float("nan")), "norm_eps=nan is not in (0, 1]"),
    "top-k": (dict(moe_top_k=9), "moe_top_k=9 is not at most num_experts=8"),
    "heads": (dict(num_attention_heads=3), "hidden_size=32 is not an even multiple of num_attention_heads=3"),
    "choice": (dict(normalization="Evil"), "normalization='Evil' is not one of RMSNorm, LayerNorm"),
    "loops": (dict(loops=99), "loops=99 is not in [1, 4]"),
    "eos": (dict(eos_token_id=10**6), "eos_token_id=1000000 is not in [0, 256]"),
    "model-type": (dict(model_type="llama"), "model_type='llama' is not 'elastic_looped'"),
    # in range, but not the model the weights are: refused from the file's header, nothing allocated
    "shape": (dict(hidden_size=64), "is F32 (257, 32), config.json builds shape (257, 64)"),
    "tensors": (dict(decider_hidden_size=None, loops=4), "model.decider."),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_a_bad_config_is_one_line(copy: Path, case: str, capsys) -> None:
    change, needle = CONFIG_CASES[case]
    if isinstance(change, dict):
        edit_config(copy, **change)
    else:
        (copy / "config.json").write_bytes(change if isinstance(change, bytes) else change.encode())
    one_line(*lm_eval(copy, capsys), needle)


def test_a_fifo_or_folder_as_config_is_refused_without_blocking(copy: Path, capsys) -> None:
    (copy / "config.json").unlink()
    os.mkfifo(copy / "config.json")  # reading it would wait for a writer forever
    one_line(*lm_eval(copy, capsys), "config.json: not a regular file")
    (copy / "config.json").unlink()
    (copy / "config.json").mkdir()
    one_line(*lm_eval(copy, capsys), "config.json: not a regular file")


@pytest.mark.parametrize(
    "file, content, needle",
    [
        ("elastic_pretrain.json", '{"seq_len": "long"}', "elastic_pretrain.json: seq_len='long' is not an integer"),
        ("elastic_pretrain.json", deep(50_000), "elastic_pretrain.json: nested too deeply"),
        ("tokenizer.json", '{"model": 1}', "tokenizer.json: not a valid tokenizer.json"),
        ("model.safetensors", "not safetensors", "model.safetensors: not a readable safetensors file"),
    ],
)
def test_other_bad_files_are_one_line(copy: Path, file: str, content: str, needle: str, capsys) -> None:
    (copy / file).write_text(content)
    one_line(*lm_eval(copy, capsys), needle)


def test_a_tokenizer_beyond_the_vocabulary_is_refused(copy: Path, capsys) -> None:
    """An id past the embedding rows would be an IndexError in the middle of lm-eval."""
    tok = json.loads((copy / "tokenizer.json").read_text())
    tok["model"]["vocab"]["zz"] = 9000
    (copy / "tokenizer.json").write_text(json.dumps(tok))
    one_line(*lm_eval(copy, capsys), "tokenizer.json: token id 9000 is outside the model's vocab_size=257")


def test_a_good_export_loads_as_the_packages_model(good: tuple[Path, Any]) -> None:
    from elastic_pretrain.export import folder

    export, net = good
    model = folder.load_model(export)
    cfg = folder.read_config(export)
    tok = folder.load_tokenizer(export, cfg["eos_token_id"], cfg["vocab_size"])
    assert tok("def f", add_special_tokens=False)["input_ids"] == list(b"def f") and tok.eos_token_id == 256
    ids = torch.randint(0, 257, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for ell in (1, 4):
            torch.testing.assert_close(model(ids, loops=ell).logits, net(ids, loops=ell)[ell], rtol=1e-5, atol=1e-5)


def test_a_tied_export_loads(mesh1, tmp_path: Path) -> None:
    """Tied embeddings: the file holds one tensor for embedding and output layer (lm_head is not stored)."""
    from elastic_pretrain.export import folder
    from elastic_pretrain.export.hf_export import write_export

    net = build(tiny(tie_embeddings=True, edge_mlp="moe", attention="tied", normalization="LayerNorm"))
    write_export(net, TokenizerConfig(), tmp_path / "hf")
    model = folder.load_model(tmp_path / "hf")
    ids = torch.randint(0, 257, (1, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, loops=2).logits, net(ids, loops=2)[2], rtol=1e-5, atol=1e-5)


def test_the_config_check_covers_every_config_field() -> None:
    """A field added to the exported config must get a check here (or the loader would pass it unchecked)."""
    import inspect

    from elastic_pretrain.export import folder
    from elastic_pretrain.export.hf.configuration_elastic import ElasticLoopedConfig

    params = set(inspect.signature(ElasticLoopedConfig.__init__).parameters) - {"self", "kwargs"}
    assert params | {"eos_token_id"} == set(folder.FIELDS)


def test_no_code_loads_a_folder_with_trust_remote_code() -> None:
    """No call in the package passes ``trust_remote_code=True`` (it imports whatever a folder's auto_map names)."""
    found = []
    for path in sorted((REPO / "elastic_pretrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            trusting = isinstance(node, ast.keyword) and node.arg == "trust_remote_code"
            if trusting and not (isinstance(node.value, ast.Constant) and node.value.value is False):
                found.append(f"{path.relative_to(REPO)}:{node.value.lineno}")
    assert found == []
