"""Reading an export folder that may come from someone else (``elastic-pretrain lm-eval``, ``hf_import``).

``from_pretrained(DIR, trust_remote_code=True)`` would import the folder's ``modeling_elastic.py`` and run
whatever was appended to it (issue 35 item 2). So the project never runs a folder's code and never calls
``from_pretrained`` on one: the model is the *package's* class, built from ``config.json``'s checked keys
(:func:`read_config`), its tensors from ``model.safetensors`` with every name and shape checked; the code files
must be the package's byte for byte (:func:`check_code`). Every failure is one line naming the file.
docs/security.md, "Export folders".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_pretrain.errors import UserError
from elastic_pretrain.export.hf_export import AUTO_MAP, HF_DIR, MODEL_FILES, PROVENANCE, WEIGHTS
from elastic_pretrain.files import check_regular, read_json_object, read_prefix, read_small

if TYPE_CHECKING:  # annotations only: reading an export's files needs no torch
    from elastic_pretrain.export.hf.modeling_elastic import ElasticLoopedForCausalLM

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
MAX_TOKENIZER_BYTES = 256 << 20  # a 200k-token BPE tokenizer.json is ~10 MB
# A layer count beyond these builds millions of modules before any size check could run.
MAX_LAYERS, MAX_LOOPS, MAX_PASSES = 1024, 256, 4096  # MAX_PASSES: core layers x loops
_DTYPES = ("F32", "BF16", "F16", "F64")

# config.json key -> (kind, lower, upper); "int"/"float" ranges inclusive, "choice" the allowed values.
_INTS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 24),
    "hidden_size": (1, 1 << 16),
    "num_attention_heads": (1, 1024),
    "num_query_groups": (1, 1024),
    "ffn_hidden_size": (1, 1 << 20),
    "moe_ffn_hidden_size": (1, 1 << 20),
    "num_experts": (1, 4096),
    "moe_top_k": (1, 4096),
    "prelude_layers": (0, MAX_LAYERS),
    "core_layers": (1, MAX_LAYERS),
    "coda_layers": (0, MAX_LAYERS),
    "max_loops": (1, MAX_LOOPS),
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "attention": ("untied", "tied"),
    "edge_mlp": ("dense", "moe"),
    "normalization": ("RMSNorm", "LayerNorm"),
    "router_score_function": ("softmax", "sigmoid"),
    "kv_cache": ("per-loop", "last-loop"),
}
_BOOLS = ("route_replay", "router_pre_softmax", "loop_conditioning", "tie_word_embeddings", "use_cache")
_FLOATS: dict[str, tuple[float, float]] = {  # open-ended where 0 or infinity would break the model
    "norm_eps": (0.0, 1.0),
    "rope_base": (1.0, 1e12),
    "decider_threshold": (0.0, 1.0),
}
_OPTIONAL = ("decider_hidden_size", "router_topk_scaling_factor", "loops", "eos_token_id")
# every ElasticLoopedConfig argument export writes (tests/security/test_export_inputs.py: the signature's)
FIELDS = (*_INTS, *_CHOICES, *_BOOLS, *_FLOATS, *_OPTIONAL)


def _refuse(export_dir: Path, key: str, value: Any, want: str, file: str = CONFIG) -> UserError:
    from elastic_pretrain.config import show

    return UserError(f"{export_dir / file}: {key}={show(value, 40)} is not {want}; {_REEXPORT}")


_REEXPORT = "it was not written by elastic-pretrain export: re-export the checkpoint"


def _check_number(
    export_dir: Path, key: str, value: Any, lo: float, hi: float, *, integer: bool, file: str = CONFIG
) -> None:
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        raise _refuse(export_dir, key, value, "an integer" if integer else "a number", file)
    if integer and not lo <= value <= hi:
        raise _refuse(export_dir, key, value, f"in [{lo:,}, {hi:,}]", file)
    if not integer and not (math.isfinite(value) and lo < value <= hi):
        raise _refuse(export_dir, key, value, f"in ({lo:g}, {hi:g}]", file)


def _check_optional(export_dir: Path, cfg: dict[str, Any]) -> None:
    for key, hi in (("decider_hidden_size", 1 << 16), ("eos_token_id", cfg["vocab_size"] - 1)):
        if cfg[key] is not None:
            _check_number(export_dir, key, cfg[key], 0 if key == "eos_token_id" else 1, hi, integer=True)
    if cfg["router_topk_scaling_factor"] is not None:
        _check_number(export_dir, "router_topk_scaling_factor", cfg["router_topk_scaling_factor"], 0.0, 1e6,
                      integer=False)  # fmt: skip
    loops = cfg["loops"]
    if loops == "auto":
        if cfg["decider_hidden_size"] is None:
            raise _refuse(export_dir, "loops", loops, "usable without a decider (decider_hidden_size is null)")
    elif loops is not None:
        _check_number(export_dir, "loops", loops, 1, cfg["max_loops"], integer=True)


def _check_shape(export_dir: Path, cfg: dict[str, Any]) -> None:
    heads, groups, hidden = cfg["num_attention_heads"], cfg["num_query_groups"], cfg["hidden_size"]
    if hidden % heads or (hidden // heads) % 2:
        raise _refuse(export_dir, "hidden_size", hidden, f"an even multiple of num_attention_heads={heads}")
    if heads % groups:
        raise _refuse(export_dir, "num_query_groups", groups, f"a divisor of num_attention_heads={heads}")
    if cfg["moe_top_k"] > cfg["num_experts"]:
        raise _refuse(export_dir, "moe_top_k", cfg["moe_top_k"], f"at most num_experts={cfg['num_experts']}")
    if cfg["core_layers"] * cfg["max_loops"] > MAX_PASSES:
        raise _refuse(export_dir, "max_loops", cfg["max_loops"], f"at most {MAX_PASSES} / core_layers")


def read_config(export_dir: Path | str) -> dict[str, Any]:
    """``config.json``'s model fields (:data:`FIELDS`), each checked, plus ``pad_token_id``."""
    export_dir = Path(export_dir)
    cfg = read_json_object(export_dir / CONFIG, f"is {export_dir} an elastic-pretrain export folder?")
    if cfg.get("model_type") != "elastic_looped":
        raise _refuse(export_dir, "model_type", cfg.get("model_type"), "'elastic_looped'")
    missing = [k for k in FIELDS if k not in cfg]
    if missing:
        raise UserError(f"{export_dir / CONFIG}: no {', '.join(repr(k) for k in missing[:3])}; {_REEXPORT}")
    for key, (lo, hi) in _INTS.items():
        _check_number(export_dir, key, cfg[key], lo, hi, integer=True)
    for key, (flo, fhi) in _FLOATS.items():
        _check_number(export_dir, key, cfg[key], flo, fhi, integer=False)
    for key, choices in _CHOICES.items():
        if cfg[key] not in choices:
            raise _refuse(export_dir, key, cfg[key], f"one of {', '.join(choices)}")
    for key in _BOOLS:
        if not isinstance(cfg[key], bool):
            raise _refuse(export_dir, key, cfg[key], "true or false")
    _check_optional(export_dir, cfg)
    _check_shape(export_dir, cfg)
    out = {k: cfg[k] for k in FIELDS}
    out["pad_token_id"] = cfg["eos_token_id"]  # export writes pad = eos
    return out


