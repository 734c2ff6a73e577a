"""The einshard expression language: its parser and the frozen `Expression` value.

The grammar is einshard's:

```
expression  := side "->" side  |  side          (the second form is the short form)
left side   := (name | group | "...") separated by white space
group       := "(" name (white space name)* ")"
right side  := (element | "...") separated by white space
element     := name [count] ["*"]  |  count ["*"]  |  "*"
name        := one or more Unicode letters or "_"  |  "'" a letter or "_", then
               letters, "_", ASCII digits, "-" or "." "'"
count       := a positive integer in ASCII digits, no leading zero
```

A group is eqshard's one addition to einshard's grammar. The array dim it stands for
is split over each of its names' elements on the right, the first name the major one,
as `PartitionSpec(("fsdp", "sequence"))` splits a dim over two mesh axes. So
`"(f s) e -> f2 e s4"` cuts dim 0 into 8 blocks, and the device at `(f, e, s)` holds
block `4 * f + s`. A group's elements need not be next to each other on the right,
nor in the group's order. An expression without a group means exactly what it means
to einshard 0.2.0.

The parser is one hand-written loop over the characters (as in einops), so an
error can point at the exact token that is wrong. Parsing is cached.
"""

from __future__ import annotations

import dataclasses
import functools
import unicodedata
from collections.abc import Iterator, Sequence
from types import EllipsisType
from typing import Literal, NamedTuple, Union

from ._errors import EqshardError, ExpressionError, whole_number

__all__ = [
    "Element",
    "Expression",
    "is_logical_name",
    "item_text",
    "left_names",
    "name_text",
    "parse",
]


@dataclasses.dataclass(frozen=True)
class Element:
    """One element of an expression's right side.

    **Attributes:**

    - `name`: the axis it shards, or `None` for a standalone replication element.
    - `count`: the fixed number of shards (or replicas); 1 when none is written.
    - `star`: whether it also takes a share of the devices left over.

    `str(Element("a", 2, True))` is `"a2*"`.
    """

    name: str | None
    count: int = 1
    star: bool = False

    def __post_init__(self) -> None:
        whole_number(self.count, "an element's count")

    def __str__(self) -> str:
        # A count of 1 is implied, except for a lone "1", which needs its digit.
        implied = self.count == 1 and (self.name is not None or self.star)
        count = "" if implied else str(self.count)
        name = "" if self.name is None else name_text(self.name)
        return f"{name}{count}{'*' if self.star else ''}"


LeftItem = Union[str, tuple[str, ...], EllipsisType]
"""A left side's item: an axis name, a group of names (one dim over several mesh
axes, the first the major one), or `...`."""
RightItem = Union[Element, EllipsisType]


def name_text(name: str) -> str:
    """A name as an expression writes it: as it is where it is letters and `_`, else
    quoted (`'dim1'`, `'row-alias'`), so that no digit of it reads as a count. A name
    with other characters cannot be written (the parser says so)."""
    return name if is_name(name) else f"'{name}'"


def item_text(item: LeftItem | RightItem) -> str:
    """An item of either side as an expression writes it: `...`, `a`, `(a b)`, `a2*`,
    `'dim1'`."""
    if item is ...:
        return "..."
    if isinstance(item, tuple):
        return f"({' '.join(map(name_text, item))})"
    if isinstance(item, str):
        return name_text(item)
    return str(item)


def left_names(lhs: Sequence[LeftItem]) -> list[str]:
    """Every name of a left side, a group's members in order, without `...`."""
    names: list[str] = []
    for item in lhs:
        if isinstance(item, tuple):
            names += item
        elif isinstance(item, str):
            names.append(item)
    return names


def _hash_of(expression: Expression) -> int:
    return hash((expression.lhs, expression.rhs))


