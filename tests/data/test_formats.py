"""Other inputs, tokenizers and formats: JSONL/Parquet, HF tokenizer.json, tiktoken, WebDataset,
weighted mixtures and cached "remote" streams — each written to disk and read back for real."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from elastic_pretrain.config import build
from elastic_pretrain.data.config import DataConfig, TokenizerConfig
from elastic_pretrain.data.loader import TokenBatches
from elastic_pretrain.data.order import mixture_counts
from elastic_pretrain.data.prepare import prepare_data
from elastic_pretrain.data.shards import SplitReader
from elastic_pretrain.data.tokenizer import HFTokenizer, TiktokenTokenizer, load_tokenizer
from tests.data.conftest import WORDS, recipe, write_corpus, write_ranks


def _all_rows(cfg: DataConfig, index: int = 0) -> np.ndarray:
    reader = SplitReader(cfg, cfg.streams[index], load_tokenizer(cfg.tokenizer))
    return np.stack([reader.get(i) for i in range(len(reader))])


def _texts(n: int = 40) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(10, 120)))) for _ in range(n)]


def test_jsonl_and_parquet_inputs_give_the_same_rows_as_text(tmp_path: Path) -> None:
    texts = _texts()
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    pq.write_table(pa.table({"body": texts, "id": list(range(len(texts)))}), tmp_path / "docs.parquet")
    over = {"prepare": {"text_field": "body", "val_fraction": 0.0}, "validation": None}
    rows = {}
    for kind in ("jsonl", "parquet"):
        cfg = recipe(tmp_path / f"out-{kind}", [str(tmp_path / f"docs.{kind}")], **over)
        m = prepare_data(cfg, progress=False)
        assert m.splits["train"].documents == len(texts)
        rows[kind] = _all_rows(cfg)
    stream = np.concatenate([[*t.encode(), 256] for t in texts])
    np.testing.assert_array_equal(rows["jsonl"].reshape(-1), stream[: rows["jsonl"].size])
    np.testing.assert_array_equal(rows["parquet"], rows["jsonl"])


def _tiny_bpe(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_texts(200), trainer)
    tok.save(str(path))
    return path


def test_hf_tokenizer_round_trip_fingerprint_and_parallel_prepare(tmp_path: Path) -> None:
    path = _tiny_bpe(tmp_path / "tokenizer.json")
    tok = HFTokenizer(str(path))
    text = "alpha größe 東京 omega"
    assert tok.decode(tok.encode(text)) == text and tok.vocab_size == 320
    assert tok.eos_id == tok._tok.token_to_id("<|endoftext|>")
    assert tok.fingerprint == HFTokenizer(str(path)).fingerprint != load_tokenizer(TokenizerConfig()).fingerprint
    corpus = write_corpus(tmp_path / "c", n_files=12)
    tcfg = {"kind": "hf", "path": str(path)}
    one = recipe(tmp_path / "one", [str(corpus)], tokenizer=tcfg, prepare={"num_workers": 1})
    two = recipe(tmp_path / "two", [str(corpus)], tokenizer=tcfg, prepare={"num_workers": 2})
    m1, m2 = prepare_data(one, progress=False), prepare_data(two, progress=False)
    assert m1.tokenizer["fingerprint"] == tok.fingerprint and m1.dtype == "uint16"
    assert [s.sha256 for s in m1.splits["train"].shards] == [s.sha256 for s in m2.splits["train"].shards]
    rows = _all_rows(one)
    assert rows.max() < 320 and (rows == tok.eos_id).any()


def test_tiktoken_ranks_file(tmp_path: Path) -> None:
    path = write_ranks(tmp_path / "tiny.tiktoken")
    tok = TiktokenTokenizer(build(TokenizerConfig, {"kind": "tiktoken", "path": str(path)}))
    assert tok.encode("alpha") == [258, ord("a")] and tok.decode(tok.encode("alpha größe")) == "alpha größe"
    assert (tok.eos_id, tok.vocab_size) == (259, 260)
    assert tok.encode("<|endoftext|>") != [tok.eos_id]  # text cannot inject a document separator
    corpus = write_corpus(tmp_path / "c", n_files=6)
    cfg = recipe(tmp_path / "ds", [str(corpus)], tokenizer={"kind": "tiktoken", "path": str(path)})
    assert prepare_data(cfg, progress=False).tokenizer["fingerprint"] == tok.fingerprint


def test_wds_shards_hold_the_same_rows_as_mds(prepared_wds: DataConfig, prepared_mds: DataConfig) -> None:
    assert prepared_wds.prepare is not None
    assert sorted(p.name for p in (Path(prepared_wds.prepare.output) / "train").iterdir())[0] == "shard-000000.tar"
    np.testing.assert_array_equal(_all_rows(prepared_wds), _all_rows(prepared_mds))


def test_wds_members_hold_blocks_of_rows_within_shards(
    tmp_path: Path, prepared_mds: DataConfig, corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tarfile

    from elastic_pretrain.data import shards

    monkeypatch.setattr(shards, "WDS_MEMBER_TOKENS", 5 * 17)  # 5 rows per member, 32 rows per shard
    cfg = recipe(tmp_path / "ds", [str(corpus)], format="wds")
    m = prepare_data(cfg, progress=False)
    first = Path(cfg.streams[0].path) / "train" / m.splits["train"].shards[0].name
    with tarfile.open(first) as tar:
        assert [n.split(".")[0] for n in tar.getnames()] == [f"{k:010d}" for k in (0, 5, 10, 15, 20, 25, 30)]
    np.testing.assert_array_equal(_all_rows(cfg), _all_rows(prepared_mds))


def _batches(cfg: DataConfig, dp: int, rank: int) -> TokenBatches:
    return TokenBatches(cfg, micro_batch_size=4 // dp, num_micro_batches=3, dp_rank=rank, dp_size=dp, seed=3)


def _run(cfg: DataConfig, plan: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Global batches of ``steps`` steps at each DP size in turn, handing the state over between them."""
    out, state = [], None
    for dp, steps in plan:
        ranks = [_batches(cfg, dp, r) for r in range(dp)]
        for ld in ranks:
            if state is not None:
                ld.load_state_dict(json.loads(json.dumps(state)))
        out += [torch.cat([torch.cat(ld.next_step()) for ld in ranks]) for _ in range(steps)]
        state = ranks[0].state_dict()
    return out


