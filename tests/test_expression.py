import contextlib
import pickle
import re

import pytest
from hypothesis import given, settings, strategies as st

import eqshard
from eqshard import EqshardError, ExpressionError, SpecError
from eqshard.expression import Element, Expression

# (text, lhs, rhs) with rhs written as (name, count, star) or ... for '...'.
VALID = [
    ("x y -> x y*", ("x", "y"), [("x", 1, False), ("y", 1, True)]),
    ("a b -> 2 a2 b4", ("a", "b"), [(None, 2, False), ("a", 2, False), ("b", 4, False)]),
    ("a b -> * a2 b", ("a", "b"), [(None, 1, True), ("a", 2, False), ("b", 1, False)]),
    ("a b -> 2 a2* b*", ("a", "b"), [(None, 2, False), ("a", 2, True), ("b", 1, True)]),
    (
        "a ... d -> 4 a2 ... d2",
        ("a", ..., "d"),
        [(None, 4, False), ("a", 2, False), ..., ("d", 2, False)],
    ),
    ("... -> * ...", (...,), [(None, 1, True), ...]),
    ("a->a", ("a",), [("a", 1, False)]),
    ("  a   b->b2*   a  ", ("a", "b"), [("b", 2, True), ("a", 1, False)]),
    ("a -> a 1", ("a",), [("a", 1, False), (None, 1, False)]),
    ("a -> a 2*", ("a",), [("a", 1, False), (None, 2, True)]),
    ("a -> a12*", ("a",), [("a", 12, True)]),
    ("über_x ωz -> ωz* über_x2", ("über_x", "ωz"), [("ωz", 1, True), ("über_x", 2, False)]),
    ("a\tb\n->\u3000a b*", ("a", "b"), [("a", 1, False), ("b", 1, True)]),
]


def _rhs(items):
    return tuple(... if item is ... else Element(*item) for item in items)


@pytest.mark.parametrize(("text", "lhs", "rhs"), VALID)
def test_parse_valid(text, lhs, rhs):
    expr = eqshard.expression.parse(text)
    assert expr.lhs == lhs
    assert expr.rhs == _rhs(rhs)
    assert expr.is_complete
    assert expr.text == text
    again = eqshard.expression.parse(str(expr))
    assert again == expr
    assert hash(again) == hash(expr)
    assert str(again) == str(expr)


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("a->a", "a -> a"),
        ("a b -> a1 b1*", "a b -> a b*"),
        ("a -> a 1", "a -> a 1"),
        ("a -> a 1*", "a -> a *"),
        ("... ->   * ...", "... -> * ..."),
        ("x y*", "x y*"),
        ("  out2*   in ", "out2* in"),
    ],
)
def test_canonical_text(text, canonical):
    assert str(eqshard.expression.parse(text)) == canonical


def test_short_form_is_incomplete():
    expr = eqshard.expression.parse("out* in")
    assert not expr.is_complete
    assert expr.lhs is None
    assert expr.rhs == (Element("out", 1, True), Element("in"))
    assert repr(expr) == "Expression('out* in')"


def test_expression_is_frozen_hashable_and_compared_by_meaning():
    a, b = eqshard.expression.parse("a b -> a b*"), eqshard.expression.parse("a  b->a1 b*")
    assert a == b
    assert len({a, b}) == 1
    assert a.text != b.text
    with pytest.raises(AttributeError):
        a.lhs = ("c",)  # type: ignore[misc]
    assert eqshard.expression.parse("a b -> a b*") != eqshard.expression.parse("a b -> a* b")
    assert eqshard.expression.parse("a b*") != eqshard.expression.parse("a b -> a b*")
    assert pickle.loads(pickle.dumps(a)) == a


def test_parse_is_cached():
    text = "cache_me -> cache_me*"
    assert eqshard.expression.parse(text) is eqshard.expression.parse(text)
    expr = eqshard.expression.parse(text)
    assert eqshard.expression.parse(expr) is expr


