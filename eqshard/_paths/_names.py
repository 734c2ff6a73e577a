"""A leaf's one name: its key path written with dots.

A leaf's path is its pytree key path written with dots: attribute names,
sequence indices and dict keys, as in `blocks.0.attn.query_proj.weight`. A key a
dotted path cannot show as it is (empty, or holding '.', '*', white space, a
bracket, a brace, a quote, or a character `str.isprintable` refuses, such as a control
character) is written quoted, as Python's `repr` writes it, in brackets right
after the segment before it: `_weights['w[0,0] 16x0e,32x0e']`, `params["it's"].w`,
`['']`. That text (`name`) is the one name of a leaf in every message, report and
`check`, and read as a rule path (`_grammar.parse`) it matches exactly that leaf.

A segment names a key by its text alone: the index 0 of a list, the key 0 of a dict
and the key '0' of a dict are all `0`, and `['w']` is `w`. Two children of one node
never share a text (a node is a sequence or a dict, and a dict's keys must sort
against each other to flatten, so they are all strings or all numbers).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["is_plain", "name", "segments"]


@functools.cache
def _key_fields() -> dict[type, str]:
    """JAX's key classes, and the attribute that holds each one's key. JAX is
    imported only here, when a key path (which JAX made) is read, so the spec-file
    layer reads rule paths without it."""
    from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

    return {GetAttrKey: "name", SequenceKey: "idx", DictKey: "key", FlattenedIndexKey: "key"}


def _segment(key: Any, fields: dict[type, str]) -> str:
    field = fields.get(type(key))
    return str(key) if field is None else str(getattr(key, field))


def segments(path: Sequence[Any]) -> tuple[str, ...]:
    """The segments of a JAX key path: `(GetAttrKey('blocks'), SequenceKey(0))` ->
    `('blocks', '0')`."""
    fields = _key_fields()
    return tuple(_segment(key, fields) for key in path)


_PLAIN = re.compile(r"[^.*\s\[\]'\"{}]+")  # a literal segment written as it is


def is_plain(seg: str) -> bool:
    """Whether `name` writes the key `seg` as it is, without quotes."""
    return _PLAIN.fullmatch(seg) is not None and seg.isprintable()


def name(segs: Sequence[str]) -> str:
    """The segments as one dotted name, each quoted where it must be.

    **Example:** `name(("_weights", "w[0,0] 16x0e,32x0e"))` is
    `"_weights['w[0,0] 16x0e,32x0e']"`; `name(("blocks", "0", "w"))` is
    `"blocks.0.w"`; `name(())` is `""`.
    """
    text = ""
    for seg in segs:
        if is_plain(seg):
            text += f".{seg}" if text else seg
        else:
            text += f"[{seg!r}]"
    return text
