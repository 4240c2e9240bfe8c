"""Lines on stdout that stay whole when several processes share it.

Ranks launched by torchrun (or ``--independent`` runs) write to one inherited pipe. ``print(s)``
writes ``s`` and the newline as two separate writes when stdout is unbuffered
(``PYTHONUNBUFFERED=1``, common in job environments), so another process's line can land between
them and a JSON summary line comes out glued to a log line. One ``write`` of the whole line is
atomic on a pipe up to ``PIPE_BUF`` (4096 bytes on Linux).
"""

from __future__ import annotations

import sys
from typing import TextIO


def write_line(text: str, stream: TextIO | None = None) -> None:
    """Write ``text`` and its newline in one write call, then flush."""
    out = sys.stdout if stream is None else stream
    out.write(text + "\n")
    out.flush()