# (text, caret column, caret length, the rule) -- the messages are pinned.
ERRORS = [
    (
        "a b -> a c",
        9,
        1,
        "axis 'c' is on the right but not on the left; add it to the left, or drop its name to replicate instead",
    ),
    (
        "a b -> a",
        2,
        1,
        "axis 'b' is on the left but not on the right; name it on the right too (write 'b' to leave it whole)",
    ),
    ("a a -> a", 2, 1, "axis 'a' appears twice on the left; name each axis once"),
    ("a b -> a2 b a*", 12, 2, "axis 'a' appears twice on the right; name each axis once"),
    ("a -> a0", 6, 1, "a count of 0 is not allowed; counts start at 1"),
    ("a -> 0", 5, 1, "a count of 0 is not allowed; counts start at 1"),
    ("a -> a007", 6, 3, "count '007' has a leading zero; write it as '7'"),
    ("a -> a**", 7, 1, "one '*' per element is enough"),
    ("a -> *2 a", 6, 1, "the star comes after the count: write '2*'"),
    (
        "a -> 2a",
        6,
        1,
        "'a' comes after '2'; an element is written name, then count, then star (as in 'a2'), or put a space between them ('2 a') to replicate",
    ),
    (
        "a2 -> a",
        1,
        1,
        "a2 on the left side; the left side only names the array's axes: write 'a' here and 'a2' on the right",
    ),
    (
        "* a -> a",
        0,
        1,
        "'*' on the left side; the left side only names the array's axes, and counts and stars go on the right",
    ),
    (
        "a ... -> a",
        2,
        3,
        "'...' is on the left but not on the right; write it on both sides or on neither",
    ),
    (
        "a -> a ...",
        7,
        3,
        "'...' is on the right but not on the left; write it on both sides or on neither",
    ),
    (
        "... a ... -> a ...",
        6,
        3,
        "'...' appears twice on the left; it may stand only once for the axes that are not named",
    ),
    (
        "a... -> a ...",
        1,
        3,
        "'...' is joined to the element before it; separate elements with a space",
    ),
    ("a -> a -> a", 7, 2, "a second '->'; an expression has exactly one"),
    ("", 0, 1, "the expression is empty; write 'x y -> x y*', or the short form 'x y*'"),
    ("   ", 0, 1, "the expression is empty; write 'x y -> x y*', or the short form 'x y*'"),
    (
        "-> a",
        0,
        1,
        "the left side is empty; name the array's axes before '->' (a scalar is written '... -> ...')",
    ),
    ("a ->", 4, 1, "the right side is empty; write each axis after '->', with its count"),
    ("a. -> a", 1, 1, "a '.' must be part of '...', which stands for the axes that are not named"),
    ("a - > a", 2, 1, "'-' and '>' must be written together as '->', which separates the sides"),
    (
        "a, b -> a b",
        1,
        1,
        "unexpected character ','; einshard expressions separate axes with spaces, and group names only with '(' and ')' on the left side",
    ),
    ("(a b -> a b", 0, 1, "'(' is never closed; end the group with ')'"),
    ("a b) -> a b", 3, 1, "')' closes no group; open it with '(' before its names"),
    ("() a -> a", 0, 2, "an empty group '()'; name the axes its dim is split over, or drop it"),
    ("(a (b c)) -> a b c", 3, 1, "a group inside a group; a group is one level of names"),
    (
        "(a ...) -> a ...",
        3,
        3,
        "'...' inside a group; a group names the axes one dim is split over",
    ),
    (
        "(a b) -> a2 (b)",
        12,
        1,
        "'(' on the right side; a group is written on the left, '(a b) c', and each of its names is an element on the right, 'a2 c b4'",
    ),
    (
        "(a b) -> a2",
        0,
        5,
        "'b' of the group (a b) is not on the right; name each of a group's axes on the right, with its count",
    ),
    ("(a b) a -> a b", 6, 1, "axis 'a' appears twice on the left; name each axis once"),
    (
        "'dim1 -> a",
        5,
        1,
        "' ' in a quoted name, which holds letters, '_', digits, '-' and '.'; close it with ' before this",
    ),
    (
        "'a/b' -> a",
        2,
        1,
        "'/' in a quoted name, which holds letters, '_', digits, '-' and '.'; close it with ' before this",
    ),
    ("a -> 'a", 5, 2, "the quote is never closed; write a quoted name as 'dim1'"),
    ("'' -> a", 0, 2, "an empty quoted name ''; write the name inside"),
    ("'1a' -> a", 1, 1, "the quoted name '1a' starts with '1'; a name starts with a letter or '_'"),
    (
        "'_0' -> '_0'2",
        0,
        4,
        "'_0' is the name eqshard gives the mesh axis of a replication element; choose another name",
    ),
    (
        "(a b)c -> a b c",
        5,
        1,
        "'c' is joined to the element before it; separate elements with a space",
    ),
    (
        "c(a b) -> a b c",
        1,
        1,
        "'(' is joined to the element before it; separate elements with a space",
    ),
    (
        "(a2 b) -> a2 b",
        2,
        1,
        "a2 on the left side; the left side only names the array's axes: write 'a' here and 'a2' on the right",
    ),
    (
        "a1 -> a",
        1,
        1,
        "a1 on the left side; the left side only names the array's axes: write 'a' here and 'a1' on the right",
    ),
    (
        "x$ -> x",
        1,
        1,
        "unexpected character '$'; an expression holds axis names (letters and '_'), counts (digits), '*', '...', '->' and spaces",
    ),
    (
        "a -> a٣",
        6,
        1,
        "'٣' is not an ASCII digit; write counts with the digits 0-9 (it reads as 3)",
    ),
    ("x* y2* x", 7, 1, "axis 'x' appears twice on the right; name each axis once"),
]


