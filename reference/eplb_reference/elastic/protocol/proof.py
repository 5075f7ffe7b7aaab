"""``RunSecret``: the proof that a value in the run's store was written by the run's own members.

The store (a ``torch.distributed.TCPStore``) lets anyone who reaches its port read and write every
key. Each value a member or the coordinator writes is sealed with an HMAC-SHA256 of the run's
secret over the key and the value, and every reader opens it before acting on it: a value without a
valid seal, or moved under another key, is refused (``Unproven``), so a process that reaches the
store without the secret cannot steer the group. Values are authenticated, not encrypted: such a
process can still read them, replay a value under the key it was written to, fill the store, or
break a Gloo rendezvous (the trusted-network assumption of PyTorch's store and Gloo, SECURITY.md).

The secret is generated per run. The coordinator hands it to the members it starts in their
process arguments (a pipe, never a command line); a member started elsewhere (``eplb-graph join``)
reads it from a file only its user can read (``--secret-file``) or from ``EPLB_GRAPH_RUN_SECRET``.
It is never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

SECRET_ENV = "EPLB_GRAPH_RUN_SECRET"
SECRET_BYTES = 32
MAC_CHARS = 2 * hashlib.sha256().digest_size  # hex


class Unproven(ValueError):
    """A store value without a valid seal of the run's secret."""


class RunSecret:
    """The run's secret key: seals the values written to the store, opens the ones read from it."""

    def __init__(self, key: bytes) -> None:
        if len(key) < SECRET_BYTES:
            raise ValueError(f"a run secret needs {SECRET_BYTES} bytes at least, got {len(key)}")
        self._key = key

    def __repr__(self) -> str:
        return "RunSecret(<hidden>)"  # never in a log or a traceback

    @classmethod
    def generate(cls) -> RunSecret:
        return cls(secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def from_text(cls, text: str, where: str) -> RunSecret:
        text = text.strip()
        try:
            key = bytes.fromhex(text)
        except ValueError:
            raise ValueError(f"{where}: a run secret is {2 * SECRET_BYTES} hex digits") from None
        if len(key) < SECRET_BYTES:
            raise ValueError(f"{where}: a run secret is {2 * SECRET_BYTES} hex digits, got {len(text)}")
        return cls(key)

    @classmethod
    def read_file(cls, path: Path) -> RunSecret:
        """The secret in ``path``, a regular file of this user that no one else can read or write."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as error:
            raise ValueError(f"--secret-file {path}: cannot be opened ({error.strerror}; a symlink is refused)") \
                from None
        with os.fdopen(fd) as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise ValueError(f"--secret-file {path}: must be a regular file of this user with mode 600 "
                                 f"(it has mode {stat.S_IMODE(info.st_mode):o}, owner uid {info.st_uid})")
            return cls.from_text(file.read(), f"--secret-file {path}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> RunSecret | None:
        text = environ.get(SECRET_ENV)
        return None if text is None else cls.from_text(text, SECRET_ENV)

    @classmethod
    def load(cls, path: str | None, environ: Mapping[str, str], *, create: bool) -> RunSecret:
        """The run's secret, from ``path`` (``--secret-file``) or ``SECRET_ENV``. ``create`` (``serve``):
        generated when neither holds one, and written to ``path`` when one is named."""
        if path is not None:
            if os.path.lexists(path) or not create:
                return cls.read_file(Path(path))
            secret = cls.generate()
            secret.write_file(Path(path))
            return secret
        secret = cls.from_environment(environ)
        if secret is None and not create:
            raise ValueError(f"the run's secret is needed to join it: --secret-file PATH (the file `serve "
                             f"--secret-file` wrote) or {SECRET_ENV}")
        return secret or cls.generate()

    def write_file(self, path: Path) -> None:
        """A new file of mode 600 holding the secret, for a second machine's ``join``; an existing
        path (a file, or a link someone planted) is refused."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise ValueError(f"--secret-file {path}: exists and is not a secret this user can read") from None
        except OSError as error:
            raise ValueError(f"--secret-file {path}: cannot be created ({error.strerror})") from None
        with os.fdopen(fd, "w") as file:
            file.write(self._key.hex() + "\n")

    def environment(self) -> dict[str, str]:
        """The variable ``join`` reads the secret from (for a process this one starts)."""
        return {SECRET_ENV: self._key.hex()}

    def _mac(self, key: str, text: str) -> str:
        return hmac.new(self._key, f"{key}\0{text}".encode(), hashlib.sha256).hexdigest()

    def seal(self, key: str, text: str) -> str:
        """``text`` as written under ``key``: its seal first."""
        return f"{self._mac(key, text)}.{text}"

    def open(self, key: str, sealed: str) -> str:
        """The text of a value read under ``key``; ``Unproven`` if its seal is not the run's."""
        mac, dot, text = sealed[:MAC_CHARS], sealed[MAC_CHARS : MAC_CHARS + 1], sealed[MAC_CHARS + 1 :]
        if dot != "." or not mac.isascii() or not hmac.compare_digest(mac, self._mac(key, text)):
            raise Unproven(f"a value under {key} without the run's seal")
        return text
