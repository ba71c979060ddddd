"""Running the operator: kopf's settings (:mod:`shardwise.operator.main`) and the
``shardwise operator`` command."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from shardwise.cli.operator import operator_cmd
from shardwise.operator.main import RunOptions, exact_names, settings_for


def test_kopf_scans_nothing_for_exact_namespaces() -> None:
    assert settings_for(RunOptions(namespaces=("ml", "team-a"))).scanning.disabled
    assert not settings_for(RunOptions(namespaces=("team-*",))).scanning.disabled
    assert not settings_for(RunOptions(clusterwide=True)).scanning.disabled
    assert not exact_names([]) and not exact_names(["!kube-system"])


def test_cli_needs_a_scope() -> None:
    from shardwise.cli import main  # noqa: F401  (the package imports cleanly with the command)

    app = typer.Typer()
    app.command()(operator_cmd)
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0 and "--all-namespaces" in result.output
    result = CliRunner().invoke(app, [])
    assert result.exit_code != 0 and "--namespace" in str(result.exception)