@dataclasses.dataclass(frozen=True)
class Expression:
    """A parsed einshard expression. Frozen, hashable, and compared by meaning.

    **Example:**

    ```python
    expr = eqshard.expression.parse("x y -> x y*")
    expr.lhs    # ('x', 'y')
    expr.rhs    # (Element('x', 1, False), Element('y', 1, True))
    str(expr)   # 'x y -> x y*'
    ```

    **Attributes:**

    - `lhs`: the array's axis names in order, with `...` for unnamed axes; `None`
        in the short form, whose left side comes from elsewhere (an annotation).
    - `rhs`: the right side's elements in order, with `...` where the left has it.
    - `text`: the text as it was written. It is kept for error messages and is not
        part of equality: `parse("a->a2")` equals `parse("a -> a2")`.

    `str(expr)` is the canonical text, which parses back to an equal value.
    """

    lhs: tuple[LeftItem, ...] | None
    rhs: tuple[RightItem, ...]
    text: str = dataclasses.field(default="", compare=False, repr=False)
    lhs_spans: tuple[tuple[int, int], ...] = dataclasses.field(
        default=(), compare=False, repr=False
    )
    rhs_spans: tuple[tuple[int, int], ...] = dataclasses.field(
        default=(), compare=False, repr=False
    )

    def __post_init__(self) -> None:
        # Every Expression is what `parse` gives: one built by hand, by `replace` or
        # by unpickling is checked against the parse of its text (cached), and takes
        # the parser's spans, so carets point where they should.
        try:
            parsed = _parse_text(self.text or str(self))
        except Exception:
            parsed = None
        if parsed is None or parsed != self:
            raise EqshardError(
                f"Expression(lhs={self.lhs!r}, rhs={self.rhs!r}, text={self.text!r}) is not "
                "a valid einshard expression; build expressions with `eqshard.expression.parse`"
            )
        object.__setattr__(self, "text", parsed.text)
        object.__setattr__(self, "lhs_spans", parsed.lhs_spans)
        object.__setattr__(self, "rhs_spans", parsed.rhs_spans)

    @classmethod
    def _parsed(
        cls,
        lhs: tuple[LeftItem, ...] | None,
        rhs: tuple[RightItem, ...],
        text: str,
        lhs_spans: tuple[tuple[int, int], ...],
        rhs_spans: tuple[tuple[int, int], ...],
    ) -> Expression:
        """The parser's own constructor: its values are valid by construction."""
        self = object.__new__(cls)
        for name, value in (
            ("lhs", lhs),
            ("rhs", rhs),
            ("text", text),
            ("lhs_spans", lhs_spans),
            ("rhs_spans", rhs_spans),
        ):
            object.__setattr__(self, name, value)
        return self

    def __hash__(self) -> int:
        # Expressions are cache keys on hot paths: hash the fields once.
        try:
            return self.__dict__["_hash"]
        except KeyError:
            value = _hash_of(self)
            object.__setattr__(self, "_hash", value)
            return value

    def __reduce__(self):
        # Pickle the text alone: it parses back to the same value, spans included,
        # and a cached hash must not travel to another process.
        return (parse, (self.text or str(self),))

    def __str__(self) -> str:
        rhs = " ".join(item_text(item) for item in self.rhs)
        if self.lhs is None:
            return rhs
        lhs = " ".join(item_text(item) for item in self.lhs)
        return f"{lhs} -> {rhs}"

    def __repr__(self) -> str:
        return f"Expression({str(self)!r})"

    def __pdoc__(self, **kwargs: object) -> object:
        # How `eqx.tree_pprint` and `print(spec_tree)` show it: as its text.
        import wadler_lindig

        return wadler_lindig.TextDoc(repr(self))

    @property
    def is_complete(self) -> bool:
        """`False` for the short form, whose left side is still to be given."""
        return self.lhs is not None

    @property
    def has_ellipsis(self) -> bool:
        """Whether the right side (and so the left) holds `...`."""
        return ... in self.rhs

    def span_of_rhs(self, index: int) -> tuple[int, int]:
        """The (start, end) columns in `text` of right-hand element `index`."""
        if index < len(self.rhs_spans):
            return self.rhs_spans[index]
        return (0, len(self.text))

    def error(self, rule: str, span: tuple[int, int] | None = None) -> ExpressionError:
        """An `ExpressionError` about this expression, with a caret under `span`."""
        text = self.text or str(self)
        start, end = span if span is not None else (0, len(text))
        return ExpressionError(text, start, rule, length=end - start)


# --------------------------------------------------------------------------- #
# The tokenizer.
# --------------------------------------------------------------------------- #

_Kind = Literal["name", "count", "star", "ellipsis", "arrow", "space", "open", "close"]


class _Token(NamedTuple):
    kind: _Kind
    text: str
    start: int
    end: int


def is_name_char(c: str) -> bool:
    return c == "_" or unicodedata.category(c)[0] == "L"


