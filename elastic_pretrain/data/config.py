"""Typed configs of the data concern: tokenizer, streams, shard preparation, the loader.

A recipe in ``data/<name>.yaml`` builds a :class:`DataConfig`. Relative paths in it (stream
``path``/``local``, ``prepare.output``, ``prepare.inputs``, ``tokenizer.path``) resolve against the
**current working directory** of the process, like every other path on the command line; run
``elastic-pretrain`` from the repository root (Slurm templates ``cd`` there) or give absolute paths.
"""

from __future__ import annotations

import dataclasses
import os
import re
import string
from pathlib import Path
from typing import Literal

from elastic_pretrain.config import ConfigError, field

TokenizerKind = Literal["byte", "hf", "tiktoken"]
ShardFormat = Literal["mds", "wds"]

# scheme://... (s3, gs, oci, azure, hf, sftp, file, http(s), ...); a bare path is local.
_URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
# Split and shard names: prepare-data writes train/val and shard.00000.mds / shard-000000.tar / index.json.
# No leading dot: a split '.ssh' under a cache rooted at ~ is ~/.ssh (issue 35, item 3).
_DATA_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


def is_data_name(name: object) -> bool:
    """A split or shard name: letters, digits, ``_``, ``-`` and inner dots, not starting with a dot."""
    return isinstance(name, str) and bool(_DATA_NAME.fullmatch(name))


def is_remote(path: str) -> bool:
    """True for ``scheme://`` URIs other than ``file://`` (which is a local path)."""
    return bool(_URI.match(path)) and not path.startswith("file://")


def local_path(path: str) -> Path:
    """A local path or ``file://`` URI as an absolute :class:`Path` (relative to the cwd)."""
    if path.startswith("file://"):
        path = path[len("file://") :]
    return Path(os.path.expanduser(path)).absolute()


@dataclasses.dataclass(kw_only=True)
class TokenizerConfig:
    """Which tokenizer turns text into ids; its fingerprint is checked against each manifest."""

    kind: TokenizerKind = field(
        "byte",
        doc="byte: ids 0..255 are UTF-8 bytes, 256 is EOS; hf: a Hugging Face "
        "tokenizer.json file; tiktoken: a tiktoken BPE ranks file (or a named encoding)",
    )
    path: str | None = field(None, doc="tokenizer.json (hf) or *.tiktoken ranks file (tiktoken); unused for byte")
    name: str | None = field(
        None,
        doc="tiktoken only: a named encoding (e.g. cl100k_base) instead of a file; "
        "tiktoken downloads it once into its cache, so it needs network the first time",
    )
    eos_token: str | None = field(
        None,
        doc="hf/tiktoken: the document separator token; None picks "
        "<|endoftext|>, </s> or <eos>, whichever the tokenizer has",
    )
    pattern: str | None = field(
        None, doc="tiktoken with a ranks file: the pre-tokenisation regex (None: the GPT-2 pattern)"
    )

    def __post_init__(self) -> None:
        if self.kind == "byte" and (self.path or self.name):
            raise ConfigError(
                "tokenizer.path/name: the byte tokenizer takes no file; remove them or set tokenizer.kind"
            )
        if self.kind == "hf" and not self.path:
            raise ConfigError("tokenizer.path: kind 'hf' needs the path of a tokenizer.json file")
        if self.kind == "tiktoken" and not (self.path or self.name):
            raise ConfigError("tokenizer.path: kind 'tiktoken' needs a ranks file path or tokenizer.name")


@dataclasses.dataclass(kw_only=True)
class StreamConfig:
    """One prepared dataset (a directory with manifest.json and split subdirectories of shards)."""

    path: str = field(doc="local directory or remote URI (s3://, gs://, hf://, file://...) holding manifest.json")
    split: str = field("train", doc="subdirectory of shards to read: 'train' or 'val' as written by prepare-data")
    local: str | None = field(
        None,
        doc="cache directory: required for a remote URI; for a local path, files are copied into it "
        "before reading (a slow shared filesystem); None reads a local path in place",
    )
    weight: float = field(1.0, doc="relative share of this stream in the training mixture (normalised over streams)")

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("path: empty; give the directory written by prepare-data (or its remote URI)")
        if self.weight <= 0:
            raise ConfigError(f"weight: {self.weight} must be > 0 (drop the stream instead of weighting it 0)")
        if is_remote(self.path) and not self.local:
            raise ConfigError(f"local: remote stream {self.path} needs a local cache directory, e.g. local: cache/x")
        if not is_data_name(self.split):
            raise ConfigError(
                f"split: {self.split!r} must be a plain directory name such as train or val "
                "(letters, digits, '_', '-', '.', not starting with '.')"
            )


