"""The ``shardwise`` command line: thin wrappers over the library, with clear errors.

Every mistake a user can make ends as a one-paragraph message and exit code 2
(:class:`~shardwise.basics.UserError`); a traceback means a bug.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from shardwise import __version__
from shardwise.basics import UserError
from shardwise.cli._common import err, out
from shardwise.cli.bench import bench_cmd
from shardwise.cli.calibrate import calibrate_cmd
from shardwise.cli.evaluate import evaluate_cmd
from shardwise.cli.operator import operator_cmd
from shardwise.cli.plan import plan_cmd
from shardwise.cli.pretrain import pretrain_cmd
from shardwise.cli.profile import profile_app
from shardwise.cli.refine_plans import refine_plans_cmd
from shardwise.cli.replan import replan_cmd
from shardwise.cli.tables import tables_app

app = typer.Typer(
    help=(
        "Shardwise places DLRM embedding tables on GPUs so that no GPU is the straggler.\n\n"
        "Typical flow: `shardwise tables generate` (or `tables from-trace`) writes table "
        "specs; `shardwise plan` turns them into a plan.json that TorchRec's "
        "DistributedModelParallel reads; `shardwise evaluate` measures a plan for real.\n\n"
        "Cost models: `shardwise profile compute|comm` measures FBGEMM kernels and "
        "all-to-alls into datasets, `shardwise pretrain` trains the models that price "
        "plans (a pre-trained CPU model ships in the package), and `shardwise calibrate` "
        "fits one to this machine and a job's tables."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(tables_app, name="tables")
app.add_typer(profile_app, name="profile")
app.command("plan")(plan_cmd)
app.command("evaluate")(evaluate_cmd)
app.command("pretrain")(pretrain_cmd)
app.command("calibrate")(calibrate_cmd)
app.command("refine-plans")(refine_plans_cmd)
app.command("bench")(bench_cmd)
app.command("operator")(operator_cmd)
app.command("replan")(replan_cmd)


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    if version:
        out.print(f"shardwise {__version__}")
        raise typer.Exit()


def main() -> None:
    """Entry point: user mistakes become a message and exit code 2, never a traceback."""
    try:
        app()
    except UserError as e:
        err.print(f"[bold red]error:[/bold red] {e}", highlight=False)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
