"""What the command line shows: complete help, user values printed literally (never read as Rich markup), and
clear errors with the right exit code for bad ``results`` options."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from privbench import cli
from privbench.cli import app

runner = CliRunner(env={"COLUMNS": "200"})  # wide enough that no word of the help is wrapped apart


def _flat(text: str) -> str:
    """``text`` with the help's frame characters dropped and all whitespace runs collapsed to one space."""
    return " ".join(text.replace("│", " ").split())


# ------------------------------------------------------------------------------------------------ help


def test_app_help_shows_the_whole_first_paragraph() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    paragraph = _flat(cli.__doc__.split("\n\n")[0])
    assert paragraph.endswith("always works.")
    assert paragraph in _flat(result.output)


def test_run_help_lists_every_flow_and_profile() -> None:
    from flows.registry import FLOWS
    from pbconfig.benchmark import CONFIG_DIR, PROFILES

    assert cli.FLOW_NAMES == tuple(FLOWS)
    shown = _flat(runner.invoke(app, ["run", "--help"]).output)
    assert f"which flow: {', '.join(FLOWS)}" in shown
    profiles = {*PROFILES, *(p.stem for p in CONFIG_DIR.glob("*.yaml"))}
    for command in ("run", "bench"):
        shown = _flat(runner.invoke(app, [command, "--help"]).output)
        assert all(profile in shown for profile in profiles), (command, profiles)


def test_the_command_line_imports_neither_prefect_nor_the_configs() -> None:
    import subprocess
    import sys

    code = (
        "import sys, privbench.cli; print(sorted({'prefect', 'pydantic', 'pbconfig.benchmark', 'flows'} "
        "& set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# ------------------------------------------------------------------------------- values shown literally


def test_a_pattern_in_a_config_error_is_shown_literally(home: Path) -> None:
    result = runner.invoke(app, ["run", "prepare", "--set", "prepare.datasets.0.name=Bad!"])
    assert result.exit_code == 2
    assert "prepare.datasets.0.name = 'Bad!': String should match pattern '^[a-z0-9][a-z0-9._-]*$'" in result.stderr


def test_a_list_in_a_set_override_is_shown_literally(home: Path) -> None:
    result = runner.invoke(app, ["run", "prepare", "--set", "prepare.datasets.0.name=[gru, foo]"])
    assert result.exit_code == 2
    assert "(--set prepare.datasets.0.name=[gru, foo]):" in result.stderr
    assert "prepare.datasets.0.name = ['gru', 'foo']: Input should be a valid string" in result.stderr


def test_a_config_path_with_brackets_is_shown_literally(home: Path, tmp_path: Path) -> None:
    missing = tmp_path / "[ml]" / "my.yaml"
    result = runner.invoke(app, ["run", "prepare", "--config", str(missing)])
    assert result.exit_code == 2
    assert f"config file '{missing}' does not exist" in result.stderr


def test_stored_values_are_shown_literally(home: Path) -> None:
    from storage.recording import record_run

    with (
        pytest.raises(ValueError),
        record_run(
            flow="prepare", stage="data", technique="[bold]x[/bold]", config={}, dataset="d[ml]", track=False
        ) as rec,
    ):
        raise ValueError("String should match pattern '^[a-z0-9]$'")
    listed = runner.invoke(app, ["results", "list"])
    assert listed.exit_code == 0 and "[bold]x[/bold]" in listed.stdout and "d[ml]" in listed.stdout
    shown = runner.invoke(app, ["results", "show", rec.run_id])
    assert shown.exit_code == 0
    assert "error: ValueError: String should match pattern '^[a-z0-9]$'" in shown.stdout
    assert "/data/[bold]x[/bold]" in shown.stdout
    queried = runner.invoke(app, ["results", "query", 'select technique as "[t]" from runs'])
    assert queried.exit_code == 0 and "[t]" in queried.stdout and "[bold]x[/bold]" in queried.stdout


# ------------------------------------------------------------------------------------- results options


@pytest.mark.parametrize("kind", ["file-as-folder", "proc"])
def test_export_to_an_unwritable_folder_is_a_clear_error(home: Path, tmp_path: Path, kind: str) -> None:
    if kind == "proc":
        if not Path("/proc").is_dir():
            pytest.skip("no /proc on this system")
        out = Path("/proc/nope")
    else:
        (tmp_path / "a-file").write_text("")
        out = tmp_path / "a-file" / "export"
    result = runner.invoke(app, ["results", "export", "--out", str(out)])
    assert result.exit_code == 1 and not isinstance(result.exception, OSError), result.exception
    assert "cannot write the export to" in result.stderr and "pass --out a folder" in result.stderr
    assert str(out) in result.stderr or str(out.parent) in result.stderr


def test_results_list_refuses_an_unknown_status(home: Path) -> None:
    result = runner.invoke(app, ["results", "list", "--status", "bogus", "--json"])
    assert result.exit_code == 2 and result.stdout == ""
    assert "unknown --status 'bogus'; use one of running, finished, failed" in result.stderr
    assert runner.invoke(app, ["results", "list", "--status", "failed", "--json"]).stdout.strip() == "[]"


def test_results_list_refuses_a_negative_limit(home: Path) -> None:
    result = runner.invoke(app, ["results", "list", "--limit", "-1"])
    assert result.exit_code == 2 and "--limit" in result.output
