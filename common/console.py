"""The console of a job: the progress and messages our packages log, as plain lines on stdout.

Modules log to ``logging.getLogger(__name__)``; a job's ``main`` calls ``configure_console()`` first, which gives the
loggers of our packages one handler that writes each record's message alone, as ``print`` would. Warnings carry
their own ``warning:`` in the message (``[score] warning: ...``), so every level is written the same way. The loggers
keep propagating: pytest's ``caplog`` and any root handler see the records too.

``file`` (or the ``HUMANS1B_LOG_FILE`` environment variable) adds a log file with times, levels and logger names.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

PACKAGES = ("common", "curation", "jobs", "training", "pretrain", "finetune", "generators")
FILE_ENV = "HUMANS1B_LOG_FILE"
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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
