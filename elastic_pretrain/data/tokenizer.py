"""Tokenizers behind one small interface: byte-level (built in), Hugging Face tokenizer.json, tiktoken.

Every tokenizer has a ``fingerprint``: a sha256 over its *definition* (kind, vocabulary/merges file
bytes, pattern, EOS), written into each manifest. Training refuses shards whose fingerprint differs,
because ids from another vocabulary would train silently on garbage.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from elastic_pretrain.config import clip
from elastic_pretrain.data.config import TokenizerConfig, local_path
from elastic_pretrain.errors import UserError

_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
# Largest rank a ranks file may use: tiktoken keeps ranks as u32 and the EOS id follows the last rank;
# real vocabularies stay far below (o200k_base: 200k).
MAX_RANK = (1 << 24) - 2
# GPT-2's pre-tokenisation regex (tiktoken's r50k_base), the default for a bare ranks file.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class Tokenizer(Protocol):
    """What prepare-data and generation need from a tokenizer."""

    vocab_size: int
    eos_id: int
    fingerprint: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def _digest(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and EOS = 256 between documents: no file, no unknown tokens."""

    vocab_size = 257
    eos_id = 256
    fingerprint = _digest({"kind": "byte", "vocab_size": 257, "eos_id": 256})

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Fast path for packing: the bytes as a uint16 array without a Python list."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: list[int]) -> str:
        # EOS and any id outside a byte decode as a newline / are dropped, so samples stay readable
        return bytes(i if i < 256 else 10 for i in ids if 0 <= i <= 256).decode("utf-8", errors="replace")