def is_logical_name(text: str) -> bool:
    """Whether `text` is a logical name, as of a dim in `dims` or an annotation: a
    letter or `_`, then letters, `_`, ASCII digits, `-` or `.` (`dim1`, `row-alias`).
    An expression writes one that is not also a name quoted (`'dim1'`)."""
    return bool(text) and is_name_char(text[0]) and all(map(is_quoted_char, text))


def is_name(text: str) -> bool:
    """Whether `text` is an einshard name, as of a dim or a mesh axis: letters (Unicode's
    category L) and `_`, at least one."""
    return bool(text) and all(map(is_name_char, text))


def _is_ascii_digit(c: str) -> bool:
    return "0" <= c <= "9"


def is_quoted_char(c: str) -> bool:
    """Whether a quoted name may hold `c`: a letter, `_`, an ASCII digit, `-` or `.`."""
    return is_name_char(c) or _is_ascii_digit(c) or c in "-."


def _scan_run(text: str, i: int, pred) -> int:
    n = len(text)
    while i < n and pred(text[i]):
        i += 1
    return i


def _tokens(text: str) -> Iterator[_Token]:
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            j = _scan_run(text, i, str.isspace)
            yield _Token("space", text[i:j], i, j)
        elif is_name_char(c):
            j = _scan_run(text, i, is_name_char)
            yield _Token("name", text[i:j], i, j)
        elif _is_ascii_digit(c):
            j = _scan_run(text, i, _is_ascii_digit)
            yield _Token("count", text[i:j], i, j)
        elif c == "*":
            j = i + 1
            yield _Token("star", c, i, j)
        elif text.startswith("...", i):
            j = i + 3
            yield _Token("ellipsis", "...", i, j)
        elif text.startswith("->", i):
            j = i + 2
            yield _Token("arrow", "->", i, j)
        elif c in "()":
            j = i + 1
            yield _Token("open" if c == "(" else "close", c, i, j)
        elif c == "'":
            j = _quoted_end(text, i)
            yield _Token("name", text[i + 1 : j - 1], i, j)
        else:
            raise ExpressionError(text, i, _unexpected_character(text, i))
        i = j


def _quoted_end(text: str, i: int) -> int:
    """The end of the quoted name that starts at `i`, past its closing quote.

    **Raises:** `ExpressionError` for a quote never closed, an empty name, a character
    a quoted name does not hold, or `_0`, `_1`, ..., the names of replication
    elements' mesh axes."""
    j = i + 1
    while j < len(text) and is_quoted_char(text[j]):
        j += 1
    if j == len(text):
        raise ExpressionError(
            text, i, "the quote is never closed; write a quoted name as 'dim1'", length=j - i
        )
    if text[j] != "'":
        raise ExpressionError(
            text,
            j,
            f"{text[j]!r} in a quoted name, which holds letters, '_', digits, '-' and '.'; "
            "close it with ' before this",
        )
    name = text[i + 1 : j]
    if not name:
        raise ExpressionError(text, i, "an empty quoted name ''; write the name inside", length=2)
    if not is_name_char(name[0]):
        raise ExpressionError(
            text,
            i + 1,
            f"the quoted name {name!r} starts with {name[0]!r}; a name starts with a letter or '_'",
        )
    if name[0] == "_" and name[1:].isdigit() and name[1:].isascii():
        raise ExpressionError(
            text,
            i,
            f"{name!r} is the name eqshard gives the mesh axis of a replication element; "
            "choose another name",
            length=j + 1 - i,
        )
    return j + 1


def _unexpected_character(text: str, i: int) -> str:
    c = text[i]
    if c == ".":
        return "a '.' must be part of '...', which stands for the axes that are not named"
    if c in "->":
        return "'-' and '>' must be written together as '->', which separates the sides"
    if c.isdigit():
        return (
            f"{c!r} is not an ASCII digit; write counts with the digits 0-9 "
            f"(it reads as {unicodedata.digit(c, '?')})"
        )
    if c in ",[]{}":
        return (
            f"unexpected character {c!r}; einshard expressions separate axes with "
            "spaces, and group names only with '(' and ')' on the left side"
        )
    return (
        f"unexpected character {c!r}; an expression holds axis names (letters and "
        "'_'), counts (digits), '*', '...', '->' and spaces"
    )


# --------------------------------------------------------------------------- #
# The parser.
# --------------------------------------------------------------------------- #