@pytest.mark.parametrize("plan", [[(2, 3), (1, 3)], [(1, 3), (2, 3)]], ids=["dp2to1", "dp1to2"])
def test_wds_resume_is_exact_across_dp_sizes_and_epochs(prepared_wds: DataConfig, plan: list[tuple[int, int]]) -> None:
    n = len(_batches(prepared_wds, 1, 0).readers[0])
    steps = (n // 12) + 4  # cross an epoch boundary (12 = global batch)
    plan = [(plan[0][0], steps // 2), (plan[1][0], steps - steps // 2)]
    reference = _run(prepared_wds, [(1, steps)])
    assert all(torch.equal(a, b) for a, b in zip(_run(prepared_wds, plan), reference, strict=True))
    # one epoch visits every sequence exactly once; windows keep reads local
    _, index = _batches(prepared_wds, 1, 0).order(np.arange(n))
    assert sorted(index.tolist()) == list(range(n))


def test_weighted_mixture_is_exact_and_resumable(tmp_path: Path, prepared_mds: DataConfig) -> None:
    other = recipe(tmp_path / "other", [str(write_corpus(tmp_path / "c2", n_files=10, seed=5))])
    prepare_data(other, progress=False)
    streams = [{"path": prepared_mds.streams[0].path, "weight": 3.0}, {"path": other.streams[0].path, "weight": 1.0}]
    mix = build(DataConfig, {"seq_len": 16, "streams": streams})
    loader = _batches(mix, 1, 0)
    block = loader.order.block
    counts = mixture_counts([3.0, 1.0], block)
    assert counts == [3072, 1024]
    stream, local = loader.order.stream_positions(np.arange(3 * block))
    for s in range(2):  # every block gives each stream its share; each stream is read gap-free, in order
        assert all(np.bincount(stream[b * block : (b + 1) * block]).tolist() == counts for b in range(3))
        assert local[stream == s].tolist() == list(range(3 * counts[s]))
    # the small stream is oversampled: it wraps into its next epoch, a new permutation of all its sequences
    size = len(loader.readers[1])
    _, index = loader.order(np.arange(3 * block))
    seen = index[stream == 1]
    assert sorted(seen[:size].tolist()) == list(range(size)) == sorted(seen[size : 2 * size].tolist())
    assert seen[:size].tolist() != seen[size : 2 * size].tolist()
    reference = _run(mix, [(1, 6)])
    assert all(torch.equal(a, b) for a, b in zip(_run(mix, [(2, 2), (1, 2), (4, 2)]), reference))
    assert all(torch.equal(a, b) for a, b in zip(_run(mix, [(4, 3), (2, 3)]), reference))


@pytest.mark.parametrize("uri", ["plain", "file"])
def test_cached_remote_stream_reads_the_same_and_refetches_a_damaged_copy(
    tmp_path: Path, prepared_mds: DataConfig, uri: str
) -> None:
    assert prepared_mds.prepare is not None
    src = Path(prepared_mds.prepare.output)
    path = str(src) if uri == "plain" else f"file://{src}"
    cache = tmp_path / "cache"
    cfg = build(DataConfig, {"seq_len": 16, "streams": [{"path": path, "local": str(cache)}]})
    np.testing.assert_array_equal(_all_rows(cfg), _all_rows(prepared_mds))
    assert (cache / "manifest.json").is_file() and len(list((cache / "train").glob("shard.*.mds"))) >= 3
    victim = next((cache / "train").glob("shard.00001.mds"))
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    np.testing.assert_array_equal(_all_rows(cfg), _all_rows(prepared_mds))
    shutil.rmtree(cache)


def _read_sum(path: str, local: str) -> int:
    cfg = build(DataConfig, {"seq_len": 16, "streams": [{"path": path, "local": local}]})
    return int(_all_rows(cfg).sum())


def test_two_processes_share_one_cache(tmp_path: Path, prepared_mds: DataConfig) -> None:
    """Two ranks on one machine fill the same cache concurrently: same rows, each file once, no temp files."""
    import multiprocessing

    assert prepared_mds.prepare is not None
    src, cache = prepared_mds.prepare.output, str(tmp_path / "cache")
    # fork: streaming is already imported here, a spawned child would spend ~10 s importing it again
    with multiprocessing.get_context("fork").Pool(2) as pool:
        sums = pool.starmap(_read_sum, [(src, cache), (src, cache)])
    assert sums[0] == sums[1] == int(_all_rows(prepared_mds).sum())
    leftovers = [p.name for p in (tmp_path / "cache").rglob("*") if p.name.endswith(".tmp")]
    assert not leftovers
    cached = sorted(p.name for p in (tmp_path / "cache" / "train").glob("shard.*"))
    assert cached == sorted(p.name for p in (Path(src) / "train").glob("shard.*"))
