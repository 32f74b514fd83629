"""Progress for the long setup steps: a long command's output condensed to a line every few
seconds (the step, the time so far, the build's percentage, its last line), and its last lines
in full when it fails.

    run(["cmake", "--build", "build", "-j", "2"], step="llama.cpp: building llama-server")

prints, on standard error::

    llama.cpp: building llama-server: 42% after 3m10s | [ 42%] Building CXX object ...
"""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import IO, Any

#: Seconds between two progress lines.
INTERVAL = 10.0
#: Lines of output shown when the command fails.
TAIL = 40
#: A progress line's copy of the command's last line is cut to this many characters.
LAST_LINE = 110

# Make's "[ 42%] Building ..." and Ninja's "[120/345] Building ...".
_PERCENT = re.compile(r"^\[\s*(\d{1,3})%\]")
_FRACTION = re.compile(r"^\[(\d+)/(\d+)\]")


def elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def percent_of(line: str) -> int | None:
    """The build's progress in a line of make's or Ninja's output, else None."""
    if match := _PERCENT.match(line):
        return min(100, int(match.group(1)))
    if (match := _FRACTION.match(line)) and int(match.group(2)) > 0:
        return min(100, 100 * int(match.group(1)) // int(match.group(2)))
    return None


class Condenser:
    """A command's output as a few progress lines. Pure: the caller gives the time.

    ``feed(line, now)`` takes each line of output; ``tick(now)`` is called when none came for a
    while. Each returns a progress line to print, or None: one every ``interval`` seconds, and
    one as soon as the build reaches 100%. The line shows the build's last step line (make's or
    Ninja's), else the command's last line.
    """

    def __init__(
        self, step: str, *, start: float, interval: float = INTERVAL, tail: int = TAIL
    ) -> None:
        self.step = step
        self.start = start
        self.interval = interval
        self.tail: deque[str] = deque(maxlen=tail)
        self.lines = 0
        self.percent: int | None = None
        self._last = ""
        self._said_at = start
        self._said_done = False

    def feed(self, line: str, now: float) -> str | None:
        line = line.rstrip()
        if line:
            self.lines += 1
            self.tail.append(line)
            found = percent_of(line)
            if found is not None:
                self.percent = max(found, self.percent or 0)
            # A build's last step line says more than a warning printed after it.
            if found is not None or self.percent is None:
                self._last = line
        return self.tick(now)

    def tick(self, now: float) -> str | None:
        done = self.percent == 100 and not self._said_done
        if not done and now - self._said_at < self.interval:
            return None
        self._said_at = now
        self._said_done = self.percent == 100
        where = f"{self.percent}%" if self.percent is not None else "running"
        line = f"{self.step}: {where} after {elapsed(now - self.start)}"
        if self._last:
            last = self._last if len(self._last) <= LAST_LINE else self._last[: LAST_LINE - 1] + "…"
            line += f" | {last}"
        return line


def condense(
    lines: Iterable[tuple[float, str]], step: str, *, start: float, interval: float = INTERVAL
) -> list[str]:
    """The progress lines printed for timed output ``(seconds, line)``: what :func:`run` does
    live, on a recording."""
    condenser = Condenser(step, start=start, interval=interval)
    said = [condenser.feed(line, at) for at, line in lines]
    return [line for line in said if line is not None]


def run(
    cmd: list[str],
    *,
    step: str,
    interval: float = INTERVAL,
    out: IO[str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    **popen: Any,
) -> None:
    """Run ``cmd``, its output (standard error too) condensed to progress lines on ``out``
    (standard error); raise ``CalledProcessError`` after its last lines when it fails."""
    out = out if out is not None else sys.stderr
    start = clock()
    condenser = Condenser(step, start=start, interval=interval)
    print(f"{step}: $ {' '.join(cmd)}", file=out, flush=True)
    process = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        **popen,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while True:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            said = condenser.tick(clock())
        else:
            if line is None:
                break
            said = condenser.feed(line, clock())
        if said is not None:
            print(said, file=out, flush=True)
    code = process.wait()
    reader.join()
    assert process.stdout is not None
    process.stdout.close()
    if code != 0:
        print(f"{step}: failed (exit status {code}); its last lines:", file=out)
        for line in condenser.tail:
            print(f"  {line}", file=out)
        out.flush()
        raise subprocess.CalledProcessError(code, cmd)
    print(f"{step}: done in {elapsed(clock() - start)}", file=out, flush=True)