@pytest.mark.parametrize(("text", "column", "length", "rule"), ERRORS)
def test_parse_errors_are_pinned(text, column, length, rule):
    with pytest.raises(ExpressionError) as info:
        eqshard.expression.parse(text)
    error = info.value
    assert isinstance(error, EqshardError)
    assert isinstance(error, ValueError)
    assert error.expression == text
    assert (error.position, error.length, error.rule) == (column, length, rule)
    lines = str(error).split("\n")
    assert lines[0] == "bad einshard expression:"
    assert lines[1] == f"    {text}"
    assert lines[2] == " " * (4 + column) + "^" * length
    assert lines[3] == rule


def test_error_class_reports_public_module():
    assert ExpressionError.__module__ == "eqshard"
    assert EqshardError.__module__ == "eqshard"
    error = pickle.loads(pickle.dumps(ExpressionError("a -> b", 5, "rule", length=1)))
    assert (error.expression, error.position, error.rule) == ("a -> b", 5, "rule")


def test_caret_counts_wide_characters():
    with pytest.raises(ExpressionError) as info:
        eqshard.expression.parse("軸 b -> 軸 c")
    assert str(info.value).split("\n")[2] == " " * (4 + 11) + "^"  # each 軸 takes two columns


def test_the_caret_lines_up_under_tabs_and_hides_control_characters():
    with pytest.raises(ExpressionError) as info:
        eqshard.expression.parse("a\tb -> a\x1b[2K c")
    lines = str(info.value).split("\n")
    assert lines[1] == "    a b -> a\ufffd[2K c"
    assert "\x1b" not in str(info.value)


def test_counts_of_thousands_of_digits_are_expression_errors():
    with pytest.raises(ExpressionError, match="a count of 5000 digits is more devices"):
        eqshard.expression.parse("a -> a" + "9" * 5000)
    with pytest.raises(SpecError) as info:
        eqshard.load(
            {
                "eqshard": 1,
                "rules": [{"path": "w", "expr": "a -> a" + "9" * 5000}],
                "dims": {"mlp": "9" * 5000 + "*"},
            }
        )
    assert [p.where for p in info.value.problems] == [
        "<mapping>::$.dims.mlp",
        "<mapping>::$.rules[0].expr",
    ]


def test_non_string_is_an_eqshard_error():
    with pytest.raises(
        EqshardError, match=re.escape("must be a string such as 'x y -> x y*', not int: 3")
    ):
        eqshard.expression.parse(3)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- #
