"""Hostile values inside checkpoints and run files (issue 35, items 7 and 8): each test writes the exact
input the red team shared — a ``trainer.json`` asking for a 17 GB model, ``[[[[…`` 100,000 deep, a
5,000-digit integer, ``data.position`` 10**30 or -5, ``adam_step`` 1e308, an empty controller, non-object
lines in ``history.jsonl``, a file where ``eval/`` goes, a pickle given to ``--decider`` — and checks that
the user gets one line naming the file and the fix (exit code 2), before anything is allocated or built,
and that the good input next to it still works.

As in ``test_checkpoint_inputs.py``, a tampered checkpoint is re-recorded in ``COMMITTED``: its author
can always write matching checksums."""

from __future__ import annotations

import ast
import json
import logging
import math
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from elastic_pretrain import cli
from elastic_pretrain.checkpoint.store import CheckpointStore, read_trainer_state, verify
from elastic_pretrain.errors import UserError
from elastic_pretrain.job import public_dict
from elastic_pretrain.job_loader import load_job
from tests.conftest import REPO
from tests.security.test_checkpoint_inputs import QUICK, one_line_error, recommit, run_cli

DEEP = "[" * 100_000 + "]" * 100_000  # RecursionError in json's C decoder (and far past PyYAML's composer)
MAX_COUNT = 2**53  # jsonsafe.MAX_COUNT: the largest step, token or sample count a checkpoint may hold
DIGITS = "9" * 5000  # int() refuses more than 4,300 digits with a ValueError that suggests a sys setting


def tiny_job(tmp_path: Path) -> Any:
    return load_job(REPO / "jobs" / "tiny-cpu.yaml", ["parallel=single", "tracking.backend=none"],
                    values={"run_dir": str(tmp_path / "run")})  # fmt: skip


def commit_step(
    root: Path, step: int, trainer: str | dict[str, Any], write: Callable[[Path], object] | None = None
) -> Path:
    """A committed ``<root>/checkpoints/step_<step>`` holding ``trainer`` as trainer.json (``write``: more files)."""
    store = CheckpointStore(root / "checkpoints")
    tmp = store.prepare(step)
    (tmp / "trainer.json").write_text(trainer if isinstance(trainer, str) else json.dumps(trainer))
    if write is not None:
        write(tmp)
    return store.commit(step, {})