def _at(text: str, token: _Token, rule: str) -> ExpressionError:
    """An error with a caret under `token`."""
    return ExpressionError(text, token.start, rule, length=token.end - token.start)


def _runs(text: str, tokens: Sequence[_Token]) -> list[list[_Token]]:
    """Splits one side's tokens into elements at white space."""
    groups: list[list[_Token]] = []
    current: list[_Token] = []
    for token in tokens:
        if token.kind == "space":
            if current:
                groups.append(current)
                current = []
        else:
            current.append(token)
    if current:
        groups.append(current)
    return groups


_APART = ("space", "open", "close")  # what may touch a parenthesis


def _left_side(
    text: str, tokens: Sequence[_Token]
) -> tuple[tuple[LeftItem, ...], tuple[tuple[int, int], ...]]:
    """The left side's items, groups among them, and each item's span."""
    for before, token, after in zip([None, *tokens], tokens, [*tokens[1:], None]):
        if token.kind == "open" and before is not None and before.kind not in _APART:
            raise _missing_space(text, token)
        if token.kind == "close" and after is not None and after.kind not in _APART:
            raise _missing_space(text, after)
    items: list[LeftItem] = []
    spans: list[tuple[int, int]] = []
    opened: _Token | None = None
    members: list[str] = []
    for run in _runs(text, _spaced(tokens)):
        first = run[0]
        if first.kind == "open":
            if opened is not None:
                raise _at(text, first, "a group inside a group; a group is one level of names")
            opened, members = first, []
            continue
        if first.kind == "close":
            if opened is None:
                raise _at(text, first, "')' closes no group; open it with '(' before its names")
            if not members:
                raise ExpressionError(
                    text,
                    opened.start,
                    "an empty group '()'; name the axes its dim is split over, or drop it",
                    length=first.end - opened.start,
                )
            items.append(members[0] if len(members) == 1 else tuple(members))
            spans.append((opened.start, first.end))
            opened = None
            continue
        item = _parse_left(text, run)
        if opened is None:
            items.append(item)
            spans.append((first.start, run[-1].end))
        elif item is ...:
            raise _at(
                text,
                first,
                "'...' inside a group; a group names the axes one dim is split over",
            )
        else:
            assert isinstance(item, str)
            members.append(item)
    if opened is not None:
        raise _at(text, opened, "'(' is never closed; end the group with ')'")
    return tuple(items), tuple(spans)


def _spaced(tokens: Sequence[_Token]) -> list[_Token]:
    """`tokens` with a space token around each parenthesis, so that `_runs` gives
    each its own run: inside a group, `(a b)` and `( a b )` are one."""
    spaced: list[_Token] = []
    for token in tokens:
        if token.kind in ("open", "close"):
            spaced += [
                _Token("space", "", token.start, token.start),
                token,
                _Token("space", "", token.end, token.end),
            ]
        else:
            spaced.append(token)
    return spaced


def _parse_left(text: str, group: list[_Token]) -> LeftItem:
    first = group[0]
    if first.kind in ("count", "star"):
        raise _at(
            text,
            first,
            f"{first.text!r} on the left side; the left side only names the array's "
            "axes, and counts and stars go on the right",
        )
    if len(group) > 1:
        extra = group[1]
        if extra.kind in ("count", "star"):
            raise _at(
                text,
                extra,
                f"{first.text}{extra.text!s} on the left side; the left side only names "
                f"the array's axes: write {first.text!r} here and "
                f"'{first.text}{extra.text}' on the right",
            )
        raise _missing_space(text, extra)
    return ... if first.kind == "ellipsis" else first.text


def _missing_space(text: str, token: _Token) -> ExpressionError:
    return _at(
        text,
        token,
        f"{token.text!r} is joined to the element before it; separate elements with a space",
    )


MAX_COUNT_DIGITS = 12
"""Counts have at most this many digits: far more devices than any mesh has, and
well inside what Python converts from text (4,300 digits)."""


def _parse_count(text: str, token: _Token) -> int:
    digits = token.text
    if digits.startswith("0"):
        if digits.strip("0") == "":
            rule = "a count of 0 is not allowed; counts start at 1"
        else:
            stripped = digits.lstrip("0")
            shown = stripped if len(stripped) <= MAX_COUNT_DIGITS else f"{stripped[:12]}..."
            rule = f"count {digits[:24]!r} has a leading zero; write it as {shown!r}"
        raise _at(text, token, rule)
    if len(digits) > MAX_COUNT_DIGITS:
        raise _at(
            text,
            token,
            f"a count of {len(digits)} digits is more devices than any mesh has; counts "
            f"have at most {MAX_COUNT_DIGITS} digits",
        )
    return int(digits)


