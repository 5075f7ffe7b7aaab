"""The fault a chaos run injects from inside a member: its main thread made to hang.

Its own module, apart from ``chaos.py``: a member process installs it at start (``processes.py``),
and ``chaos.py`` drives a whole ``ElasticServer``, whose coordinator starts those processes -- the
member importing the driver would close an import loop.
"""

from __future__ import annotations

import signal
import threading


def install_member_faults() -> None:
    """SIGUSR1 hangs this process's main thread (its other threads run on), as a deadlock would,
    while the keep-alive thread goes on beating."""
    signal.signal(signal.SIGUSR1, lambda signum, frame: threading.Event().wait())
