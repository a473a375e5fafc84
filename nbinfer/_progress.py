"""A one-line text progress bar (no dependency), for the command-line tools."""

from __future__ import annotations

import time

__all__ = ["ProgressBar"]


class ProgressBar:
    """``[####....] done/total  seconds  label`` redrawn in place on ``file`` (None: silent)."""

    def __init__(self, total: int, file):
        self.total, self.done, self.file, self.t0 = total, 0, file, time.perf_counter()
        self._draw("")

    def step(self, label: str = "", n: int = 1):
        self.done += n
        self._draw(label)

    def _draw(self, label: str):
        if self.file is None:
            return
        filled = 30 * min(self.done, self.total) // max(self.total, 1)
        t = time.perf_counter() - self.t0
        self.file.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} "
                        f"{t:5.0f} s  {label[:60]:<60}")
        self.file.flush()

    def close(self):
        if self.file is not None:
            self.file.write("\n")
            self.file.flush()
