"""The depth-pays corpus (issue 32): a deterministic generator whose per-token difficulty a reference solver
recomputes from the text, packed by prepare-data beside the tokens, read back for evaluation only, and
refused in one line when it does not match the tokens."""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from elastic_pretrain.config import ConfigError, build
from elastic_pretrain.data.config import DataConfig, SyntheticConfig
from elastic_pretrain.data.synthetic import (
    difficulty,
    documents,
    make_document,
    solve_line,
    token_difficulty,
)
from elastic_pretrain.errors import UserError

SEQ = 64


def recipe(out: Path, format: str = "mds", **synthetic: Any) -> DataConfig:
    """A small synthetic recipe: seq_len 64, 8-row shards (several difficulty files per split)."""
    return build(DataConfig, {
        "format": format,
        "seq_len": SEQ,
        "streams": [{"path": str(out)}],
        "validation": {"path": str(out), "split": "val"},
        "prepare": {"source": "synthetic", "output": str(out), "seed": 7, "max_tokens": 40 * (SEQ + 1),
                    "val_fraction": 0.2, "samples_per_shard": 8,
                    "synthetic": {"max_variables": 6, "max_depth": 5, **synthetic}},
    })  # fmt: skip


@pytest.mark.parametrize(("names", "queries"), [("random", "all"), ("alphabetical", "all"), ("alphabetical", "leaves")])
def test_same_seed_same_bytes_and_every_label_matches_the_generators_account(names: str, queries: str) -> None:
    cfg = SyntheticConfig(names=names, assign="=" if names == "random" else "", queries=queries)  # type: ignore[arg-type]
    first = [t for _, t in zip(range(200), documents(cfg, seed=3, chars=128))]
    assert first == [t for _, t in zip(range(200), documents(cfg, seed=3, chars=128))]
    assert first != [t for _, t in zip(range(200), documents(cfg, seed=4, chars=128))]
    assert {len(t[1]) for t in first} == {128}
    seen: collections.Counter[int] = collections.Counter()
    for i in range(200):  # the generator's own account of every query against the solver's labels
        text, lines = make_document(random.Random(f"3/{i}"), cfg, 128)
        assert text == first[i][1]
        want = np.zeros(len(text), dtype=np.uint8)
        start = 0
        for line in lines:
            queries = line.text.index(";") + 1
            for q in range(queries, len(line.text) - 1, 3):
                name, answer = line.text[q + 1], line.text[q + 2]
                assert answer == line.value[name]
                want[start + q + 2] = line.hops[name]
                assert line.hops[name] <= line.depth[name]
            if queries == "leaves":  # only the chains' last variables (no definition uses them), each a whole chase
                sources = {d[-1] for d in line.text[: line.text.index(";")].split(",")}
                assert set(line.hops) == set(line.value) - sources
                assert all(line.hops[v] == line.depth[v] for v in line.hops)
            start += len(line.text)
        got = difficulty(text, cfg.assign)
        np.testing.assert_array_equal(got, want)
        seen.update(got[got > 0].tolist())
    assert sorted(seen) == list(range(1, cfg.max_depth + 1))  # every difficulty 1..max_depth occurs


