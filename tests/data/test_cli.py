"""The prepare-data command and the shipped recipes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from elastic_pretrain.cli import main
from elastic_pretrain.data.manifest import read_manifest
from elastic_pretrain.data.recipes import load_recipe, resolve_recipe
from tests.data.conftest import write_corpus

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((REPO / "data").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_recipe_builds(path: Path) -> None:
    cfg = load_recipe(str(path))
    assert cfg.streams and cfg.prepare is not None and cfg.validation is not None
    assert load_recipe(path.stem) == cfg  # preset name -> data/<name>.yaml


def test_prepare_data_command_with_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = write_corpus(tmp_path / "c", n_files=6)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "seq_len": 16,
                "streams": [{"path": str(tmp_path / "ds")}],
                "prepare": {
                    "source": "files",
                    "inputs": [str(corpus)],
                    "output": str(tmp_path / "ds"),
                    "val_fraction": 0.3,
                },
            }
        )
    )
    assert main(["prepare-data", str(recipe), "format=wds", "prepare.samples_per_shard=8", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "wds shards" in out and "train:" in out and "val:" in out
    manifest = read_manifest(tmp_path / "ds")
    assert manifest.format == "wds" and all(s.samples == 8 for s in manifest.splits["train"].shards[:-1])


def test_prepare_data_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prepare-data", "no-such-recipe"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no data recipe 'no-such-recipe'" in err and "stdlib-code" in err
    assert main(["prepare-data", "stdlib-code", "prepare.val_fraction=1.5"]) == 2
    assert "prepare.val_fraction: 1.5 must be in [0, 1)" in capsys.readouterr().err
    assert main(["prepare-data", "stdlib-code", "prepare.inputz=[x]"]) == 2
    assert "did you mean 'prepare.inputs'" in capsys.readouterr().err
    assert resolve_recipe("stdlib-code") == REPO / "data" / "stdlib-code.yaml"
