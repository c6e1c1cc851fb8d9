"""The exported Hugging Face model against the project's megatron model, in one process: logits at every
loop count (full forward, per-loop and last-loop KV caches), adaptive depth with the decider, greedy
generation, router variants, and loading without megatron."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_pretrain.data.config import TokenizerConfig
from elastic_pretrain.errors import UserError
from elastic_pretrain.model.config import DeciderConfig
from elastic_pretrain.model.inference import LoopedDecoder, generate
from tests.conftest import REPO
from tests.export.conftest import TOL, build, export, tiny

VARIANTS = {
    # the default layout: prelude + coda, flattened core, ELR route replay and conditioning, TaH2 decider
    "default": (dict(route_replay=True), {}, True),
    "tied-moe-edges-layernorm": (
        dict(tie_embeddings=True, edge_mlp="moe", attention="tied", normalization="LayerNorm", loop_conditioning=False),
        {},
        False,
    ),
    "sigmoid-router-scaled": (
        dict(),
        dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5),
        False,
    ),
    "pre-softmax-router-replay": (dict(route_replay=True, moe_top_k=3), dict(moe_router_pre_softmax=True), False),
}


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def pair(request: pytest.FixtureRequest, mesh1, tmp_path_factory: pytest.TempPathFactory):
    model_kw, tconfig, with_decider = VARIANTS[request.param]
    decider = DeciderConfig() if with_decider else None
    net = build(tiny(**model_kw), decider=decider, **tconfig)
    return net, export(net, tmp_path_factory.mktemp("hf") / request.param, decider=decider)


def test_logits_equal_at_every_loop_count(pair) -> None:
    net, hf = pair
    ids = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(1))
    for ell in range(1, net.cfg.max_loops + 1):
        with torch.no_grad():
            ref = net(ids, loops=ell)[ell]
            got = hf(ids, loops=ell).logits
        assert got.shape == ref.shape == (2, 40, 257)
        torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("policy", ["per-loop", "last-loop"])
def test_kv_caches_equal_the_projects_decoder(pair, policy: str) -> None:
    net, hf = pair
    ids = torch.randint(0, 257, (2, 14), generator=torch.Generator().manual_seed(2))
    for ell in (1, net.cfg.max_loops):
        dec = LoopedDecoder(net, loops=ell, kv_cache=policy)
        ref_prefill, ref_next = dec.step(ids[:, :11]).logits_BSV, dec.step(ids[:, 11:]).logits_BSV
        with torch.no_grad():
            out = hf(ids[:, :11], loops=ell, kv_cache=policy, use_cache=True)
            nxt = hf(ids[:, 11:], loops=ell, past_key_values=out.past_key_values, use_cache=True)
        torch.testing.assert_close(out.logits, ref_prefill, **TOL)
        torch.testing.assert_close(nxt.logits, ref_next, **TOL)
        assert out.past_key_values.length == 14 and out.past_key_values.policy == policy
        assert out.past_key_values.nbytes() == dec.cache.nbytes()  # same caches: per (layer, pass) or per layer


def test_greedy_generate_equals_the_projects(pair) -> None:
    net, hf = pair
    prompt = torch.tensor([[100, 101, 102, 32, 102, 40]])
    for ell, policy in ((1, "last-loop"), (net.cfg.max_loops, "last-loop"), (2, "per-loop")):
        ref = generate(net, prompt, loops=ell, kv_cache=policy, max_new_tokens=12)
        got = hf.generate(prompt, max_new_tokens=12, do_sample=False, loops=ell, kv_cache=policy,
                          attention_mask=torch.ones_like(prompt))  # fmt: skip
        assert got.tolist() == ref.tokens_BT.tolist()


def test_adaptive_depth_with_the_decider(mesh1, tmp_path: Path) -> None:
    decider = DeciderConfig(threshold=0.5)
    net = build(tiny(route_replay=True), decider=decider)
    with torch.no_grad():  # a decider that stops some tokens early and lets others run on
        net.decider.fc2.weight.normal_(0.0, 2.0)
    hf = export(net, tmp_path / "hf", decider=decider)
    assert hf.config.decider_threshold == 0.5
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    for policy in ("per-loop", "last-loop"):
        ref = generate(net, prompt, loops="auto", stop=net.decider.stopper(0.5), kv_cache=policy, max_new_tokens=16)
        got = hf.generate(prompt, max_new_tokens=16, do_sample=False, loops="auto", kv_cache=policy,
                          attention_mask=torch.ones_like(prompt))  # fmt: skip
        assert got.tolist() == ref.tokens_BT.tolist()
        passes = set(ref.passes_BN.flatten().tolist())
        assert len(passes) > 1, passes  # adaptive: tokens ran different numbers of passes
    # teacher-forced: the passes each token ran and the logits equal the project's decoder
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(4))
    ref_step = LoopedDecoder(net, kv_cache="per-loop", stop=net.decider.stopper(0.5)).step(ids)
    with torch.no_grad():
        out = hf(ids, loops="auto")
    assert out.passes.tolist() == ref_step.passes_BS.tolist()
    torch.testing.assert_close(out.logits, ref_step.logits_BSV, **TOL)
    with pytest.raises(ValueError, match="outside"):
        hf(ids, loops=5)


def fresh_interpreter(script: str) -> dict[str, Any]:
    """Run ``script`` in a new interpreter of this venv; it prints one JSON line last."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_loads_without_megatron(mesh1, tmp_path: Path) -> None:
    """A fresh interpreter of the venv loads the export with docs/export.md's line, transformers alone (no
    torchvision that cannot import, no patch of transformers: issue 33 item 4); its logits equal the project's."""
    net = build(tiny(route_replay=True), decider=DeciderConfig())
    export(net, tmp_path / "hf", decider=DeciderConfig())
    ids = torch.randint(0, 257, (1, 20), generator=torch.Generator().manual_seed(5))
    got = fresh_interpreter(f"""
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "hf")!r}, trust_remote_code=True)
logits = {{ell: model(torch.tensor({ids.tolist()}), loops=ell).logits.tolist() for ell in range(1, 5)}}
print(json.dumps({{"megatron": sorted(k for k in sys.modules if k.startswith("megatron")),
                  "project": sorted(k for k in sys.modules if k.startswith("elastic_pretrain")),
                  "logits": logits}}))
""")
    assert got["megatron"] == [] and got["project"] == []
    for ell in range(1, 5):
        with torch.no_grad():
            torch.testing.assert_close(torch.tensor(got["logits"][str(ell)]), net(ids, loops=ell)[ell], **TOL)