# The alphabet of the synthetic corpus (data/synthetic.py), here because SyntheticConfig validates against it.
NAMES = string.ascii_lowercase  # one-letter variable names
VALUES = string.digits
PAD = "."
MAX_DIFFICULTY = 255  # stored as uint8


@dataclasses.dataclass(kw_only=True)
class SyntheticConfig:
    """``prepare.source: synthetic``: chained variable assignments whose answers need 1..max_depth hops."""

    task: Literal["chains"] = field("chains", doc="the generator: chains = k-hop chained variable assignment")
    chains: int = field(
        2, doc="chains per line, each rooted at its own digit: a model that cannot follow them is left guessing"
    )
    min_variables: int = field(
        4,
        doc="fewest variables in a line (all chains together); the last line of a document may have fewer, "
        "down to one per chain, to fill it",
    )
    max_variables: int = field(8, doc="most variables in a line")
    max_depth: int = field(6, doc="longest chain: the hardest answer needs this many hops")
    names: Literal["random", "alphabetical"] = field(
        "alphabetical",
        doc="random: each line draws its variable names, and asks them in a random order (each chain deepest "
        "first); alphabetical: a, b, c, ... in definition order, asked in reverse (only the chains and the answers "
        "are left to predict)",
    )
    assign: str = field(
        "",
        doc="the text between a variable and its source in a definition: '' writes b=a as 'ba' (the shape "
        "an induction head copies), '=' as 'b=a'",
    )
    queries: Literal["all", "leaves"] = field(
        "all",
        doc="all: every variable is asked (each chain deepest first); an ancestor asked after its child is two "
        "lookups away (its child's definition, then the child's answer), so only the leaves need the whole "
        "chase; leaves: only the last variable of each chain is asked, chains in random order, and the roots are "
        "drawn with replacement (no answer follows from another by elimination): every answer is a full chase",
    )

    def __post_init__(self) -> None:
        if not 1 <= self.chains <= len(VALUES):
            raise ConfigError(f"prepare.synthetic.chains: {self.chains} must be in 1..{len(VALUES)}, e.g. 2")
        if not self.chains <= self.min_variables <= self.max_variables <= len(NAMES):
            raise ConfigError(
                f"prepare.synthetic: need chains <= min_variables <= max_variables <= {len(NAMES)} "
                f"(got {self.chains}, {self.min_variables}, {self.max_variables}); e.g. 4 and 8"
            )
        if not 1 <= self.max_depth < MAX_DIFFICULTY or self.max_depth * self.chains < self.min_variables:
            raise ConfigError(
                f"prepare.synthetic.max_depth: {self.max_depth} must be in 1..{MAX_DIFFICULTY - 1} and leave room "
                f"for min_variables ({self.min_variables}) in {self.chains} chain(s)"
            )
        if any(c in NAMES + VALUES + ",;?\n" + PAD for c in self.assign) or not self.assign.isascii():
            raise ConfigError(
                f"prepare.synthetic.assign: {self.assign!r} must be ASCII without letters, digits or ,;?. ('' or '=')"
            )

    def line_chars(self, variables: int) -> int:
        """Characters of a line with ``variables`` variables, its newline included: ``x=y,`` per assignment
        (the last without the comma, then ``;``) and ``?xv`` per query (one per chain with ``queries: leaves``)."""
        asked = self.chains if self.queries == "leaves" else variables
        return (3 + len(self.assign)) * variables + 3 * asked + 1