def test_the_solver_counts_lookups_to_the_first_value_in_view_and_refuses_a_wrong_answer() -> None:
    # c -> b -> a -> 4: three lookups; asked after b was answered, c needs one to b and one to b's answer
    assert solve_line("a4,ba,cb;?c4?b4?a4") == [(11, 3), (14, 2), (17, 1)]
    assert solve_line("a4,ba,cb;?b4?c4") == [(11, 2), (14, 2)]
    # asked after its child, an ancestor is two lookups away however deep: c -> d ('dc'), then d's answer
    assert solve_line("a4,ba,cb,dc;?d4?c4?b4?a4") == [(14, 4), (17, 2), (20, 2), (23, 1)]
    assert solve_line("a7,ba,c3,dc,ed,fb;?f7?e3?d3?c3?b7?a7") == [(20, 3), (23, 3), (26, 2), (29, 1), (32, 2), (35, 1)]
    assert solve_line("a=4,b=a;?b4", "=") == [(10, 2)]
    for bad, why in (("a4,ba;?b5", "answers '5'"), ("a4,bc;?b4", "before it is defined"), ("a4,ba", "no ';'"),
                     ("a4,a5;?a4", "defined once"), ("a4;?z4", "defined name")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            solve_line(bad)
    with pytest.raises(UserError, match=r"line 'a4;\?a5' is not a chains line"):
        difficulty("a4;?a5\n")


def test_config_refuses_what_it_cannot_generate() -> None:
    with pytest.raises(ConfigError, match="max_tokens: a synthetic source never ends"):
        build(DataConfig, {"seq_len": 8, "streams": [{"path": "x"}],
                           "prepare": {"source": "synthetic", "output": "x", "synthetic": {}}})  # fmt: skip
    with pytest.raises(ConfigError, match="a synthetic source labels each byte"):
        build(
            DataConfig,
            {
                "seq_len": 8,
                "streams": [{"path": "x"}],
                "tokenizer": {"kind": "tiktoken", "name": "gpt2"},
                "prepare": {"source": "synthetic", "output": "x", "max_tokens": 99, "synthetic": {}},
            },
        )
    with pytest.raises(ConfigError, match="set it exactly when prepare"):
        build(DataConfig, {"seq_len": 8, "streams": [{"path": "x"}], "prepare": {"output": "x", "synthetic": {}}})
    with pytest.raises(ConfigError, match="max_depth"):
        SyntheticConfig(max_depth=2, chains=2, min_variables=5)
    with pytest.raises(ConfigError, match="assign"):
        SyntheticConfig(assign=",")
    with pytest.raises(ConfigError, match="whole lines"):
        next(documents(SyntheticConfig(), seed=0, chars=20))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> DataConfig:
    from elastic_pretrain.data.prepare import prepare_data

    cfg = recipe(tmp_path_factory.mktemp("synthetic") / "ds")
    prepare_data(cfg, progress=False)
    return cfg


def test_difficulty_round_trips_through_prepare_data_shards_and_the_loader(prepared: DataConfig) -> None:
    from elastic_pretrain.data.difficulty import load_difficulty
    from elastic_pretrain.data.loader import TokenBatches, load_validation
    from elastic_pretrain.data.manifest import read_manifest
    from elastic_pretrain.data.prepare import prepare_data

    assert prepared.prepare is not None
    out = Path(prepared.prepare.output)
    manifest = read_manifest(out)
    for split, info in manifest.splits.items():
        assert info.difficulty is not None and len(info.difficulty) > 1, split
        assert [s.samples for s in info.difficulty] == [s.samples for s in info.shards]
    n = manifest.splits["val"].sequences
    tokens, labels = load_validation(prepared, num_sequences=n), load_difficulty(prepared, num_sequences=n)
    assert labels is not None and labels.shape == tokens.shape == (n, SEQ + 1)
    for row, lab in zip(tokens.numpy(), labels.numpy()):  # a row is one document + EOS: its labels, recomputed
        assert row[-1] == 256
        np.testing.assert_array_equal(lab, token_difficulty(row, 256, ""))
    assert int((labels > 0).sum()) > n  # several answers per row
    # training reads only the tokens, in its own order; the train split's labels line up with its rows too
    batch = TokenBatches(prepared, micro_batch_size=4, num_micro_batches=1, dp_rank=0, dp_size=1, seed=0).next_step()
    assert batch[0].shape == (4, SEQ + 1)
    said: list[str] = []
    prepare_data(prepared, progress=False, say=said.append)
    assert said == [f"{out}: up to date with the recipe (generated from prepare.seed)"]


def test_webdataset_shards_carry_the_same_difficulty(prepared: DataConfig, tmp_path: Path) -> None:
    from elastic_pretrain.data.difficulty import load_difficulty
    from elastic_pretrain.data.loader import load_validation
    from elastic_pretrain.data.prepare import prepare_data

    wds = recipe(tmp_path / "wds", format="wds")
    prepare_data(wds, progress=False)
    n = 10
    for got, want in ((load_validation(wds, num_sequences=n), load_validation(prepared, num_sequences=n)),
                      (load_difficulty(wds, num_sequences=n), load_difficulty(prepared, num_sequences=n))):  # fmt: skip
        assert got is not None and want is not None
        assert got.equal(want)


def _copy(cfg: DataConfig, to: Path) -> DataConfig:
    import shutil

    assert cfg.prepare is not None
    shutil.copytree(cfg.prepare.output, to)
    return build(DataConfig, {"seq_len": SEQ, "streams": [{"path": str(to)}],
                              "validation": {"path": str(to), "split": "val"}})  # fmt: skip


def _rewrite_manifest(root: Path, edit: Any) -> None:
    path = root / "manifest.json"
    obj = json.loads(path.read_text())
    edit(obj["splits"]["val"])
    path.write_text(json.dumps(obj))


def _replace_labels(root: Path, array: np.ndarray, allow_pickle: bool = False) -> None:
    """Swap val's first difficulty file for ``array`` and write the manifest's size and sha256 to match:
    the checks below must hold even against a matching checksum (docs/security.md)."""
    from elastic_pretrain.data.manifest import sha256_file

    path = root / "val" / "difficulty.00000.npy"
    np.save(path, array, allow_pickle=allow_pickle)

    def edit(split: dict[str, Any]) -> None:
        split["difficulty"][0].update(bytes=path.stat().st_size, sha256=sha256_file(path))

    _rewrite_manifest(root, edit)


def test_corrupt_or_mismatched_difficulty_is_refused_in_one_line(prepared: DataConfig, tmp_path: Path) -> None:
    from elastic_pretrain.data.difficulty import load_difficulty

    rows = 8  # the first difficulty file

    def refused(cfg: DataConfig, match: str) -> None:
        with pytest.raises(UserError, match=match) as err:
            load_difficulty(cfg, num_sequences=rows)
        assert "\n" not in str(err.value)

    cfg = _copy(prepared, tmp_path / "flip")
    path = tmp_path / "flip" / "val" / "difficulty.00000.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    refused(cfg, "difficulty file difficulty.00000.npy fails its sha256 checksum .*; delete it and re-run prepare-data")

    cfg = _copy(prepared, tmp_path / "fewer")
    _rewrite_manifest(tmp_path / "fewer", lambda s: s["difficulty"].pop())
    refused(cfg, r"the difficulty files hold \d+ rows in \d+ file\(s\), the token shards \d+ .* do not label these")

    cfg = _copy(prepared, tmp_path / "wide")
    _replace_labels(tmp_path / "wide", np.zeros((rows, SEQ + 2), np.uint8))
    refused(cfg, rf"holds uint8 \({rows}, {SEQ + 2}\), not uint8 rows of shape \({rows}, {SEQ + 1}\)")

    cfg = _copy(prepared, tmp_path / "dtype")
    _replace_labels(tmp_path / "dtype", np.zeros((rows, SEQ + 1), np.uint16))
    refused(cfg, "holds uint16")

    cfg = _copy(prepared, tmp_path / "pickle")
    pickled = np.array([f"{i:0100d}" for i in range(rows)], dtype=object)  # as many bytes as the rows it claims
    _replace_labels(tmp_path / "pickle", pickled, allow_pickle=True)
    refused(cfg, "cannot be read .*allow_pickle")

    cfg = _copy(prepared, tmp_path / "escape")
    _rewrite_manifest(tmp_path / "escape", lambda s: s["difficulty"][0].update(name="../../x.npy"))
    refused(cfg, r"malformed manifest \('../../x.npy' is not a plain file name")