def check_code(export_dir: Path | str) -> None:
    """The folder's code files are the package's, byte for byte, and ``auto_map`` names them: anything
    else is code nobody reviewed, which ``trust_remote_code=True`` would run (docs/export.md)."""
    export_dir = Path(export_dir)
    for name in MODEL_FILES:
        ours = (HF_DIR / name).read_bytes()
        theirs = read_prefix(export_dir / name, len(ours) + 1, f"export folders carry the package's {name}")
        if theirs != ours:
            raise UserError(
                f"{export_dir / name}: not the file elastic-pretrain exports (edited, or from another version); "
                f"its code is never run here, but trust_remote_code=True would run it: re-export the checkpoint"
            )
    auto_map = read_json_object(export_dir / CONFIG, "an export folder's config").get("auto_map")
    if auto_map != AUTO_MAP:
        raise UserError(
            f"{export_dir / CONFIG}: auto_map names other code than the exported files "
            f"(trust_remote_code=True would run it): re-export the checkpoint"
        )


def check_weights(export_dir: Path, model: ElasticLoopedForCausalLM) -> None:
    """Every tensor in ``model.safetensors``'s header has a name and shape ``model`` (a meta-device
    skeleton) has, and none is missing; the header is read without loading any tensor."""
    from safetensors import safe_open

    path = export_dir / WEIGHTS
    check_regular(path, "an export folder holds its weights in model.safetensors")
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        want.pop("lm_head.weight", None)  # the embedding's tensor, not stored twice
    try:
        with safe_open(str(path), "pt") as f:
            got = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118
    except Exception as err:  # safetensors raises its own SafetensorError (and OSError) on a bad header
        raise UserError(f"{path}: not a readable safetensors file ({str(err)[:80]}); {_REEXPORT}") from None
    for key, (shape, dtype) in got.items():
        if want.get(key) != shape or dtype not in _DTYPES:
            expected = f"shape {want[key]}" if key in want else "no such tensor"
            raise UserError(f"{path}: {key[:80]} is {dtype} {shape}, config.json builds {expected}; {_REEXPORT}")
    missing = sorted(set(want) - set(got))
    if missing:
        raise UserError(f"{path}: no tensor {missing[0]} (and {len(missing) - 1} more); {_REEXPORT}")


