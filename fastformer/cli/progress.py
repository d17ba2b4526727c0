"""A dependency-free text progress bar, one per benchmark stage (written to stderr)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`[#####.....] 5/10 stage: label (12.3 s)`; redrawn in place on a terminal, one line per
    step otherwise (so CI logs stay readable)."""

    def __init__(self, stage: str, total: int, stream: TextIO | None = None, width: int = 24):
        self.stage = stage
        self.total = max(total, 1)
        self.done = 0
        self.width = width
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._draw("starting")

    def _draw(self, label: str) -> None:
        filled = round(self.width * self.done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        line = f"[{bar}] {self.done}/{self.total} {self.stage}: {label} ({elapsed:.1f} s)"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def step(self, label: str) -> None:
        """Mark one unit of work done."""
        self.done = min(self.done + 1, self.total)
        self._draw(label)

    def close(self) -> None:
        """Finish the bar (fills it and ends the line)."""
        self.done = self.total
        self._draw("done")
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
