"""Running the `shardwise` command in-process, with ``main()``'s rule applied: a
UserError is exit 2 with its message on stderr, anything else escapes and fails the
test with its traceback."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from shardwise.basics import UserError
from shardwise.cli import app


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str

    def lines(self, start: str) -> list[str]:
        """The stderr lines that begin with ``start``."""
        return [line for line in self.stderr.splitlines() if line.startswith(start)]


def shardwise(*args: str | Path) -> Ran:
    result = CliRunner().invoke(app, [str(a) for a in args])
    if isinstance(result.exception, UserError):
        return Ran(2, result.stdout, f"error: {result.exception}")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Ran(result.exit_code, result.stdout, result.stderr)


def flat(text: str) -> str:
    """Words as a reader sees them: no line breaks (the consoles wrap at their width,
    which in-process is not the terminal's), no boxes around usage errors."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


def refused(ran: Ran, *fragments: str) -> None:
    """Exit 2, no traceback, and every fragment in the message."""
    assert ran.code == 2, (ran.stdout, ran.stderr)
    assert "Traceback" not in ran.stdout + ran.stderr
    text = flat(ran.stderr)
    for f in fragments:
        assert f in text, text
