"""``vfab top``: a live view of the fabric, refreshed every second; ``--once`` prints one frame.

Each frame is one read of etcd (every key under ``/vfab/v1/``, consistently at one revision) drawn by
``topview.frame``.  On a terminal the view takes the alternate screen and redraws in place (plain ANSI, no
curses): ``q`` or Ctrl-C quits and gives the screen back.  When etcd cannot be read the last frame stays, under
a line saying what failed and since when; the view carries on once etcd answers.
"""

from __future__ import annotations

import os
import select
import shutil
import sys
import termios
import time
import tty

import click

from vfab.cli import topview
from vfab.cli.common import errors, pass_ctx
from vfab.vid.errors import RegistryError
from vfab.vid.registry import schema

ENTER, LEAVE = "\x1b[?1049h\x1b[?25l", "\x1b[?25h\x1b[?1049l"
HOME = "\x1b[H\x1b[2J"


def read_frame(reg) -> list[str]:
    revision, items = reg.get_prefix(schema.ROOT)
    return topview.frame(items, revision, where=reg.endpoint)


def fit(lines: list[str], cols: int, rows: int) -> str:
    """The lines cut to the terminal: each to ``cols`` characters, at most ``rows`` of them."""
    shown = [line[:cols] for line in lines[:rows]]
    if len(lines) > rows:
        shown[-1] = f"... {len(lines) - rows + 1} more line(s): enlarge the terminal"[:cols]
    return "\r\n".join(shown)


class _Keys:
    """The terminal's keys one at a time (cbreak), restored on exit; a no-op when stdin is no terminal."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno() if sys.stdin.isatty() else None
        self.saved = None

    def __enter__(self) -> "_Keys":
        if self.fd is not None:
            self.saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)

    def quit_within(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True if ``q`` was pressed meanwhile."""
        if self.fd is None:
            time.sleep(seconds)
            return False
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready and os.read(self.fd, 1) in (b"q", b"Q"):
                return True
        return False


@click.command("top")
@click.option("--once", is_flag=True, help="Print one frame and exit (for scripts and tests).")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True, metavar="SECONDS",
              help="Seconds between frames.")
@pass_ctx
@errors
def top(c, once: bool, interval: float) -> None:
    """Watch the fabric live: switches, services and ranges (owner, mirrors, helpers, records, req/s), running
    operations with progress bars, helpers and the balancer's decisions.  q or Ctrl-C quits."""
    reg = c.registry
    if once:
        click.echo("\n".join(read_frame(reg)))
        return
    last: list[str] = ["(no frame yet)"]
    failing_since = 0.0
    out = sys.stdout
    out.write(ENTER)
    try:
        with _Keys() as keys:
            while True:
                try:
                    last = read_frame(reg)
                    failing_since = 0.0
                    head: list[str] = []
                except RegistryError as exc:
                    failing_since = failing_since or time.time()
                    head = [f"!! etcd unreachable for {time.time() - failing_since:.0f} s: {exc}",
                            f"!! showing the last frame; retrying every {interval:g} s"]
                size = shutil.get_terminal_size((120, 40))
                out.write(HOME + fit(head + last, size.columns, size.lines - 1))
                out.flush()
                if keys.quit_within(interval):
                    break
    except KeyboardInterrupt:
        pass
    finally:
        out.write(LEAVE)
        out.flush()


COMMANDS = [top]