def one_line(err: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(err.value)
    assert "\n" not in text and len(text) < 600, text
    return text


# ------------------------------------------------------------------ item 8a/b: JSON and YAML parsing
@pytest.mark.parametrize("text, words", [(DEEP, "nested deeper than 64 levels"),
                                         ('{"trainer": {"step": ' + DIGITS + "}}", "more than 4,300 digits"),
                                         ('{"trainer": ', "not valid JSON"),
                                         (b"\xff\xfe{}", "not UTF-8")])  # fmt: skip
def test_unparseable_trainer_json_is_one_line(tmp_path: Path, text: str | bytes, words: str) -> None:
    ckpt = commit_step(tmp_path, 2, "{}")
    (ckpt / "trainer.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserError) as err:
        read_trainer_state(ckpt)
    line = one_line(err)
    assert str(ckpt / "trainer.json") in line and words in line and "use another copy" not in line
    assert "set_int_max_str_digits" not in line  # Python's advice is no fix for a file someone sent


def test_deep_nesting_that_json_decodes_is_refused_too(tmp_path: Path) -> None:
    """300 levels decode (below the recursion limit), then break our own recursive walkers or the next
    save's ``json.dumps``: the bound is the parser's, not the interpreter's."""
    ckpt = commit_step(tmp_path, 2, '{"config": ' + "[" * 300 + "]" * 300 + "}")
    with pytest.raises(UserError, match="nested deeper than 64 levels"):
        read_trainer_state(ckpt)


def test_deep_commit_marker_is_skipped_by_the_listing_and_refused_by_verify(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = commit_step(tmp_path, 2, "{}")
    good = commit_step(tmp_path, 1, "{}")
    (ckpt / "COMMITTED").write_text(DEEP)
    with caplog.at_level(logging.WARNING):
        assert [c.path for c in CheckpointStore(tmp_path / "checkpoints").committed()] == [good]
    assert "nested deeper" in caplog.text
    with pytest.raises(UserError) as err:
        verify(ckpt)
    assert "COMMITTED: nested deeper than 64 levels" in one_line(err)


def test_deep_json_in_a_manifest_an_index_a_run_json_and_a_corpus_line(tmp_path: Path) -> None:
    from elastic_pretrain.data.manifest import read_manifest
    from elastic_pretrain.data.shards import check_mds_index
    from elastic_pretrain.data.sources import _jsonl
    from elastic_pretrain.tracking.commands import _run_info
    from elastic_pretrain.tracking.config import local_store_dir

    (tmp_path / "manifest.json").write_text(DEEP)
    with pytest.raises(UserError) as err:
        read_manifest(tmp_path)
    assert "malformed manifest: nested deeper" in one_line(err) and "run prepare-data again" in one_line(err)
    with pytest.raises(UserError) as err:
        check_mds_index(DEEP.encode(), None, [], "cache/x [train]")  # type: ignore[arg-type]
    assert "index.json: nested deeper" in one_line(err) and "re-run prepare-data" in one_line(err)
    (tmp_path / "corpus.jsonl").write_text('{"text": "fine"}\n' + DEEP + "\n")
    with pytest.raises(UserError) as err:
        list(_jsonl(tmp_path / "corpus.jsonl", "corpus", "text"))
    assert "corpus.jsonl:2: nested deeper" in one_line(err) and "fix or drop the line" in one_line(err)
    run = tmp_path / "run"
    local_store_dir(run).mkdir(parents=True)
    (local_store_dir(run) / "run.json").write_text(DEEP)  # unreadable: nothing recorded, as without one
    assert _run_info(run) == {}


def test_deep_yaml_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A job file, an override, and nesting built from aliases (each alias adds the depth of its anchor:
    30 anchors of 40 levels walk 1,200 deep in the expansion check, though the text nests 40)."""
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: " + "[" * 5000 + "]" * 5000 + "\n")
    chained = tmp_path / "chained.yaml"
    anchors = ["a0: &a0 " + "[" * 40 + "1" + "]" * 40]
    anchors += [f"a{i}: &a{i} " + "[" * 39 + f"*a{i - 1}" + "]" * 39 for i in range(1, 30)]
    chained.write_text("\n".join(anchors) + "\n")
    job = str(REPO / "jobs" / "tiny-cpu.yaml")
    for argv in (["config", str(deep)], ["config", str(chained)], ["config", job, "model.loops=" + "[" * 5000]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "more than 64 levels deep" in err, err
    assert cli.main(["config", job, "train.steps=[[[[[[[[1]]]]]]]]"]) == 2  # shallow: on to the usual type check
    assert "train.steps" in capsys.readouterr().err
    assert cli.main(["config", job]) == 0


def test_every_json_read_goes_through_the_bounded_parser() -> None:
    """``json.load(s)`` in the package only inside jsonsafe.py, and where the text is not from a file of others."""
    allowed = {
        "elastic_pretrain/jsonsafe.py": "the parser itself",
        "elastic_pretrain/data/shards.py": "index.json that MDSWriter just wrote (prepare-data's own output)",
        "elastic_pretrain/export/tasks/elastic_tiny_mc.py": "the package's own task data",
        "elastic_pretrain/files.py": "read_json_object (export folders, run roots): bounds size, catches "
        "RecursionError; to call jsonsafe.loads once files.py settles (issue 35)",
    }
    found = set()
    for path in sorted((REPO / "elastic_pretrain").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("load", "loads") and \
                    isinstance(node.value, ast.Name) and node.value.id == "json":  # fmt: skip
                found.add(str(path.relative_to(REPO)))
    assert found <= set(allowed), f"json.load(s) outside elastic_pretrain/jsonsafe.py: {sorted(found - set(allowed))}"


# ----------------------------------------------------------- item 8c: values of trainer.json's states
COUNTERS = {"trainer": {"step": 2, "tokens": 4096, "elapsed_s": 0.7, "train_flops": 9.5e9}, "adam_step": 2.0,
            "config": {}}  # fmt: skip
BAD_COUNTERS = {
    "adam_step 1e308": (("adam_step",), 1e308),
    "adam_step nan": (("adam_step",), math.nan),
    "adam_step inf": (("adam_step",), math.inf),
    "adam_step negative": (("adam_step",), -3),
    "adam_step fractional": (("adam_step",), 2.5),
    "step negative": (("trainer", "step"), -1),
    "tokens 10**30": (("trainer", "tokens"), 10**30),
    "elapsed nan": (("trainer", "elapsed_s"), math.nan),
}


@pytest.mark.parametrize("case", list(BAD_COUNTERS))
def test_counters_out_of_range_are_one_line(tmp_path: Path, case: str) -> None:
    keys, value = BAD_COUNTERS[case]
    meta = json.loads(json.dumps(COUNTERS))
    (meta[keys[0]] if len(keys) > 1 else meta)[keys[-1]] = value
    ckpt = commit_step(tmp_path, 2, meta)
    with pytest.raises(UserError) as err:
        read_trainer_state(ckpt, require=("trainer",))
    line = one_line(err)
    assert "trainer.json: malformed" in line and ".".join(keys) in line and "use another checkpoint" in line
    good = commit_step(tmp_path / "good", 2, COUNTERS)
    assert read_trainer_state(good)["adam_step"] == 2.0


BAD_CONTROLLERS = {
    "empty": ({}, "controller.phase is missing"),
    "not an object": ([], "controller is an array, not an object"),
    "unknown phase": ({"phase": "evil", "switch_step": None, "seed": 1}, "controller.phase is 'evil'"),
    "mixed without a switch": ({"phase": "mixed", "switch_step": None, "seed": 1}, "controller.switch_step is None"),
    "negative seed": ({"phase": "fixed", "switch_step": None, "seed": -1}, "controller.seed is -1"),
    "seed 10**30": ({"phase": "fixed", "switch_step": None, "seed": 10**30}, "controller.seed"),
    # the run's token horizon (issue 33: a larger train.steps keeps the switch point): a positive count
    "total_tokens 0": (
        {"phase": "fixed", "switch_step": None, "seed": 1, "total_tokens": 0},
        "controller.total_tokens is 0",
    ),
    "total_tokens 10**30": (
        {"phase": "fixed", "switch_step": None, "seed": 1, "total_tokens": 10**30},
        "controller.total_tokens",
    ),
    "total_tokens a string": (
        {"phase": "fixed", "switch_step": None, "seed": 1, "total_tokens": "300"},
        "controller.total_tokens",
    ),
    "total_tokens null": (
        {"phase": "fixed", "switch_step": None, "seed": 1, "total_tokens": None},
        "controller.total_tokens is None",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CONTROLLERS))
def test_controller_states_out_of_range(case: str) -> None:
    from elastic_pretrain.schedule import ScheduleConfig, ScheduleController

    state, words = BAD_CONTROLLERS[case]
    ctl = ScheduleController(ScheduleConfig(), max_loops=4, total_tokens=1000, seed=7)
    with pytest.raises(UserError) as err:
        ctl.load_state_dict(state)
    assert words in one_line(err)
    assert (ctl.phase, ctl.total_tokens) == ("fixed", 1000)  # nothing taken from the refused state
    ctl.load_state_dict({"phase": "mixed", "switch_step": 5, "seed": 9, "total_tokens": 800})  # as it writes
    assert (ctl.phase, ctl.switch_step, ctl.seed, ctl.total_tokens) == ("mixed", 5, 9, 800)
    ctl.load_state_dict({"phase": "mixed", "switch_step": 5, "seed": 9})  # written before total_tokens was saved
    assert ctl.total_tokens == 800


def test_scheduler_and_fault_window_states(mesh1, tmp_path: Path) -> None:
    """megatron's scheduler takes the checkpoint's values over the job's and checks none of them."""
    from elastic_pretrain.parallel.megatron import build_model
    from elastic_pretrain.train.faults import FaultMonitor, SpikeDetector
    from elastic_pretrain.train.session import SchedulerState, build_optimizer, wrap_ddp

    job = tiny_job(tmp_path)
    _, scheduler = build_optimizer(job, wrap_ddp(job, build_model(job.model, job.parallel)))
    saved = scheduler.state_dict()
    state = SchedulerState(scheduler)
    for edit, words in (({}, "scheduler.max_lr is missing"), ({"num_steps": 1e308}, "scheduler.num_steps is 1e+308"),
                        ({"lr_decay_style": "evil"}, "scheduler.lr_decay_style is 'evil'"),
                        ({"max_lr": math.nan}, "scheduler.max_lr is nan"),
                        ({"min_lr": 1.0}, "scheduler.min_lr is 1.0, not a finite number in 0..0.003"),
                        ({"lr_decay_style": "WSD"}, "this job does not configure")):  # fmt: skip
        with pytest.raises(UserError) as err:
            state.load_state_dict({**saved, **edit} if edit else {})
        assert words in one_line(err)
    state.load_state_dict({**saved, "num_steps": 3})
    assert scheduler.num_steps == 3
    with pytest.raises(UserError, match=r"faults\.spike\.losses is 'x'"):
        SpikeDetector(4, 3.0, 0.1).load_state_dict({"losses": ["x"]})
    with pytest.raises(UserError, match=r"faults\.counts\.spike is -1"):
        FaultMonitor.check_state({"counts": {"spike": -1}})
    assert FaultMonitor.check_state({"spike": {"losses": [5.5]}, "counts": {"spike": 2}}) == {"spike": 2}


def test_data_position_out_of_range(tmp_path: Path) -> None:
    """10**30 overflowed int64 at the first batch (a traceback); -5 trained silently from the end of the order."""
    from elastic_pretrain.data.loader import TokenBatches

    proc = run_cli("prepare-data", "stdlib-code")
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = tiny_job(tmp_path)
    batches = TokenBatches(job.data, micro_batch_size=2, num_micro_batches=1, dp_rank=0, dp_size=1, seed=1)
    saved = batches.state_dict()
    for position in (10**30, -5, 2.5, "32"):
        with pytest.raises(UserError) as err:
            batches.load_state_dict({**saved, "position": position})
        assert "data.position is" in one_line(err) and f"not an integer in 0..{MAX_COUNT:,}" in one_line(err)
    with pytest.raises(UserError, match=r"data\.global_batch_size is 0"):
        batches.load_state_dict({**saved, "global_batch_size": 0})
    batches.load_state_dict({**saved, "position": 48})
    assert batches.position == 48


# ---------------------------------------------------------------- item 8d: history.jsonl
def test_history_lines_that_are_not_entries_are_skipped(
    mesh1, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A resumed run reads the earlier steps back; ``entry["step"]`` on a list was a TypeError traceback."""
    from elastic_pretrain.rundir import RunFiles
    from elastic_pretrain.train.trainer import SummaryWriter

    run = tmp_path / "run"
    run.mkdir()
    good = [{"step": 1, "loss": 5.0, "loss_by_loops": {"1": 5.0}}, {"step": 2, "loss": 4.5, "depth_efficiency": 0.9}]
    lines = [json.dumps(good[0]), "[1, 2]", '"a string"', "7", "null", '{"step": "2"}', '{"step": 10.5}',
             '{"step": 2, "depth_efficiency": "high"}', DEEP, '{"step": 2, "lo', json.dumps(good[1]),
             json.dumps({"step": 3, "loss": 4.0})]  # fmt: skip
    RunFiles(run).history.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        writer = SummaryWriter(run, mesh1, resumed_step=2)
    assert writer.history == good  # step 3 is after the checkpoint: trained again
    assert "skipped 9 line(s) that are not step entries" in caplog.text
    assert RunFiles(run).history.read_text().splitlines() == [json.dumps(g) for g in good]


# ---------------------------------------------------------- item 7: the model a checkpoint asks for
@pytest.fixture
def model_ckpt(mesh1, tmp_path: Path) -> Path:
    """A committed one-process checkpoint of the tiny job's model tensors (megatron dist_checkpointing)."""
    import torch
    from megatron.core import dist_checkpointing

    from elastic_pretrain.parallel.megatron import build_model

    job = tiny_job(tmp_path)
    torch.manual_seed(0)
    net = build_model(job.model, job.parallel)
    meta = {"trainer": {"step": 2, "tokens": 64, "elapsed_s": 1.0}, "config": public_dict(job)}
    return commit_step(
        tmp_path / "run", 2, meta, lambda tmp: dist_checkpointing.save({"model": net.sharded_state_dict()},
                                                                       str(tmp / "model_optim"))
    )  # fmt: skip


def _never_built(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was built before the checkpoint's sizes were checked")

    monkeypatch.setattr("elastic_pretrain.parallel.megatron.build_model", refuse)


def _edit_config(ckpt: Path, **model: Any) -> None:
    meta = json.loads((ckpt / "trainer.json").read_text())
    meta["config"]["model"].update(model)
    (ckpt / "trainer.json").write_text(json.dumps(meta))
    recommit(ckpt)


def test_a_17_gb_model_in_trainer_json_is_refused_before_it_is_built(
    model_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastic_pretrain.engine.restore import load_model

    _, net = load_model(model_ckpt)  # the good checkpoint loads
    assert sum(p.numel() for p in net.parameters()) == 675_360
    _edit_config(model_ckpt, hidden_size=65536, ffn_hidden_size=262144)
    _never_built(monkeypatch)
    with pytest.raises(UserError) as err:
        load_model(model_ckpt)
    line = one_line(err)
    assert "trainer.json: its model config (hidden_size=65536" in line and "builds 210.66 B parameters" in line
    assert "tensors hold 675.36 K: the config does not describe these tensors" in line


def test_metadata_sizes_beyond_the_data_files_are_refused(model_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The config and ``.metadata`` agree on a 10**8-row vocabulary (~39 GB at fp32): the data files hold 8 MB."""
    import dataclasses

    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from elastic_pretrain.engine.restore import load_model

    path = model_ckpt / "model_optim"
    meta = FileSystemReader(str(path)).read_metadata()  # our own checkpoint's
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        md = meta.state_dict_metadata[key]
        rows = torch.Size([10**8, md.size[1]])
        chunk = dataclasses.replace(md.chunks[0], sizes=rows)
        meta.state_dict_metadata[key] = dataclasses.replace(md, size=rows, chunks=[chunk])
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    _edit_config(model_ckpt, vocab_size=10**8)
    _never_built(monkeypatch)
    with pytest.raises(UserError) as err:
        load_model(model_ckpt)
    assert re.search(
        r"declares 76,80\d,\d{3},\d{3} bytes of tensors, but its data files hold 2,\d{3},\d{3} bytes", one_line(err)
    )

    item, info = next(iter(meta.storage_data.items()))  # and an item placed past the end of its file
    meta.storage_data[item] = dataclasses.replace(info, offset=(path / info.relative_path).stat().st_size)
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    recommit(model_ckpt)
    with pytest.raises(UserError, match=r"\.metadata: cannot load \(ValueError: places \d+ bytes at"):
        load_model(model_ckpt)


def test_a_deepspeed_checkpoint_is_bounded_by_its_files(tmp_path: Path) -> None:
    """No metadata to compare: 2 bytes (bf16) per parameter must be in ``model_optim/``."""
    from elastic_pretrain.checkpoint.tensors import check_model_fits

    job = tiny_job(tmp_path)
    meta = {"trainer": {"step": 2, "tokens": 64, "elapsed_s": 1.0}, "config": public_dict(job)}
    ckpt = commit_step(
        tmp_path / "ds",
        2,
        meta,
        lambda tmp: (tmp / "model_optim" / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 2_000_000),
    )
    check_model_fits(ckpt, job.model)  # 675 K parameters: 1.35 MB at bf16
    big = load_job(REPO / "jobs" / "tiny-cpu.yaml", ["parallel=single", "model.hidden_size=192"]).model
    with pytest.raises(UserError, match=r"builds 1\.81 M parameters, but the checkpoint's tensors hold 1\.00 M"):
        check_model_fits(ckpt, big)


# ------------------------------------------------------------------------ item 8f: --decider files
def test_decider_files(tmp_path: Path) -> None:
    import torch

    from elastic_pretrain.model.decider import DeciderConfig, IterationDecider, load_decider, save_decider

    class RunsCommand:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return shutil.rmtree, (str(tmp_path / "victim"),)

    (tmp_path / "victim").mkdir()
    evil = tmp_path / "evil.pt"
    evil.write_bytes(pickle.dumps(RunsCommand(), protocol=4))
    with pytest.raises(UserError) as err:
        load_decider(evil)
    assert "evil.pt: not a decider file (weights-only read refused it: " in one_line(err)
    assert "nothing in it runs: give a file written by save_decider" in one_line(err)
    assert (tmp_path / "victim").is_dir()

    good = tmp_path / "decider.pt"
    save_decider(good, IterationDecider(DeciderConfig(), hidden_size=96, max_loops=4))
    assert load_decider(good, hidden_size=96, max_loops=4).max_loops == 4
    with pytest.raises(UserError, match=r"not a decider file of this model \(made for hidden_size 96, the model has"):
        load_decider(good, hidden_size=64, max_loops=4)
    blob = torch.load(good, weights_only=True)
    blob["config"]["hidden_size"] = 10**7  # a head of 2 GB over the file's 64-wide tensors: refused unbuilt
    torch.save(blob, good)
    with pytest.raises(UserError, match=r"fc1\.weight is not a \(10000000, 192\) tensor"):
        load_decider(good, hidden_size=96, max_loops=4)
    for junk in (b"", b"not a torch file", b"PK\x03\x04"):
        good.write_bytes(junk)
        with pytest.raises(UserError, match=r"decider\.pt: not a decider file"):
            load_decider(good)


def test_eval_folder_that_is_a_file(tmp_path: Path) -> None:
    """Before: the evaluation ran, then ``mkdir`` of the report folder ended it in a FileExistsError traceback.
    Now one line before anything is loaded, and the file is left alone."""
    from elastic_pretrain.eval.commands import report_dir, run_dir_of

    job = tiny_job(tmp_path)
    ckpt = commit_step(tmp_path / "run", 2, {"trainer": {"step": 2, "tokens": 64, "elapsed_s": 1.0},
                                             "config": public_dict(job)})  # fmt: skip
    (tmp_path / "run" / "config.yaml").write_text("name: tiny-cpu\n")  # a run directory: its report goes beside
    folder = report_dir(ckpt, run_dir_of(ckpt))[0].parent  # <run>/eval
    folder.write_text("someone's notes\n")
    proc = run_cli("eval", str(ckpt), "--data", "stdlib-code", "--sequences", "2", "--no-track")
    one_line_error(proc, f"{folder}: is a regular file, not a directory", "delete it")
    assert folder.read_text() == "someone's notes\n"


# ------------------------------------------------------ end to end: the commands a user runs (slow)
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real committed checkpoint: the tiny job, two steps, one process."""
    proc = run_cli("prepare-data", "stdlib-code")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path_factory.mktemp("trained") / "tiny"
    proc = run_cli("train", "jobs/tiny-cpu.yaml", "--run-dir", str(run), *QUICK[:1], "train.steps=2", *QUICK[2:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run / "checkpoints" / "step_2"


RESUME_CASES = {
    "position 10**30": (("data", "position"), 10**30, "data.position is 1000000000000000000000000000000"),
    "position -5": (("data", "position"), -5, "data.position is -5"),
    "adam_step 1e308": (("adam_step",), 1e308, "malformed (adam_step is 1e+308"),
    "empty controller": (("controller",), {}, "controller.phase is missing"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_from_a_checkpoint_with_states_out_of_range(trained: Path, tmp_path: Path, case: str) -> None:
    """Before: an int64 overflow at the first batch, 2 steps trained from the end of the data order, a float32
    overflow filling Adam's step, a KeyError — after the model was built. Now one line, before building."""
    keys, value, words = RESUME_CASES[case]
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    shutil.copytree(trained, ckpt)
    meta = json.loads((ckpt / "trainer.json").read_text())
    (meta[keys[0]] if len(keys) > 1 else meta)[keys[-1]] = value
    (ckpt / "trainer.json").write_text(json.dumps(meta))
    recommit(ckpt)
    proc = run_cli("train", "jobs/tiny-cpu.yaml", "--run-dir", str(tmp_path / "other"), "--resume-from", str(ckpt),
                   *QUICK)  # fmt: skip
    line = one_line_error(proc, "trainer.json", words, "use another checkpoint")
    assert "resumed from" not in proc.stdout, line