_ORDER = {"name": 0, "count": 1, "star": 2}


def _parse_right(text: str, group: list[_Token]) -> RightItem:
    for token in group:
        if token.kind in ("open", "close"):
            raise _at(
                text,
                token,
                f"{token.text!r} on the right side; a group is written on the left, "
                "'(a b) c', and each of its names is an element on the right, 'a2 c b4'",
            )
    if group[0].kind == "ellipsis":
        if len(group) > 1:
            raise _missing_space(text, group[1])
        return ...
    name: str | None = None
    count = 1
    star = False
    last = -1
    for token in group:
        if token.kind == "ellipsis":
            raise _missing_space(text, token)
        order = _ORDER[token.kind]
        if order <= last:
            raise _at(
                text,
                token,
                _misordered(token, group),
            )
        last = order
        if token.kind == "name":
            name = token.text
        elif token.kind == "count":
            count = _parse_count(text, token)
        else:
            star = True
    return Element(name, count, star)


def _misordered(token: _Token, group: list[_Token]) -> str:
    kinds = [t.kind for t in group]
    if token.kind == "name":
        before = "".join(t.text for t in group[: group.index(token)])
        return (
            f"{token.text!r} comes after {before!r}; an element is written name, then "
            f"count, then star (as in '{token.text}{before}'), or put a space "
            f"between them ('{before} {token.text}') to replicate"
        )
    if token.kind == "count" and "star" in kinds[: group.index(token)]:
        return f"the star comes after the count: write '{token.text}*'"
    if token.kind == "star":
        return "one '*' per element is enough"
    return "an element has at most one name, one count and one star; separate elements with a space"


def _side_error(text: str, position: int, side: str) -> ExpressionError:
    if side == "left":
        rule = (
            "the left side is empty; name the array's axes before '->' "
            "(a scalar is written '... -> ...')"
        )
    else:
        rule = "the right side is empty; write each axis after '->', with its count"
    return ExpressionError(text, position, rule)


def _check_ellipses(text: str, items: Sequence[object], spans, side: str) -> None:
    seen = False
    for item, (start, _) in zip(items, spans):
        if item is ...:
            if seen:
                raise ExpressionError(
                    text,
                    start,
                    f"'...' appears twice on the {side}; it may stand only once for the "
                    "axes that are not named",
                    length=3,
                )
            seen = True


def _check_unique(text: str, names: Sequence[str | None], spans, side: str) -> None:
    seen: set[str] = set()
    for name, (start, end) in zip(names, spans):
        if name is None:
            continue
        if name in seen:
            raise ExpressionError(
                text,
                start,
                f"axis {name!r} appears twice on the {side}; name each axis once",
                length=end - start,
            )
        seen.add(name)


def _left_names_at(
    text: str, lhs: Sequence[LeftItem], spans: Sequence[tuple[int, int]]
) -> tuple[str, list[str | None], list[tuple[int, int]]]:
    """`text`, the left side's names (a group's members each) and their spans (a
    member's, its group's), as `_check_unique` takes them."""
    names: list[str | None] = []
    at: list[tuple[int, int]] = []
    for item, span in zip(lhs, spans):
        members = item if isinstance(item, tuple) else (item if isinstance(item, str) else None,)
        names += members
        at += [span] * len(members)
    return text, names, at


