"""The annotation grammar of fastpipe.builder.dimops: parse, format, errors."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpipe.builder.dimops import AnnotationError, format_annotation, parse
from fastpipe.builder.dimops.grammar import Annotation, Dim, Ident, TensorAnno
from fastpipe.errors import InvalidInput


def T(*dims):
    """TensorAnno from dims given as 'k+' / ('h', 'd^') / '*'."""
    out = []
    for d in dims:
        names = d if isinstance(d, tuple) else (d,)
        idents = []
        for n in names:
            if n[-1] in "+^" and n != "*":
                idents.append(Ident(n[:-1], n[-1]))
            else:
                idents.append(Ident(n, ""))
        out.append(Dim(tuple(idents)))
    return TensorAnno(tuple(out))


# ---------------------------------------------------------------- the grammar


def test_spec_example():
    a = parse("m^ kd+, kd+ n -> m^ n")
    assert a == Annotation((T("m^", "kd+"), T("kd+", "n")), (T("m^", "n"),))
    assert a.reductions() == {"m": "^", "kd": "+", "n": ""}


def test_three_reductions():
    a = parse("a b+ c^, b+ -> a c^")
    dims = a.inputs[0].dims
    assert [(d.idents[0].name, d.idents[0].reduce) for d in dims] == [("a", ""), ("b", "+"), ("c", "^")]


def test_numbers_are_fixed_and_always_caret():
    a = parse("a 4, 4^ a -> 4 a")
    four = a.inputs[0].dims[1].idents[0]
    assert four.name == "4" and four.reduce == "^" and four.is_number
    assert a.inputs[1].dims[0].idents[0] == four
    assert parse("a 007 -> a").inputs[0].dims[1].idents[0].name == "7"
    assert format_annotation(parse("a 4^ -> a 4^")) == "a 4 -> a 4"


def test_star_and_question_mark():
    a = parse("* m k+, ?, * k+ n -> * m n")
    assert a.inputs[1] is None
    assert a.inputs[0].dims[0].is_star and a.inputs[0].has_star
    assert a.outputs[0].dims[0].is_star
    assert a.inputs[0].names == ("m", "k")


def test_groups():
    a = parse("b s (h d^) -> b h s d^")
    g = a.inputs[0].dims[2]
    assert g.is_group and [i.name for i in g.idents] == ["h", "d"]
    assert g.idents[1].reduce == "^"
    assert parse("(a 2) -> a 2").inputs[0].dims[0].idents[1].is_number
    # a one-identifier group is the identifier itself
    assert parse("(a) b -> a b") == parse("a b -> a b")
    # groups on outputs, spaces inside parentheses
    assert parse("a b -> ( a b )") == Annotation((T("a", "b"),), (T(("a", "b")),))


def test_no_inputs_and_identifiers():
    a = parse("-> 3 4")
    assert a.inputs == () and a.outputs == (T("3", "4"),)
    assert parse("  -> 3").inputs == ()
    a = parse("_x y_1 héad -> _x y_1 héad")
    assert a.inputs[0].names == ("_x", "y_1", "héad")


def test_multiple_outputs_and_whitespace():
    a = parse("a\tb  ,b   ->a , b")
    assert a == Annotation((T("a", "b"), T("b")), (T("a"), T("b")))


def test_same_name_in_different_tensors_and_numbers_repeat():
    parse("a a2, a2 a -> a")
    parse("4 4 -> 4")  # numbers are not identifiers: repeating is fine


def test_parse_is_cached_and_accepts_annotation():
    a = parse("m k+, k+ n -> m n")
    assert parse(a) is a
    assert parse("m k+, k+ n -> m n") is a


def test_annotation_is_hashable_and_frozen():
    a = parse("m k+, k+ n -> m n")
    assert hash(a) == hash(parse("m  k+,k+ n->m n"))
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"^cannot assign to field 'inputs'$"):
        a.inputs = ()


def test_with_sizes():
    a = parse("b (h d) -> b h d").with_sizes(h=4)
    assert a.sizes == (("h", 4),)
    assert a != parse("b (h d) -> b h d")
    assert str(a) == "b (h d) -> b h d"


# ---------------------------------------------------------------- format round trip


@pytest.mark.parametrize(
    "text",
    [
        "m k+, k+ n -> m n",
        "m^ kd+, kd+ n -> m^ n",
        "* m k+, * k+ n -> * m n",
        "b s (h d^) -> b h s d^",
        "?, a 4, ? -> a",
        "-> 3 4",
        "a b+ -> a, a 1",
        "b h s d^, b h t^ d^, b h t^ e -> b h s e",
    ],
)
def test_round_trip_canonical(text):
    a = parse(text)
    assert format_annotation(a) == text
    assert parse(format_annotation(a)) == a
    assert str(a) == a.text == text


def test_format_normalizes():
    assert format_annotation(parse("a  b+,b+->  (a) ")) == "a b+, b+ -> a"


@st.composite
def annotations(draw):
    """Valid annotation text built from a random structure."""
    names = ["a", "b", "k", "h", "dd"]
    red = {n: draw(st.sampled_from(["", "+", "^"])) for n in names}

    def ident(n):
        return n + red[n]

    def tensor(pool, allow_star):
        k = draw(st.integers(1, 4))
        chosen = draw(st.lists(st.sampled_from(pool), min_size=0, max_size=len(pool), unique=True)) if pool else []
        dims, used = [], list(chosen)
        while used:
            if len(used) >= 2 and draw(st.booleans()):
                dims.append("(" + " ".join(ident(x) for x in used[:2]) + ")")
                used = used[2:]
            else:
                dims.append(ident(used.pop(0)))
        for _ in range(draw(st.integers(0, 1))):
            dims.insert(draw(st.integers(0, len(dims))), str(draw(st.integers(1, 9))))
        if allow_star and draw(st.booleans()):
            dims.insert(draw(st.integers(0, len(dims))), "*")
        if not dims:
            dims = [str(k)]
        return " ".join(dims)

    star_in = draw(st.booleans())
    ins = [tensor(names, star_in) for _ in range(draw(st.integers(0, 3)))]
    if ins and draw(st.booleans()):
        ins.insert(draw(st.integers(0, len(ins))), "?")
    used = sorted({n for t in ins for n in names if any(tok.strip("()+^") == n for tok in t.split())})
    outs = [tensor(used, star_in and any("*" in t for t in ins)) for _ in range(draw(st.integers(1, 2)))]
    return ", ".join(ins) + " -> " + ", ".join(outs)


@settings(max_examples=150, deadline=None)
@given(annotations())
def test_round_trip_generated(text):
    a = parse(text)
    f = format_annotation(a)
    assert parse(f) == a
    assert format_annotation(parse(f)) == f


TOKENS = ["a", "b", "k", "4", "*", "?", "(", ")", ",", "->", "+", "^", " ", " ", "!"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), max_size=14))
def test_any_text_parses_or_fails_cleanly(tokens):
    text = "".join(tokens)
    try:
        a = parse(text)
    except AnnotationError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith(f'annotation "{text}": ')
        return
    assert parse(format_annotation(a)) == a


# ---------------------------------------------------------------- errors


ERRORS = [
    ("m k+, k+ n -> m q", 'output identifier "q" appears in no input'),
    ("m k, ) n -> m", "position 5: expected an identifier, a number, '*', '?' or '(', found ')'"),
    (
        "m k+, k^ n -> m n",
        'position 6: identifier "k" is "k^" here but "k+" at position 2 (every occurrence needs the same reduction)',
    ),
    ("m k+, k+ n -> m k", 'position 16: identifier "k" is "k" here but "k+" at position 2 (every occurrence needs the same reduction)'),
    ("m 4+ -> m", "position 3: number \"4\" cannot take '+' (numbers are fixed sizes, always '^')"),
    ("a () -> a", "position 2: empty group '()' (a group holds at least one identifier)"),
    ("a (b (c d)) -> a", "position 5: nested groups are not allowed"),
    ("(a *) -> a", "position 3: '*' cannot be inside a group"),
    ("(a ?) -> a", "position 3: '?' cannot be inside a group"),
    ("a b a -> a b", 'position 4: identifier "a" appears twice in input 0'),
    ("a (b a) -> a b", 'position 5: identifier "a" appears twice in input 0'),
    ("a -> a b", 'output identifier "b" appears in no input'),
    ("a b -> b b", 'position 9: identifier "b" appears twice in output 0'),
    ("m k", "missing '->' between the inputs and the outputs"),
    ("", "position 0: expected an identifier, a number, '*', '?' or '(', found end of annotation"),
    ("a -> a -> a", "position 7: a second '->' (an annotation has exactly one)"),
    ("* a * -> a", "position 4: a second '*' in input 0 (at most one per tensor)"),
    ("*+ a -> a", "position 1: '*' takes no reduction, found '+' after it"),
    ("a -> ?", "position 5: an output cannot be '?' (outputs are tensors)"),
    ("? a -> a", "position 2: '?' must stand alone for a whole input, found \"a\" after it"),
    ("a ? -> a", "position 2: '?' must stand alone for a whole input, not be one of its dimensions"),
    ("(a b)+ -> a", "position 5: a reduction goes on an identifier inside the group, found '+' after ')'"),
    ("(a b -> a", "position 5: expected ')' to close the group opened at position 0, found '->'"),
    ("a b) -> a", "position 3: ')' without a matching '('"),
    ("a! -> a", "position 1: expected a space, ',' or '->' after a dimension, found '!'"),
    ("a, ! -> a", "position 3: expected an identifier, a number, '*', '?' or '(', found '!'"),
    ("a(b c) -> a", "position 1: expected a space, ',' or '->' after a dimension, found '('"),
    ("a+^ -> a", "position 2: expected a space, ',' or '->' after a dimension, found '^'"),
    ("a ->", "position 4: expected an identifier, a number, '*' or '(', found end of annotation"),
    ("a, -> a", "position 3: expected an identifier, a number, '*', '?' or '(', found '->'"),
    ("a -> a,", "position 7: expected an identifier, a number, '*' or '(', found end of annotation"),
    ("a -> * a", "position 5: output '*' needs a '*' in some input"),
    ("a + -> a", "position 2: expected an identifier, a number, '*', '?' or '(', found '+' (a reduction follows its identifier with no space)"),
    ("(a b+c) -> a", "position 5: expected a space or ')' after an identifier in a group, found \"c\""),
    ("(a -) -> a", "position 3: expected an identifier or a number inside a group, found '-'"),
    ("4k -> 4", "position 1: expected a space, ',' or '->' after a dimension, found \"k\""),
]


@pytest.mark.parametrize("text,message", ERRORS)
def test_errors(text, message):
    with pytest.raises(AnnotationError) as info:
        parse(text)
    assert str(info.value) == f'annotation "{text}": {message}'
    assert "\n" not in str(info.value)


def test_error_class():
    assert issubclass(AnnotationError, InvalidInput)
    with pytest.raises(AnnotationError) as info:
        parse("m k")
    assert info.value.exit_code == 2


def test_non_string():
    with pytest.raises(AnnotationError, match="an annotation must be a string, found int"):
        parse(5)