# Properties.
# --------------------------------------------------------------------------- #

_names = st.lists(
    st.text(alphabet=st.sampled_from("abcxyzαβ_Ω"), min_size=1, max_size=3),
    min_size=1,
    max_size=4,
    unique=True,
)
_modifier = st.tuples(st.integers(1, 12), st.booleans())


@st.composite
def valid_expressions(draw):
    names = draw(_names)
    ellipsis = draw(st.booleans())
    left: list = list(names)
    right: list = [Element(n, *draw(_modifier)) for n in draw(st.permutations(names))]
    for _ in range(draw(st.integers(0, 2))):
        count, star = draw(_modifier)
        right.insert(draw(st.integers(0, len(right))), Element(None, count, star))
    if ellipsis:
        left.insert(draw(st.integers(0, len(left))), ...)
        right.insert(draw(st.integers(0, len(right))), ...)
    short = draw(st.booleans())
    sep = draw(st.sampled_from([" ", "  ", "\t"]))
    arrow = draw(st.sampled_from(["->", " -> ", "  ->"]))

    def text(item):
        return "..." if item is ... else str(item)

    rhs = sep.join(text(item) for item in right)
    string = rhs if short else sep.join(text(item) for item in left) + arrow + rhs
    return string, (None if short else tuple(left)), tuple(right)


@given(valid_expressions())
@settings(max_examples=300, deadline=None)
def test_valid_expressions_round_trip(case):
    string, lhs, rhs = case
    expr = eqshard.expression.parse(string)
    assert expr.lhs == lhs
    assert expr.rhs == rhs
    assert eqshard.expression.parse(str(expr)) == expr


_alphabet = st.sampled_from([*list("ab x*2 0 1.-> ..."), "->", "...", "ω", "٣", "$", "\t"])


@given(st.lists(_alphabet, max_size=14).map("".join))
@settings(max_examples=500, deadline=None)
def test_any_string_parses_or_raises_expression_error(string):
    try:
        expr = eqshard.expression.parse(string)
    except ExpressionError as error:
        assert 0 <= error.position <= len(string)
        assert error.rule
        return
    assert eqshard.expression.parse(str(expr)) == expr


@given(st.text(max_size=20))
@settings(max_examples=300, deadline=None)
def test_any_text_parses_or_raises_expression_error(string):
    with contextlib.suppress(ExpressionError):
        eqshard.expression.parse(string)


def test_unpickled_expressions_hash_afresh_in_another_process(run_python, tmp_path):
    expr = eqshard.expression.parse("a b -> a b*")
    hash(expr)  # caches the hash in this process
    path = tmp_path / "expr.pickle"
    path.write_bytes(pickle.dumps(expr))
    code = (
        "import pickle, sys, eqshard; e = pickle.load(open(sys.argv[1], 'rb')); "
        "print(e in {eqshard.expression.parse('a b -> a b*')}, e == eqshard.expression.parse('a b -> a b*'))"
    )
    result = run_python(["-c", code, str(path)], env={"PYTHONHASHSEED": "12345"})
    assert result.stdout.split() == ["True", "True"], result.stderr


def test_elements_refuse_bad_counts():
    with pytest.raises(EqshardError, match="an element's count is a whole number from 1, not 0"):
        Element("a", 0)


@pytest.mark.parametrize(
    "build",
    [
        lambda: Expression(("a",), ()),
        lambda: Expression(("a",), (Element("b", 8),)),
        lambda: Expression(("a",), (Element("a", 8), ...)),
    ],
    ids=["no right side", "a name on one side only", "'...' on one side only"],
)
def test_hand_built_expressions_are_validated(build):
    with pytest.raises(EqshardError, match="is not a valid einshard expression"):
        build()


def test_hand_built_expressions_that_are_valid_are_accepted():
    expr = Expression(("a", "b"), (Element("a", 2, True), Element("b")))
    assert expr == eqshard.expression.parse("a b -> a2* b")