def _check_sides_agree(
    text: str,
    lhs: tuple[LeftItem, ...],
    lhs_spans,
    rhs: tuple[RightItem, ...],
    rhs_spans,
) -> None:
    right_names = {item.name for item in rhs if isinstance(item, Element)}
    on_left = set(left_names(lhs))
    for item, (start, end) in zip(rhs, rhs_spans):
        if isinstance(item, Element) and item.name is not None and item.name not in on_left:
            raise ExpressionError(
                text,
                start,
                f"axis {item.name!r} is on the right but not on the left; add it to the "
                "left, or drop its name to replicate instead",
                length=end - start,
            )
    for item, (start, end) in zip(lhs, lhs_spans):
        if isinstance(item, str) and item not in right_names:
            raise ExpressionError(
                text,
                start,
                f"axis {item!r} is on the left but not on the right; name it on the "
                f"right too (write {item!r} to leave it whole)",
                length=end - start,
            )
        if isinstance(item, tuple):
            for member in item:
                if member not in right_names:
                    raise ExpressionError(
                        text,
                        start,
                        f"{member!r} of the group {item_text(item)} is not on the right; "
                        "name each of a group's axes on the right, with its count",
                        length=end - start,
                    )
    if (... in lhs) != (... in rhs):
        side, items, spans = ("left", lhs, lhs_spans) if ... in lhs else ("right", rhs, rhs_spans)
        start = spans[items.index(...)][0]
        other = "right" if side == "left" else "left"
        raise ExpressionError(
            text,
            start,
            f"'...' is on the {side} but not on the {other}; write it on both sides or on neither",
            length=3,
        )


def _split_at_arrow(
    text: str, tokens: list[_Token]
) -> tuple[list[_Token] | None, list[_Token], int]:
    arrows = [i for i, token in enumerate(tokens) if token.kind == "arrow"]
    if len(arrows) > 1:
        second = tokens[arrows[1]]
        raise ExpressionError(
            text, second.start, "a second '->'; an expression has exactly one", length=2
        )
    if not arrows:
        return None, tokens, 0
    i = arrows[0]
    return tokens[:i], tokens[i + 1 :], tokens[i].end


@functools.lru_cache(maxsize=4096)
def _parse_text(text: str) -> Expression:
    tokens = list(_tokens(text))
    left_tokens, right_tokens, arrow_end = _split_at_arrow(text, tokens)

    lhs: tuple[LeftItem, ...] | None = None
    lhs_spans: tuple[tuple[int, int], ...] = ()
    if left_tokens is not None:
        lhs, lhs_spans = _left_side(text, left_tokens)
        if not lhs:
            raise _side_error(text, max(arrow_end - 2, 0), "left")

    right_groups = _runs(text, right_tokens)
    if not right_groups:
        if left_tokens is None:
            raise ExpressionError(
                text,
                0,
                "the expression is empty; write 'x y -> x y*', or the short form 'x y*'",
            )
        raise _side_error(text, arrow_end, "right")
    rhs = tuple(_parse_right(text, group) for group in right_groups)
    rhs_spans = tuple((group[0].start, group[-1].end) for group in right_groups)

    _check_ellipses(text, rhs, rhs_spans, "right")
    _check_unique(
        text, [e.name if isinstance(e, Element) else None for e in rhs], rhs_spans, "right"
    )
    if lhs is not None:
        _check_ellipses(text, lhs, lhs_spans, "left")
        _check_unique(*_left_names_at(text, lhs, lhs_spans), "left")
        _check_sides_agree(text, lhs, lhs_spans, rhs, rhs_spans)
    return Expression._parsed(lhs, rhs, text, lhs_spans, rhs_spans)


def parse(expression: str | Expression) -> Expression:
    """Parses an einshard expression.

    **Example:**

    ```python
    expr = eqshard.expression.parse("a b -> 2 a2* b*")
    str(expr)                        # 'a b -> 2 a2* b*'
    eqshard.expression.parse("y* z").is_complete  # False: the short form
    ```

    **Arguments:**

    - `expression`: the text, such as `"x y -> x y*"`, or the short form (see "The short
        form"). An `Expression` is returned unchanged.

    **Returns:**

    A frozen, hashable `eqshard.expression.Expression`. Parsing is cached, so parsing the same text
    again costs a dictionary look-up.

    **Raises:**

    - `eqshard.ExpressionError` (an `EqshardError`, which is a `ValueError`): the text
        is not a valid einshard expression (see "Errors").

    !!! info "The short form"

        The short form is the right side alone, as in `"x y*"`. Its left side is given
        later, by an annotation.

    !!! info "Errors"

        `eqshard.ExpressionError` names the token at fault, with a caret under it. The
        faults are a malformed token, a name that appears twice on a side, a name on one
        side only, '...' on one side only, or a count of zero.
    """
    if isinstance(expression, Expression):
        return expression
    if not isinstance(expression, str):
        raise EqshardError(
            f"an einshard expression must be a string such as 'x y -> x y*', "
            f"not {type(expression).__name__}: {expression!r}"
        )
    return _parse_text(expression)
