"""The docs name only things that exist: files of the repository, pytest markers, tests, config options.

Every ``docs/**/*.md`` and ``README.md`` is read; each check looks only at what is unambiguous:

* **paths** — a backticked or linked path that starts with a folder of the repository (``tests/``,
  ``elastic_pretrain/``, ``docs/`` …) or is a root file, without placeholders or globs, must exist;
* **markers** — ``pytest.mark.<m>`` / ``-m <m>`` / ``@<m>``-style markers must be registered in
  ``pyproject.toml`` (or be pytest's own);
* **tests** — ``tests/<file>.py::test_<name>`` and a backticked ``test_<name>`` must be a test
  function (or test file) in ``tests/``;
* **options** — a backticked ``section.key[.key…]`` whose section is one of the job's sections
  (``model``, ``train``, ``checkpoint`` …) must be a field of that section's config dataclass.

``docs/results/`` reports past experiments: their paths and options are what existed then; only the
tests and markers they name are checked (``HISTORIC``). Anything else that must be left unchecked is
allow-listed below with the reason.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path

import pytest

from elastic_pretrain.job import JobConfig

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
HISTORIC = REPO / "docs" / "results"  # reports of past runs: paths/options as they were
ROOTS = ("elastic_pretrain", "tests", "docs", "jobs", "data", "parallel", "slurm", "scripts", "bench", "requirements")
ROOT_FILES = ("pyproject.toml", "README.md", "CHANGELOG.md", "AGENTS.md")
BUILTIN_MARKERS = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings", "timeout"}
# "<doc>: <text>" -> why it is not checked
ALLOWED: dict[str, str] = {
    "docs/evaluation.md: model.rotary_pos_emb": "megatron's module attribute (the model object), not a config key",
    "docs/tracking.md: slurm.job_id": "an MLflow tag name (tracking/tracker.py), not a config key",
    "docs/tracking.md: slurm.nodelist": "an MLflow tag name (tracking/tracker.py), not a config key",
    "docs/data.md: ../x": "a hostile manifest shard name quoted as an example (refused), not a link",
    "docs/export.md: model.safetensors": "a file of an export folder (docs/export.md), not a config key",
    "docs/export.md: model.generate": "transformers' generate method of the loaded model, not a config key",
    "docs/security.md: model.safetensors": "a file of an export folder (docs/export.md), not a config key",
    "docs/gpu.md: bench/.wheels/": "made by bench/gpu_deps.sh download (git-ignored), not shipped",
}
# paths inside a run directory that share a name with a repository folder -> why
RUN_DIR_FILES = {
    "slurm/job.yaml": "<run_dir>/slurm/job.yaml, the job as submitted (rundir.py RunFiles)",
    "slurm/job_id": "<run_dir>/slurm/job_id (rundir.py RunFiles)",
    "slurm/CANCELLED": "<run_dir>/slurm/CANCELLED (rundir.py RunFiles)",
    "slurm/train.sbatch": "<run_dir>/slurm/train.sbatch, the rendered script (the template is slurm/train.sbatch)",
}

_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s#]+)")
_PLACEHOLDER = re.compile(r"[<>*?{}$…\[\]]|\.\.\.")


def _doc_id(doc: Path) -> str:
    return doc.relative_to(REPO).as_posix()


def _texts(doc: Path) -> list[str]:
    """Backticked spans and link targets of a doc (the places where it names things exactly)."""
    text = doc.read_text()
    return _CODE.findall(text) + _LINK.findall(text)


def _words(span: str) -> list[str]:
    return [w.strip("\"'(),;:") for w in span.split()]


# ------------------------------------------------------------------------------------------ paths
def _repo_path(word: str, doc: Path) -> Path | None:
    """The repository path ``word`` names, or None if it names none (placeholder, URL, run output)."""
    word = word.split("::")[0].rstrip(".,:;")
    if ".py:" in word:  # `files.py:write_atomic`: a function in a file
        word = word.split(".py:")[0] + ".py"
    if not word or "://" in word or _PLACEHOLDER.search(word) or "=" in word or word in RUN_DIR_FILES:
        return None
    if word.startswith(("./", "../")):  # a link relative to the doc
        target = (doc.parent / word).resolve()
        # outside the repository: a hostile name quoted as an example (docs/security.md), not a link
        return target if target.is_relative_to(REPO) else None
    head = word.split("/")[0]
    if (head in ROOTS and "/" in word) or word in ROOT_FILES:
        # `parallel/mesh.py` in a paragraph about the package: elastic_pretrain/parallel/mesh.py
        inside = REPO / "elastic_pretrain" / word
        return inside if not (REPO / word).exists() and inside.exists() else REPO / word
    return None


def named_paths() -> list[tuple[str, str, Path]]:
    found = []
    for doc in DOCS:
        if HISTORIC in doc.parents:
            continue
        for span in _texts(doc):
            for word in _words(span):
                path = _repo_path(word, doc)
                if path is not None:
                    found.append((_doc_id(doc), word, path))
    return found


# ---------------------------------------------------------------------------------------- markers
def registered_markers() -> set[str]:
    import tomllib

    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    return {m.split(":")[0].split("(")[0].strip() for m in cfg["tool"]["pytest"]["ini_options"]["markers"]}


# pytest.mark.<m>; `pytest … -m "<m>"`; "test marker `<m>`", "`<m>` test markers", "marked `<m>`"
# (a bare "`FINISHED` marker" is a marker file: not a pytest marker)
_MARKS = (
    re.compile(r"pytest\.mark\.(\w+)"),
    re.compile(r"pytest[^`\n]*?\s-m\s+[\"']?(?:not\s+)?(\w+)"),
    re.compile(r"\b(?:pytest|test)\s+marker\s+`(\w+)"),
    re.compile(r"`(\w+)`\s+(?:pytest\s+|test\s+)markers?\b"),
    re.compile(r"\bmarked\s+(?:as\s+)?`(\w+)`"),
)
# "`tests/x.py` marks … `<m>`": a claim about one test file, checked against that file
_MARK_CLAIM = re.compile(r"`(tests/[\w/]+\.py)`[^`.]*?\bmarks\b[^`.]*?`(\w+)")


def named_markers() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        found += [(_doc_id(doc), m.group(1)) for pattern in _MARKS for m in pattern.finditer(text)]
    return found


def marker_claims() -> list[tuple[str, str, str]]:
    """(doc, test file, marker) for every "`<test file>` marks … `<marker>`" in the docs."""
    found = []
    for doc in DOCS:
        text = " ".join(doc.read_text().split())  # a sentence may wrap
        found += [(_doc_id(doc), m.group(1), m.group(2)) for m in _MARK_CLAIM.finditer(text)]
    return found


# ------------------------------------------------------------------------------------------ tests
def known_tests() -> set[str]:
    names = set()
    for path in (REPO / "tests").rglob("*.py"):
        names.add(path.stem)
        names.update(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", path.read_text(), re.M))
    return names


_TEST = re.compile(r"(?<![\w/.])(test_\w+)(?![\w/])")


def named_tests() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for span in _texts(doc):
            for word in _words(span):
                base = word.split("::")[-1].split("[")[0]
                if "::" in word or _TEST.fullmatch(base.removesuffix(".py")):
                    name = base.removesuffix(".py").split("(")[0]
                    if name.startswith("test_"):
                        found.append((_doc_id(doc), name))
    return found


# ---------------------------------------------------------------------------------------- options
def _fields(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _unwrap(tp: object) -> object:
    """The dataclass (or dict) inside ``X | None`` / ``list[X]``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType, list, tuple):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        for a in inner:
            u = _unwrap(a)
            if dataclasses.is_dataclass(u) or typing.get_origin(u) is dict or u is dict:
                return u
        return inner[0] if inner else tp
    return tp


