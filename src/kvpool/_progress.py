"""Progress for long CLI runs: rich bars on a terminal (stderr), a plain line per phase and per
quarter otherwise (CI logs, pipes), nothing with ``--quiet``. Results stay on stdout."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Reporter"]


class Reporter:
    """``with Reporter(quiet) as rep: update = rep.task("store 4 KiB"); update(0.5)``.

    ``task`` returns a callable taking the fraction done (0..1); ``note`` prints one line.
    """

    def __init__(self, quiet: bool = False) -> None:
        from rich.console import Console

        self.quiet = quiet
        self.console = Console(stderr=True)
        self.live = not quiet and self.console.is_terminal
        self._progress: Any = None

    def __enter__(self) -> Reporter:
        if self.live:
            from rich.progress import (
                BarColumn,
                Progress,
                SpinnerColumn,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
            self._progress = None

    def note(self, text: str) -> None:
        """One line on stderr (kept above the bars on a terminal)."""
        if self.quiet:
            return
        if self._progress is not None:
            self._progress.console.print(text, highlight=False)
        else:
            print(text, file=sys.stderr, flush=True)

    def task(self, label: str) -> Callable[[float], None]:
        """A new phase; call the result with the fraction done."""
        if self.quiet:
            return lambda f: None
        if self._progress is not None:
            tid = self._progress.add_task(label, total=1.0)
            return lambda f: self._progress.update(tid, completed=min(1.0, max(0.0, f)))
        t0 = time.monotonic()
        print(f"{label}: started", file=sys.stderr, flush=True)
        state = {"next": 0.25}

        def update(f: float) -> None:
            if f >= state["next"]:
                while f >= state["next"]:
                    state["next"] += 0.25
                print(f"{label}: {f:.0%} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)

        return update
