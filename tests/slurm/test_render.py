"""SlurmConfig validation and slurm/train.sbatch rendering (no cluster needed).

Quoting is checked the way the consumers read it: bash evaluates the rendered shell lines, and a
port of sbatch's ``#SBATCH`` argument parser (src/sbatch/opt.c ``_get_argument``, Slurm 22.05)
reads the directives. The cluster tests then submit a run dir that needs quoting for real.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from elastic_pretrain.config import ConfigError, build
from elastic_pretrain.launch.config import SlurmConfig, parse_time_limit
from elastic_pretrain.launch.local import ERRORS_ENV, report_user_error, reported_error
from elastic_pretrain.launch.render import LaunchSpec, Lines, fill, output_pattern, render, sbatch_escape

NASTY = 'it\'s a "run" #1 $HOME `id` %j \\ \t ünï'
REPO = Path(__file__).resolve().parents[2]


def sbatch_directive_arg(text: str) -> str:
    """Port of sbatch's ``_get_argument``: how sbatch reads one argument of an #SBATCH line."""
    out: list[str] = []
    quoted, q_char, escape = False, "", False
    for c in text.lstrip():
        if not quoted and c.isspace():
            break
        if escape:
            escape = False
        elif c == "\\":
            escape = True
            continue
        elif quoted:
            if c == q_char:
                quoted = False
                continue
        elif c in "\"'":
            quoted, q_char = True, c
            continue
        elif c == "#":
            break
        out.append(c)
    return "".join(out)


def sbatch_options(script: str) -> dict[str, list[str]]:
    """``--name=value`` of every #SBATCH line, as sbatch reads them."""
    opts: dict[str, list[str]] = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH "):
            arg = sbatch_directive_arg(line[len("#SBATCH ") :])
            name, _, value = arg.partition("=")
            opts.setdefault(name, []).append(value)
    return opts


def spec(run_dir: Path = Path("/runs/tiny"), name: str = "tiny", trainer: list[str] | None = None) -> LaunchSpec:
    return LaunchSpec(job_name=name, run_dir=run_dir, workdir=Path("/work dir"), trainer=trainer or ["train.py"])


