"""The console of a job: the progress and messages our packages log, as plain lines on stdout.

Modules log to ``logging.getLogger(__name__)``; a job's ``main`` calls ``configure_console()`` first, which gives the
loggers of our packages one handler that writes each record's message alone, as ``print`` would. Warnings carry
their own ``warning:`` in the message (``[score] warning: ...``), so every level is written the same way. The loggers
keep propagating: pytest's ``caplog`` and any root handler see the records too.

``file`` (or the ``HUMANS1B_LOG_FILE`` environment variable) adds a log file with times, levels and logger names.

``exit_code_interruptible`` ends a job's ``main`` on Ctrl-C with one line saying what is committed, instead of a
traceback through Ray Data or Ray Train. ``next_steps`` prints where a job's results are and the commands that come
next, named as the user gave the paths (``beside``: a folder next to one given; ``shown_path``: a file of the repo).
"""

from __future__ import annotations

import logging
import os
import posixpath
import shlex
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from common.storage import redact

PACKAGES = ("common", "curation", "jobs", "training", "pretrain", "finetune", "generators")
FILE_ENV = "HUMANS1B_LOG_FILE"
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command Ctrl-C ended
RESUME = "rerun the same command to resume"


class _Stdout(logging.StreamHandler):
    """A stream handler on whatever ``sys.stdout`` is when a record is written (pytest's capture replaces it)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self) -> TextIO:
        return sys.stdout

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # always sys.stdout


def configure_console(level: int = logging.INFO, file: str | None = None) -> None:
    """Our packages' records at ``level`` and above on stdout, and in ``file`` (default: ``$HUMANS1B_LOG_FILE``)
    when given; calling it again adds no second handler."""
    file = file or os.environ.get(FILE_ENV) or None
    loggers = [logging.getLogger(name) for name in PACKAGES]
    handlers = [h for logger in loggers for h in logger.handlers]
    console = next((h for h in handlers if isinstance(h, _Stdout)), None) or _Stdout()
    wanted: list[logging.Handler] = [console]
    if file:
        path = os.path.abspath(file)
        same = (h for h in handlers if isinstance(h, logging.FileHandler) and h.baseFilename == path)
        to_file = next(same, None)
        if to_file is None:
            to_file = logging.FileHandler(path, encoding="utf-8")
            to_file.setFormatter(logging.Formatter(FILE_FORMAT))
        wanted.append(to_file)
    for logger in loggers:
        logger.setLevel(level)
        for handler in wanted:
            if handler not in logger.handlers:
                logger.addHandler(handler)


def exit_code_interruptible(
    job: str, body: Callable[[], int], committed: Callable[[], str], rerun: str = RESUME
) -> int:
    """Run a job's body; a Ctrl-C (``KeyboardInterrupt``) ends it with exit code 130 and one line on stderr:
    ``[<job>] interrupted: <committed()>; <rerun>``. A second Ctrl-C while the job winds down (Ray's shutdown) ends
    the process at once, with no traceback either."""
    try:
        return body()
    except KeyboardInterrupt:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            what = committed()
        except Exception as exc:  # noqa: BLE001 - the line must come out whatever the output holds
            what = f"what is committed could not be read ({type(exc).__name__}: {exc})"
        print(f"[{job}] interrupted: {what}; {rerun}", file=sys.stderr, flush=True)
        return INTERRUPTED


def beside(uri: str, name: str) -> str:
    """The folder ``name`` next to the folder ``uri``, as the console names it (no query or credentials): the
    README's layout keeps ``out/curated``, ``out/runs``, ``out/wds`` and ``out/synthetic`` side by side."""
    shown = redact(uri).rstrip("/")
    parent = posixpath.dirname(shown)
    if "://" in shown and "/" not in shown.split("://", 1)[1]:  # a bucket's root has no folder beside it
        parent = shown
    return posixpath.join(parent, name) if parent else name


def shown_path(path: Path) -> str:
    """A file of the repository as a command line names it: relative to the working directory when inside it. A
    job's last lines must not fail where the working directory is gone (a submitted job's, removed by Ray)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def shown_place(uri: str) -> str:
    """A place as the console names it: a local path as the command line would (``shown_path``), an object store's
    URI without its query or credentials."""
    return redact(uri) if "://" in uri else shown_path(Path(uri))


def next_steps(job: str, where: list[tuple[str, str]], commands: list[list[str]]) -> None:
    """Print where a job's results are (``(label, place)`` pairs) and the commands that come next, one a line."""
    lines = [(f"{label}:", place) for label, place in where]
    lines += [("next:" if i == 0 else "", shlex.join(argv)) for i, argv in enumerate(commands)]
    width = max((len(label) for label, _ in lines), default=0)
    for label, text in lines:
        print(f"[{job}] {label:<{width}} {text}")


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``n`` and its noun, singular for one: ``plural(1, "input")`` is "1 input", ``plural(3, "shard")`` "3 shards"
    (``many``: the plural where it is not the noun plus s)."""
    return f"{n} {noun if n == 1 else many or noun + 's'}"