@dataclasses.dataclass(kw_only=True)
class PrepareConfig:
    """How ``prepare-data`` builds shards: inputs -> tokens -> packed sequences -> shards + manifest."""

    source: Literal["stdlib", "files", "synthetic"] = field(
        "stdlib",
        doc="stdlib: the running CPython's standard-library .py sources; files: the paths in inputs; synthetic: "
        "text generated from prepare.seed with a per-token difficulty beside the tokens (prepare.synthetic)",
    )
    synthetic: SyntheticConfig | None = field(
        None, doc="source synthetic: the generator and its settings (data/synthetic.py; docs/data.md)"
    )
    inputs: list[str] = field(
        factory=list,
        doc="files, directories (walked recursively) or glob patterns; "
        "text files are one document each, .jsonl lines and .parquet rows are documents",
    )
    input_format: Literal["auto", "text", "jsonl", "parquet"] = field(
        "auto", doc="auto: by extension (.jsonl/.json -> jsonl, .parquet, else text)"
    )
    text_field: str = field("text", doc="JSONL key / Parquet column holding the document text")
    suffixes: list[str] = field(
        factory=list,
        doc="only files with these suffixes when walking directories (empty: .py for stdlib; for files "
        ".txt .md .py .jsonl .json .parquet with input_format auto, every file that is not hidden otherwise)",
    )
    output: str = field(doc="directory to write: manifest.json, train/ and val/ shards")
    val_fraction: float = field(
        0.01,
        doc="share of documents held out for validation, chosen by a hash of "
        "the document name (stable when the corpus grows)",
    )
    samples_per_shard: int = field(4096, doc="sequences per shard file")
    max_tokens: int | None = field(None, doc="stop after this many training tokens (None: the whole corpus)")
    num_workers: int = field(0, doc="tokenizer processes (0: one per CPU core, at most 8)")
    seed: int = field(
        0,
        doc="seed of the document order before packing (spreads sources across shards); source synthetic: "
        "the seed the documents are generated from",
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"prepare.val_fraction: {self.val_fraction} must be in [0, 1), e.g. 0.01")
        if self.samples_per_shard < 1:
            raise ConfigError("prepare.samples_per_shard: must be >= 1, e.g. 4096")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError("prepare.max_tokens: must be >= 1 or null for the whole corpus")
        if self.num_workers < 0:
            raise ConfigError("prepare.num_workers: must be >= 0 (0 = one per core)")
        if self.source == "files" and not self.inputs:
            raise ConfigError("prepare.inputs: source 'files' needs at least one file, directory or glob")
        if not self.output:
            raise ConfigError("prepare.output: give the directory to write shards into, e.g. cache/my-corpus")
        if (self.source == "synthetic") != (self.synthetic is not None):
            raise ConfigError(
                "prepare.synthetic: set it exactly when prepare.source is synthetic (e.g. synthetic: {task: chains})"
            )
        if self.source == "synthetic" and self.max_tokens is None:
            raise ConfigError("prepare.max_tokens: a synthetic source never ends; give the training tokens, e.g. 4e6")


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """A data recipe: shard format, tokenizer, the training mixture, the held-out stream, preparation."""

    format: ShardFormat = field(
        "mds",
        doc="mds: mosaicml-streaming MDS shards (random access); "
        "wds: WebDataset tar shards (sequential, shuffled in shard windows)",
    )
    seq_len: int = field(
        doc="tokens per training sequence; stored samples hold seq_len+1 tokens (inputs = [:-1], labels = [1:])"
    )
    tokenizer: TokenizerConfig = field(factory=TokenizerConfig, doc="tokenizer; must match the manifest's")
    streams: list[StreamConfig] = field(factory=list, doc="training streams, mixed by weight")
    validation: StreamConfig | None = field(None, doc="held-out stream for validation loss (split: val)")
    prepare: PrepareConfig | None = field(None, doc="how prepare-data builds the shards; None if prebuilt")
    shuffle_seed: int = field(0, doc="seed of the sample order (combined with the run seed)")
    on_bad_shard: Literal["error", "skip"] = field(
        "error",
        doc="error: stop with a message naming the shard; skip: leave a corrupt shard out with a counted warning",
    )
    verify: Literal["sha256", "size"] = field(
        "sha256",
        doc="check each shard once per process against the "
        "manifest: sha256 of the bytes, or only the file size (faster)",
    )
    wds_window: int = field(4, doc="wds only: shards shuffled together (memory: this many decoded shards)")
    prefetch: int = field(
        1,
        doc="training steps of batches read ahead in a background thread (pinned with CUDA) while the step "
        "runs; 0 reads on the training thread. Resume is unchanged: checkpoints hold the consumed position",
    )

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ConfigError(f"seq_len: {self.seq_len} must be >= 1, e.g. 128")
        if not self.streams:
            raise ConfigError("streams: empty; list at least one, e.g. streams: [{path: cache/stdlib-code}]")
        if self.wds_window < 1:
            raise ConfigError("wds_window: must be >= 1, e.g. 4")
        if self.prefetch < 0:
            raise ConfigError(f"prefetch: {self.prefetch} must be >= 0 (0: no read-ahead), e.g. 1")
        val = self.validation
        if val is not None and any(s.path == val.path and s.split == val.split for s in self.streams):
            raise ConfigError("validation.split: 'train' is also trained on; set validation.split: val")
        if self.prepare is not None and self.prepare.source == "synthetic" and self.tokenizer.kind != "byte":
            raise ConfigError(
                "tokenizer.kind: a synthetic source labels each byte with its difficulty; use tokenizer.kind: byte"
            )