def option_exists(dotted: str) -> bool:
    tp: object = JobConfig
    for key in dotted.split("."):
        tp = _unwrap(tp)
        if typing.get_origin(tp) is dict or tp is dict:
            return True  # a mapping (slurm.env.*): any key
        if not dataclasses.is_dataclass(tp):
            return False  # a key below a plain value
        hints = _fields(tp)  # type: ignore[arg-type]
        if key not in hints:
            return False
        tp = hints[key]
    return True


SECTIONS = tuple(name for name, tp in _fields(JobConfig).items() if dataclasses.is_dataclass(_unwrap(tp)))
_OPTION = re.compile(rf"^(?:{'|'.join(SECTIONS)})(?:\.[a-z_][a-z0-9_]*)+$")
_FILE_SUFFIX = re.compile(r"\.(py|md|ya?ml|sh|json|jsonl|txt|toml|log|pt|png|csv|parquet|tar|mds)$")


def named_options() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        if HISTORIC in doc.parents:
            continue
        for span in _CODE.findall(doc.read_text()):
            for word in _words(span):
                key = re.split(r"[=:\[(]", word, maxsplit=1)[0].rstrip(".")
                if _OPTION.match(key) and not _FILE_SUFFIX.search(key):
                    found.append((_doc_id(doc), key))
    return found


