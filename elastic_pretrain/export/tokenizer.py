"""The run's tokenizer as Hugging Face files (``tokenizer.json`` + ``tokenizer_config.json``).

``byte`` becomes a byte-level BPE with no merges that encodes text to its UTF-8 bytes, ``hf`` the run's
``tokenizer.json`` byte for byte, ``tiktoken`` transformers' ``TikTokenConverter`` output (ranks file copied too,
as ``tokenizer.tiktoken``). Every export checks that the written tokenizer encodes a probe text to the project's
ids, or stops: an exported model fed other ids would score garbage. docs/export.md, "What is exported" (Tokenizers).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastic_pretrain.errors import UserError
from elastic_pretrain.files import copy_file, write_atomic

if TYPE_CHECKING:  # annotations only
    from elastic_pretrain.data.config import TokenizerConfig

EOS = "<|endoftext|>"
PROBE = "def f(x):\n    return x + 1  # héllo, wörld — ∑ 😀\n\tclass A: pass\n"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table (what ``ByteLevel`` uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def byte_tokenizer() -> Any:
    """A ``tokenizers.Tokenizer`` equal to the project's ``ByteTokenizer`` (ids 0..255 bytes, 256 EOS)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS, special=True)])
    return tok


def export_tokenizer(cfg: TokenizerConfig, out: Path) -> int:
    """Write the tokenizer of a ``TokenizerConfig`` into ``out``; returns its EOS id."""
    from transformers import PreTrainedTokenizerFast

    from elastic_pretrain.data.config import local_path
    from elastic_pretrain.data.tokenizer import load_tokenizer

    ours = load_tokenizer(cfg)  # parses (and so checks) the file the config names
    original: Path | None = None
    if cfg.kind == "byte":
        fast = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(), eos_token=EOS)
    elif cfg.kind == "hf":
        assert cfg.path is not None  # TokenizerConfig refuses kind hf without a path
        original = local_path(cfg.path)
        fast = PreTrainedTokenizerFast(tokenizer_file=str(original))
        fast.eos_token = fast.convert_ids_to_tokens(ours.eos_id)
    else:
        fast = _tiktoken_fast(cfg, ours)
    fast.model_max_length = 1 << 30  # RoPE: no learned length limit
    fast.save_pretrained(str(out))
    if original is not None:
        copy_file(original, out / "tokenizer.json", root=out, follow=True)  # the run's file, byte for byte
    check_round_trip(out, ours)
    return int(ours.eos_id)


def _tiktoken_fast(cfg: Any, ours: Any) -> Any:
    import base64
    import tempfile

    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from elastic_pretrain.data.tokenizer import GPT2_PATTERN

    enc = ours._enc
    eos_name = next(name for name, idx in enc._special_tokens.items() if idx == ours.eos_id)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = Path(tmp) / "ranks.tiktoken"  # named encodings: their ranks, written as a file
        write_atomic(ranks, "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in enc._mergeable_ranks.items()),
                     root=Path(tmp))  # fmt: skip
        pattern = enc._pat_str if cfg.name else (cfg.pattern or GPT2_PATTERN)
        converted = TikTokenConverter(
            vocab_file=str(ranks), pattern=pattern, additional_special_tokens=[eos_name]
        ).converted()
    return PreTrainedTokenizerFast(tokenizer_object=converted, eos_token=eos_name)


def check_round_trip(out: Path, ours: Any) -> None:
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(str(out))
    theirs = fast(PROBE, add_special_tokens=False)["input_ids"]
    if theirs != ours.encode(PROBE) or fast.eos_token_id != ours.eos_id:
        raise UserError(
            f"the exported tokenizer in {out} does not reproduce the run's token ids "
            f"(eos {fast.eos_token_id} vs {ours.eos_id}): report this tokenizer kind as unsupported"
        )
    if fast.decode(theirs) != PROBE:
        raise UserError(f"the exported tokenizer in {out} does not decode back to the text it encoded")