def test_loads_beside_the_streaming_standin(mesh1, tmp_path: Path) -> None:
    """A process that read shards first (``import_streaming``: stand-in torchvision names for streaming's
    vision module when no torchvision is installed) still loads the export: transformers must not take the
    stand-in for a torchvision (data/streaming_compat.py)."""
    export(build(tiny()), tmp_path / "hf")
    got = fresh_interpreter(f"""
import json, sys
from elastic_pretrain.data.streaming_compat import import_streaming
import_streaming()
from transformers import AutoModelForCausalLM
from transformers.utils import is_torchvision_available
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "hf")!r}, trust_remote_code=True)
tv = sys.modules.get("torchvision")
print(json.dumps({{"standin": bool(getattr(tv, "_elastic_pretrain_standin", False)),
                  "torchvision_available": is_torchvision_available(), "class": type(model).__name__}}))
""")
    assert got["class"] == "ElasticLoopedForCausalLM"
    if got["standin"]:  # no importable torchvision here (the CPU venv): transformers must know it is absent
        assert got["torchvision_available"] is False


def test_generation_config(mesh1, tmp_path: Path) -> None:
    """``generation_config.json`` (docs/export.md lists it): written, loaded by transformers, used by generate."""
    from transformers import GenerationConfig

    model = export(build(tiny()), tmp_path / "hf")
    gen = GenerationConfig.from_pretrained(str(tmp_path / "hf"))
    assert gen.eos_token_id == 256 and gen.pad_token_id == 256 and gen.do_sample is False
    assert model.generation_config.eos_token_id == 256


def test_export_files_and_config(mesh1, tmp_path: Path) -> None:
    net = build(tiny(), conditioning=False)
    export(net, tmp_path / "hf")
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "modeling_elastic.py",
        "tokenizer.json",
        "configuration_elastic.py",
        "tokenizer_config.json",
        "elastic_pretrain.json",
    } <= set(names)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["max_loops"] == 4 and cfg["core_layers"] == 1 and cfg["num_experts"] == 8  # built shape (flatten 2)
    assert cfg["loop_conditioning"] is False and cfg["decider_hidden_size"] is None and cfg["eos_token_id"] == 256
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("lm_head.weight").shape == (257, 32)  # TP padding of the vocabulary dropped
    assert not any("loop_conditioning" in k for k in keys)  # heads never switched on are not exported
    with pytest.raises(UserError, match="not an empty folder"):
        export(net, tmp_path / "hf")


def test_unsupported_megatron_settings_fail_at_export(mesh1, tmp_path: Path) -> None:
    net = build(tiny(), moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    with pytest.raises(UserError, match="router expert bias"):
        export(net, tmp_path / "hf")


def test_tokenizers_round_trip(tmp_path: Path) -> None:
    """byte (the default), a Hugging Face tokenizer.json (copied byte for byte) and a tiktoken ranks file."""
    import base64

    from transformers import AutoTokenizer

    from elastic_pretrain.data.tokenizer import load_tokenizer
    from elastic_pretrain.export.tokenizer import PROBE, byte_tokenizer, export_tokenizer

    hf_file = tmp_path / "tok.json"
    byte_tokenizer().save(str(hf_file))
    ranks = tmp_path / "tiny.tiktoken"
    merges = [bytes([b]) for b in range(256)] + [b"de", b"def", b"  ", b"    ", b"re", b"ret"]
    ranks.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(merges)))
    configs = {
        "byte": TokenizerConfig(),
        "hf": TokenizerConfig(kind="hf", path=str(hf_file)),
        "tiktoken": TokenizerConfig(kind="tiktoken", path=str(ranks)),
    }
    for kind, cfg in configs.items():
        out = tmp_path / kind
        out.mkdir()
        eos = export_tokenizer(cfg, out)
        ours, theirs = load_tokenizer(cfg), AutoTokenizer.from_pretrained(str(out))
        text = PROBE + "ünïcode ✓ 🙂 return def"
        assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text), kind
        assert theirs.eos_token_id == eos == ours.eos_id
        assert theirs.decode(ours.encode(text)) == text
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == hf_file.read_bytes()
    assert len(load_tokenizer(configs["tiktoken"]).encode("def f():\n    return")) < len("def f():\n    return")