# ------------------------------------------------------------------------------------------ tests
def _missing(items: list[tuple[str, str]], ok: typing.Callable[[str], bool]) -> list[str]:
    return sorted({f"{doc}: {text}" for doc, text in items if not ok(text) and f"{doc}: {text}" not in ALLOWED})


def test_named_paths_exist() -> None:
    paths = named_paths()
    assert len(paths) > 50  # the scan sees the docs' paths at all
    missing = sorted({f"{doc}: {word}" for doc, word, path in paths if not path.exists()} - set(ALLOWED))
    assert missing == [], "docs name files that do not exist:\n" + "\n".join(missing)


def test_named_markers_are_registered() -> None:
    known = registered_markers() | BUILTIN_MARKERS
    assert {"slow", "slurm", "gpu"} <= known
    assert _missing(named_markers(), known.__contains__) == []
    wrong = [f"{doc}: {path} has no {mark} mark" for doc, path, mark in marker_claims()
             if not re.search(rf"mark\.{mark}\b", (REPO / path).read_text())]  # fmt: skip
    assert wrong == []


def test_marker_scan_sees_markers_and_claims() -> None:
    """The patterns above on sample sentences (so that an empty scan cannot pass unnoticed)."""
    doc = REPO / "docs" / "example.md"
    text = (
        'Run `pytest -m "not slow"`; the test marker `slurm` needs a cluster; `gpu` pytest markers skip;\n'
        "the `FINISHED` marker is a file;\n"
        "`tests/slurm/test_real_trainer.py` marks its preemption test `xfail(strict=True)` until then."
    )
    marks = {m.group(1) for pattern in _MARKS for m in pattern.finditer(text)}
    assert marks == {"slow", "slurm", "gpu"}
    claims = [(m.group(1), m.group(2)) for m in _MARK_CLAIM.finditer(" ".join(text.split()))]
    assert claims == [("tests/slurm/test_real_trainer.py", "xfail")] and doc.parent.is_dir()
    assert not re.search(r"mark\.xfail\b", (REPO / claims[0][0]).read_text())  # what the old slurm.md claimed


def test_named_tests_exist() -> None:
    names = known_tests()
    tests = named_tests()
    assert len(tests) >= 3
    assert _missing(tests, names.__contains__) == []


def test_named_options_exist() -> None:
    options = named_options()
    assert len(options) > 30
    assert _missing(options, option_exists) == []


@pytest.mark.parametrize(
    ("text", "exists"),
    [("train.steps", True), ("data.prepare.output", True), ("data.streams.path", True), ("slurm.env.FOO", True),
     ("checkpoint.stop_at", True), ("decider.init_from", True), ("train.stepz", False), ("model.loops.x", False),
     ("checkpoint.resume_form", False)],
)  # fmt: skip
def test_option_lookup(text: str, exists: bool) -> None:
    """The lookup itself: nested sections, lists of sections, mappings, optional sections, typos."""
    assert option_exists(text) is exists
