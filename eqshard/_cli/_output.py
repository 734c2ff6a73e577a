"""What the command line prints: user text made safe for a terminal, rich consoles,
JSON documents, and a long command's progress. Every command prints through here."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["EVERY_ONE", "console", "emit_json", "err", "out", "progress", "safe", "styled"]

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


@contextlib.contextmanager
def progress(
    command: str, starting: str, plain: bool = False
) -> Iterator[Callable[[Mapping[str, Any]], None]]:
    """What a long command says of its progress, on stderr: a callback for each event
    (its line as `"text"`, its `"done"` of `"total"`), shown by a rich progress
    display that is gone when the command ends, where stderr is a terminal; else, or
    `plain`, as a line each. `starting` is said first.

    **Example:**

    ```python
    with progress("eqshard suggest", "building the candidates") as show:
        show({"text": "compiling 9 candidates on 8 devices", "done": 0, "total": 9})
    ```
    """
    if plain or not sys.stderr.isatty():

        def line(event: Mapping[str, Any]) -> None:
            err(f"{command}: {event['text']}")

        line({"text": starting})
        yield line
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

    shown = Console(stderr=True, markup=False, emoji=False, highlight=False)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        console=shown,
        transient=True,
    ) as display:
        task = display.add_task(safe(f"{command}: {starting}"), total=None)

        def show(event: Mapping[str, Any]) -> None:
            display.update(
                task,
                description=safe(f"{command}: {event['text']}"),
                completed=event.get("done", 0),
                total=event.get("total") or None,
            )

        yield show