def shell_values(script: str, *exprs: str) -> list[str]:
    """Evaluate the script's variable block in bash and return ``exprs`` (NUL-separated)."""
    block = script[script.index("RUN_DIR=") : script.index("RESTART=")]
    printf = "printf '%s\\0' " + " ".join(exprs)
    out = subprocess.run(["bash", "-c", block + printf], capture_output=True, text=True, check=True).stdout
    return out.split("\0")[:-1]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 5400), ("5:30", 330), ("01:30:00", 5400), ("2-00:00:00", 172800), ("1-12", 129600), ("1-0:10", 87000)],
)
def test_time_limits_parse(text: str, seconds: int) -> None:
    assert parse_time_limit(text) == seconds
    assert parse_time_limit("UNLIMITED") is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nodes": 0}, "slurm.nodes must be >= 1 (got 0): pass --nodes N"),
        ({"time": "1:2:3:4"}, "slurm.time (--time): '1:2:3:4' is not a Slurm time limit"),
        ({"time": "2h"}, "is not a Slurm time limit: write minutes (90)"),
        ({"time": "3", "signal_lead_s": 300}, "slurm.signal_lead_s=300 is not below slurm.time=3 (180 s)"),
        ({"signal": "KILL"}, "slurm.signal: 'KILL' is not supported: use one of TERM, USR1, USR2"),
        ({"retries": -1}, "slurm.retries must be >= 0"),
        ({"gpus_per_node": -8}, "slurm.gpus_per_node must be >= 0"),
        ({"partition": "a b"}, "slurm.partition: 'a b' is not a Slurm partition name"),
        ({"sbatch_args": ["--nodes=4"]}, "--nodes is managed by elastic-pretrain: set slurm.nodes instead"),
        ({"sbatch_args": ["--output=x"]}, "--output is managed by elastic-pretrain: the template sets it"),
        ({"sbatch_args": ["-q high"]}, "is not a long sbatch option: write it as --name=value"),
        ({"sbatch_args": ["--qos=a\n#SBATCH --x"]}, "contains a line break"),
        ({"env": {"1X": "y"}}, "slurm.env: '1X' is not a variable name"),
    ],
)
def test_bad_values_raise_one_line_config_errors(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        SlurmConfig(**fields)  # type: ignore[arg-type]
    assert message in str(err.value) and "\n" not in str(err.value)


def test_build_from_yaml_section_checks_keys_and_normalises() -> None:
    cfg = build(SlurmConfig, {"nodes": 4, "signal": "SIGUSR2", "gpus_per_node": 8}, prefix="slurm.")
    assert (cfg.signal, cfg.procs_per_node) == ("USR2", 8)
    assert SlurmConfig(signal="10").signal == "USR1"
    assert SlurmConfig(gpus_per_node=0).procs_per_node == 1
    with pytest.raises(ConfigError, match=re.escape("unknown key 'slurm.node': did you mean 'slurm.nodes'")):
        build(SlurmConfig, {"node": 2}, prefix="slurm.")


def test_cpu_defaults_leave_unset_options_out() -> None:
    script = render(SlurmConfig(nodes=2), spec())
    opts = sbatch_options(script)
    assert opts["--nodes"] == ["2"] and opts["--ntasks-per-node"] == ["1"]
    assert opts["--signal"] == ["B:TERM@300"] and "--requeue" in opts and opts["--open-mode"] == ["append"]
    assert opts["--output"] == ["/runs/tiny/slurm/train-%j.log"]  # one log per Slurm job id
    for unset in ("--gpus-per-node", "--partition", "--account", "--time", "--cpus-per-task"):
        assert unset not in opts
    assert "{{" not in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_gpu_cluster_example() -> None:
    cfg = SlurmConfig(
        nodes=16, gpus_per_node=8, cpus_per_task=96, time="2-00:00:00", partition="gpu", account="llm-pretrain",
        signal="USR2", signal_lead_s=600, retries=10, sbatch_args=["--exclusive", "--qos=high"],
        env={"NCCL_DEBUG": "WARN"},
    )  # fmt: skip
    script = render(cfg, spec())
    opts = sbatch_options(script)
    assert opts["--nodes"] == ["16"] and opts["--gpus-per-node"] == ["8"] and opts["--cpus-per-task"] == ["96"]
    assert opts["--partition"] == ["gpu"] and opts["--account"] == ["llm-pretrain"]
    assert opts["--time"] == ["2-00:00:00"] and opts["--signal"] == ["B:USR2@600"]
    assert "--exclusive" in opts and opts["--qos"] == ["high"]
    assert shell_values(script, "$NPROC_PER_NODE", "$SIGNAL", "$RETRIES", "$NCCL_DEBUG") == ["8", "USR2", "10", "WARN"]


def test_values_needing_quotes_reach_bash_and_sbatch_unchanged() -> None:
    run_dir = Path("/runs") / NASTY.replace("\\", "")  # a backslash turns sbatch's %j off: refused (below)
    trainer = [
        "-m",
        "elastic_pretrain.cli",
        "train",
        f"/jobs/{NASTY}.yaml",
        "model.name=a b",
        "--run-dir",
        str(run_dir),
    ]
    cfg = SlurmConfig(nodes=2, env={"NOTE": NASTY}, sbatch_args=[f"--comment={NASTY}"], python="/opt/my env/python")
    script = render(cfg, spec(run_dir, name=NASTY, trainer=trainer))
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    values = shell_values(script, '"$RUN_DIR"', '"$WORKDIR"', '"$PYTHON"', '"$NOTE"', '"${TRAINER[@]}"')
    assert values == [str(run_dir), "/work dir", "/opt/my env/python", NASTY, *trainer]
    opts = sbatch_options(script)
    assert opts["--job-name"] == [NASTY] and opts["--comment"] == [NASTY]
    assert opts["--output"] == [output_pattern(run_dir / "slurm") + "/train-%j.log"]
    with pytest.raises(ConfigError, match="contains a backslash, which turns off sbatch's --output patterns"):
        render(cfg, spec(Path("/runs") / NASTY, name=NASTY, trainer=trainer))


def test_output_pattern_escapes_percent_unless_a_backslash_disables_patterns() -> None:
    assert output_pattern(Path("/r/100%/log")) == "/r/100%%/log"
    assert output_pattern(Path("/r/a\\b%/log")) == "/r/a\\b%/log"
    assert sbatch_escape("plain-1.0/x=y") == "plain-1.0/x=y"
    with pytest.raises(ConfigError, match="line break"):
        sbatch_escape("a\nb")


def test_fill_rules() -> None:
    template = "#SBATCH --a={{A}}\n#SBATCH {{L}}\nX={{A}}\nY=({{L}})\n{{B}}\n#SBATCH --gone={{N}}\n"
    out = fill(template, {"A": "x y", "L": ["--p=1", "--q=2"], "B": Lines(["b1", "b2"]), "N": None})
    assert out == "#SBATCH --a=\"x y\"\n#SBATCH --p=1\n#SBATCH --q=2\nX='x y'\nY=(--p=1 --q=2)\nb1\nb2\n"
    with pytest.raises(ConfigError, match="unknown placeholder"):
        fill("{{WHAT}}", {})
    with pytest.raises(ConfigError, match=re.escape("does not use {{RUN_DIR}}")):
        fill("{{A}}", {"A": "a", "RUN_DIR": "/r"})


def test_relative_run_dir_and_missing_template_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must be an absolute path"):
        render(SlurmConfig(), spec(Path("runs/x")))
    with pytest.raises(ConfigError, match="cannot read the sbatch template"):
        render(SlurmConfig(template=str(tmp_path / "none.sbatch")), spec())


def test_local_cluster_scripts_parse() -> None:
    for script in ("up.sh", "down.sh", "common.sh"):
        subprocess.run(["bash", "-n", str(REPO / "slurm" / "local-cluster" / script)], check=True)


def test_the_script_reports_user_errors_as_the_local_launcher_does(tmp_path: Path) -> None:
    """The batch script's ``reported_error`` (it prints a user error once per job) gives the same line
    as launch/local.py's for the ranks' files: the lowest rank's message, then each different one."""
    script = (REPO / "slurm" / "train.sbatch").read_text()
    m = re.search(r"^reported_error\(\) \{.*?^\}$", script, flags=re.M | re.S)
    assert m, "slurm/train.sbatch lost its reported_error function"

    def both(folder: Path) -> tuple[str, str]:
        code = m.group(0) + '\nreported_error "$1"\n'
        out = subprocess.run(["bash", "-c", code, "x", str(folder)], capture_output=True, text=True, check=True)
        return out.stdout, reported_error(folder) or ""

    assert both(tmp_path) == ("", "")
    odd = "data/x.yaml: shard * [a] $HOME `id` 'q' \"dq\" is corrupt; delete it\nand re-run"
    for rank, text in [(3, "other error\n"), (0, odd + "\n"), (1, odd), (12, "other error"), (2, "third")]:
        (tmp_path / f"rank_{rank:05d}").write_text(text)
    (tmp_path / ".rank_00004.tmp").write_text("half written")
    bash, python = both(tmp_path)
    assert bash == python == odd.replace("\n", " ") + " (rank 2: third) (rank 3: other error)"


def test_a_rank_prints_its_error_itself_when_the_errors_folder_is_out_of_reach(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under Slurm the folder is <run_dir>/slurm/errors, made by the batch script on node 0: a node that
    cannot write there (not shared after all) must not turn the one-line error into a traceback."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv(ERRORS_ENV, str(tmp_path / "not-here"))
    assert report_user_error("bad shard") is False
    monkeypatch.setenv(ERRORS_ENV, str(tmp_path))
    assert report_user_error("bad shard") is True
    assert reported_error(tmp_path) == "bad shard" and (tmp_path / "rank_00003").is_file()