def load_model(export_dir: Path | str) -> ElasticLoopedForCausalLM:
    """The package's ``ElasticLoopedForCausalLM`` with the folder's weights (fp32, eval mode); the folder's
    code is checked (:func:`check_code`) and never imported."""
    import torch
    from safetensors.torch import load_file

    export_dir = Path(export_dir)
    check_code(export_dir)
    cfg = read_config(export_dir)
    from elastic_pretrain.export.hf.configuration_elastic import ElasticLoopedConfig
    from elastic_pretrain.export.hf.modeling_elastic import ElasticLoopedForCausalLM

    config = ElasticLoopedConfig(**cfg)
    config._name_or_path = str(export_dir)
    with torch.device("meta"):
        check_weights(export_dir, ElasticLoopedForCausalLM(config))
    model = ElasticLoopedForCausalLM(config)
    model.load_state_dict(load_file(str(export_dir / WEIGHTS)), strict=not config.tie_word_embeddings)
    return model.eval()


def load_tokenizer(export_dir: Path | str, eos_id: int | None, vocab_size: int) -> Any:
    """The export's tokenizer from ``tokenizer.json``'s text (the class and files export writes), its EOS the
    config's; every id it can produce must be an embedding row."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    path = Path(export_dir) / TOKENIZER
    raw = read_small(path, MAX_TOKENIZER_BYTES, "an export folder holds its tokenizer in tokenizer.json")
    try:
        backend = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
        raise UserError(f"{path}: not a valid tokenizer.json ({str(err)[:80]}); {_REEXPORT}") from None
    top = max(backend.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab_size:
        raise UserError(f"{path}: token id {top} is outside the model's vocab_size={vocab_size}; {_REEXPORT}")
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=1 << 30,
                                   clean_up_tokenization_spaces=False)  # fmt: skip
    if eos_id is not None:
        eos = backend.id_to_token(eos_id)
        if eos is None:
            raise UserError(f"{path}: has no token {eos_id} (config.json's eos_token_id); {_REEXPORT}")
        fast.eos_token = eos
    return fast


def read_provenance(export_dir: Path | str) -> dict[str, Any]:
    """``elastic_pretrain.json`` (optional) with ``seq_len`` checked: an integer in [1, 2**24] or absent."""
    export_dir = Path(export_dir)
    path = export_dir / PROVENANCE
    if not path.exists():
        return {}
    prov = read_json_object(path, "an export's provenance file (delete it to use seq_len 2048)")
    seq_len = prov.get("seq_len")
    if seq_len is not None:
        _check_number(path.parent, "seq_len", seq_len, 1, 1 << 24, integer=True, file=PROVENANCE)
    return prov