def _read_file(path: str, what: str) -> tuple[Path, bytes]:
    p = local_path(path)
    if not p.is_file():
        raise UserError(f"tokenizer.path: {p} does not exist; point it at the {what} file")
    return p, p.read_bytes()


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` library (no special tokens added)."""

    def __init__(self, path: str, eos_token: str | None = None) -> None:
        from tokenizers import Tokenizer as _HF

        p, raw = _read_file(path, "tokenizer.json")
        try:
            self._tok = _HF.from_str(raw.decode("utf-8"))
        except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
            raise UserError(f"tokenizer.path: {p} is not a valid tokenizer.json ({err}); re-export it") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = _find_eos(eos_token, self._tok.token_to_id, p)
        self.fingerprint = _digest({"kind": "hf", "sha256": hashlib.sha256(raw).hexdigest(), "eos": self.eos_id})

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=False))


def _find_eos(eos_token: str | None, lookup: Any, where: Path | str) -> int:
    names = (eos_token,) if eos_token else _EOS_CANDIDATES
    for name in names:
        idx = lookup(name)
        if idx is not None:
            return int(idx)
    raise UserError(f"tokenizer: {where} has no EOS token among {', '.join(names)}; set tokenizer.eos_token")


class TiktokenTokenizer:
    """tiktoken BPE from a ranks file (``base64-token rank`` lines) or a named encoding.

    A ranks file gets one special token, EOS (``<|endoftext|>`` unless ``eos_token`` says otherwise),
    with the id after the last rank.
    """

    def __init__(self, cfg: TokenizerConfig) -> None:
        import tiktoken

        if cfg.name:
            try:
                self._enc = tiktoken.get_encoding(cfg.name)
            except Exception as err:
                raise UserError(
                    f"tokenizer.name: cannot load tiktoken encoding {cfg.name!r} ({err}); "
                    "use a ranks file via tokenizer.path on offline machines"
                ) from None
            ident: dict[str, Any] = {"name": cfg.name}
            eos_name = cfg.eos_token or "<|endoftext|>"
            self.eos_id = _find_eos(eos_name, self._enc._special_tokens.get, cfg.name)
        else:
            assert cfg.path is not None
            p, raw = _read_file(cfg.path, "tiktoken ranks")
            ranks = _parse_ranks(raw, p)
            eos_name = cfg.eos_token or "<|endoftext|>"
            self.eos_id = max(ranks.values()) + 1
            pattern = cfg.pattern or GPT2_PATTERN
            try:
                self._enc = tiktoken.Encoding(
                    name=f"file:{p.name}",
                    pat_str=pattern,
                    mergeable_ranks=ranks,
                    special_tokens={eos_name: self.eos_id},
                )
            except ValueError as err:  # the regex (tiktoken's Rust side says which position)
                raise UserError(
                    f"tokenizer.pattern: {clip(pattern, 60)!r} is not a valid regular expression "
                    f"({clip(str(err), 100)}): fix it, or unset it for the GPT-2 pattern"
                ) from None
            except BaseException as err:  # a Rust panic (pyo3 PanicException) is a BaseException
                if isinstance(err, KeyboardInterrupt | SystemExit):
                    raise
                raise UserError(
                    f"tokenizer.path: tiktoken rejects {p} ({clip(str(err), 100)}): fix the ranks file"
                ) from None
            ident = {"sha256": hashlib.sha256(raw).hexdigest(), "pattern": pattern}
        self._where = f"{cfg.path or cfg.name}"
        self.vocab_size = int(self._enc.n_vocab)
        self.fingerprint = _digest({"kind": "tiktoken", **ident, "eos": self.eos_id})

    def encode(self, text: str) -> list[int]:
        # special tokens in the text are encoded as ordinary text: documents cannot inject an EOS
        try:
            return list(self._enc.encode_ordinary(text))
        except BaseException as err:  # a Rust panic would otherwise kill a prepare-data worker outright
            if isinstance(err, KeyboardInterrupt | SystemExit):
                raise
            raise UserError(
                f"tokenizer: tiktoken failed on a document with {self._where} ({clip(str(err), 100)}): "
                "fix the tokenizer file"
            ) from None

    def decode(self, ids: list[int]) -> str:
        return str(self._enc.decode(ids))


def _parse_ranks(raw: bytes, path: Path) -> dict[bytes, int]:
    import base64
    import binascii

    ranks: dict[bytes, int] = {}
    seen: dict[int, int] = {}  # rank -> line
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token_b64, rank_text = line.split()
            token, rank = base64.b64decode(token_b64, validate=True), int(rank_text)
        except (ValueError, binascii.Error):
            raise UserError(
                f"tokenizer.path: {path} line {lineno} is not '<base64 token> <rank>'; fix the ranks file"
            ) from None
        where = f"tokenizer.path: {path} line {lineno}"
        if not 0 <= rank <= MAX_RANK:
            raise UserError(f"{where}: rank {clip(str(rank), 30)} is outside 0..{MAX_RANK:,}; fix the ranks file")
        if rank in seen:
            raise UserError(f"{where}: rank {rank} is also on line {seen[rank]}; each rank names one token")
        if token in ranks:
            raise UserError(f"{where}: token {token!r} already has rank {ranks[token]}; each token has one rank")
        ranks[token], seen[rank] = rank, lineno
    if not ranks:
        raise UserError(f"tokenizer.path: {path} holds no ranks; point it at a *.tiktoken file")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:  # byte-level BPE starts from single bytes: tiktoken panics on text with a byte it lacks
        raise UserError(
            f"tokenizer.path: {path} has no rank for {len(missing)} of the 256 single bytes (e.g. "
            f"0x{missing[0]:02x}); a byte-level BPE ranks file holds all 256: fix the ranks file"
        )
    return ranks


def load_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """Build the tokenizer a config names (files are read now, so errors surface before any work)."""
    if cfg.kind == "byte":
        return ByteTokenizer()
    if cfg.kind == "hf":
        assert cfg.path is not None
        return HFTokenizer(cfg.path, cfg.eos_token)
    return TiktokenTokenizer(cfg)


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """The narrowest unsigned dtype holding every id (uint16 up to 65,536 ids, else uint32)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)
