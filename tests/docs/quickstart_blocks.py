"""The code blocks of docs/quickstart-hf.md, as the tests execute them (verbatim)."""

from __future__ import annotations

import re
from pathlib import Path

QUICKSTART = Path(__file__).resolve().parents[2] / "docs" / "quickstart-hf.md"
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def quickstart_blocks(section: str, language: str) -> list[str]:
    """The ``language`` code blocks under the ``## section`` heading, in order."""
    text = QUICKSTART.read_text()
    start = text.index(f"## {section}")
    end = text.find("\n## ", start + 1)
    body = text[start : end if end != -1 else len(text)]
    return [code for lang, code in _BLOCK.findall(body) if lang == language]
