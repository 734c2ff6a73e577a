"""What the command line prints: user text made safe for a terminal, rich consoles,
and JSON documents. Every command prints through here."""

from __future__ import annotations

import json
import sys
from typing import Any

__all__ = ["EVERY_ONE", "console", "emit_json", "err", "out", "safe", "styled"]

EVERY_ONE = "--format json lists every one"  # where to see the problems text only counts


def safe(text: object) -> str:
    """`text` with every character a terminal could act on (escape sequences, other
    control characters) written as a Python escape; new lines are kept."""
    return "".join(
        c if c == "\n" or c.isprintable() else c.encode("unicode_escape").decode("ascii")
        for c in str(text)
    )


def out(text: object = "") -> None:
    """`text`, made `safe`, on stdout."""
    print(safe(text))


def err(text: object) -> None:
    """`text`, made `safe`, on stderr."""
    print(safe(text), file=sys.stderr)


def emit_json(payload: object) -> None:
    """One JSON document on stdout, in ASCII, so it is JSON whatever the terminal's
    encoding."""
    print(json.dumps(payload, indent=2, ensure_ascii=True))


def console() -> Any:
    """A rich console that prints user text literally (no markup, no emoji codes);
    wide when writing to a file or pipe, so tables are not cut."""
    from rich.console import Console

    return Console(
        width=None if sys.stdout.isatty() else 200, markup=False, emoji=False, highlight=False
    )


def styled(text: str, style: str) -> Any:
    """`text` in a rich `style`, for `console().print`."""
    from rich.text import Text

    return Text(text, style=style)
