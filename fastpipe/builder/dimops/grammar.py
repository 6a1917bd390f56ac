"""Parse and format dimension annotations (nnScaler style), SPEC §2.

An annotation says how an operator's tensors' dimensions relate::

    m^ kd+, kd+ n -> m^ n

Inputs are left of ``->`` and outputs right of it; tensors are separated by
``,`` and dimensions by spaces. Grammar (``pos`` in messages is the 0-based
character offset into the annotation text, as in ``text[pos]``)::

    annotation := [tensor ("," tensor)*] "->" tensor ("," tensor)*
    tensor     := "?" | dim (SPACE dim)*        # "?" only on the inputs side
    dim        := "*" | ident | "(" ident (SPACE ident)* ")"
    ident      := (NAME | NUMBER) ["+" | "^"]   # no space before the suffix

* ``NAME`` is a Python identifier; the same name means the same length.
* ``NUMBER`` is a decimal fixed size; numbers are never partitionable, so they
  are always ``^`` (writing ``4^`` is allowed, ``4+`` is an error).
* ``*`` stands for any number of dimensions taken from the shape; all ``*`` of
  one annotation expand identically; at most one per tensor; it takes no
  reduction and cannot be split.
* ``?`` is a whole input slot that is not a tensor (a scalar argument, ``None``)
  and is ignored.
* ``(h d)`` is one dimension made of several identifiers (a reshape), the
  first one outermost. A group holds at least one identifier, no ``*``, no
  ``?`` and no nested group; ``(h)`` is the same as ``h``. Reductions go on
  the identifiers inside, never after ``)``.
* Reduction suffix: none = spatial (outputs that have it are split too);
  ``+`` = partitionable, outputs lacking it become partial sums; ``^`` = not
  partitionable. Every occurrence of a name carries the same suffix.
* A name appears at most once per tensor; every output name appears in some
  input (numbers excepted); an output ``*`` needs an input ``*``.

A tensor always has at least one dimension: 0-d tensors cannot be written
(an ignored 0-d *input* can be written ``?``).

:func:`parse` returns frozen dataclasses, :func:`format_annotation` writes the
canonical text back (``parse(format_annotation(a)) == a`` for any parsed ``a``
without ``sizes``). Every error is an :class:`AnnotationError` whose one-line
message starts ``annotation "<text>": `` and names the position or identifier.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from fastpipe.builder.dimops.errors import AnnotationError, anno_error

REDUCTIONS = ("", "+", "^")
STAR = "*"


@dataclass(frozen=True)
class Ident:
    """One identifier: ``name`` (a Python identifier, a decimal number, or
    ``"*"``) and ``reduce`` (``""`` spatial, ``"+"`` sum-reduced, ``"^"`` not
    partitionable). ``pos`` is where the parser found it (not compared)."""

    name: str
    reduce: str = ""
    pos: int | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.reduce not in REDUCTIONS:
            raise AnnotationError(f"Ident {self.name!r}: reduce must be '', '+' or '^', found {self.reduce!r}")
        if self.name.isdigit() and self.reduce != "^":
            object.__setattr__(self, "reduce", "^")

    @property
    def is_number(self) -> bool:
        return self.name.isdigit()

    @property
    def is_star(self) -> bool:
        return self.name == STAR

    @property
    def is_name(self) -> bool:
        return not self.is_number and not self.is_star


@dataclass(frozen=True)
class Dim:
    """One tensor dimension: a single identifier, a group ``(h d)`` of several
    (first = outermost), or ``*``."""

    idents: tuple[Ident, ...]

    @property
    def is_group(self) -> bool:
        return len(self.idents) > 1

    @property
    def is_star(self) -> bool:
        return len(self.idents) == 1 and self.idents[0].is_star


@dataclass(frozen=True)
class TensorAnno:
    """The dimensions of one tensor, outermost first."""

    dims: tuple[Dim, ...]

    @property
    def names(self) -> tuple[str, ...]:
        """Names (not numbers, not ``*``) in order of appearance, groups flattened."""
        return tuple(i.name for d in self.dims for i in d.idents if i.is_name)

    @property
    def has_star(self) -> bool:
        return any(d.is_star for d in self.dims)


@dataclass(frozen=True)
class Annotation:
    """A parsed annotation. ``inputs[i]`` is ``None`` for a ``?`` slot.

    ``sizes`` holds known identifier sizes, ``(name, size)`` pairs sorted by
    name, that act as default keyword arguments of :func:`infer_shapes` and
    :func:`split` (the registry's ``view`` rule uses it for ``(h d)`` groups).
    It is not part of the text: :func:`format_annotation` does not write it.
    """

    inputs: tuple[TensorAnno | None, ...]
    outputs: tuple[TensorAnno, ...]
    sizes: tuple[tuple[str, int], ...] = ()

    @property
    def text(self) -> str:
        return format_annotation(self)

    def __str__(self) -> str:
        return self.text

    def reductions(self) -> dict[str, str]:
        """``{name: reduce}`` for every name of the annotation."""
        out: dict[str, str] = {}
        for t in self.inputs + self.outputs:
            if t is not None:
                for d in t.dims:
                    for i in d.idents:
                        if i.is_name:
                            out.setdefault(i.name, i.reduce)
        return out

    def with_sizes(self, **sizes: int) -> "Annotation":
        """A copy whose ``sizes`` are ``sizes`` (replacing the old ones)."""
        return replace(self, sizes=tuple(sorted(sizes.items())))


# ---------------------------------------------------------------- tokenizer


@dataclass(frozen=True)
class _Tok:
    kind: str  # name number * ? ( ) , -> + ^ bad end
    value: str
    pos: int
    space_before: bool


def _tokenize(text: str) -> list[_Tok]:
    toks: list[_Tok] = []
    i, n, space = 0, len(text), False
    while i < n:
        c = text[i]
        if c.isspace():
            i, space = i + 1, True
            continue
        if c.isdigit():
            j = i
            while j < n and text[j].isdigit():
                j += 1
            toks.append(_Tok("number", text[i:j], i, space))
        elif c.isidentifier():
            j = i + 1
            while j < n and ("a" + text[j]).isidentifier():
                j += 1
            toks.append(_Tok("name", text[i:j], i, space))
        elif text.startswith("->", i):
            j = i + 2
            toks.append(_Tok("->", "->", i, space))
        elif c in "*?(),+^":
            j = i + 1
            toks.append(_Tok(c, c, i, space))
        else:
            j = i + 1
            toks.append(_Tok("bad", c, i, space))
        i, space = j, False
    toks.append(_Tok("end", "", n, space))
    return toks


def _desc(tok: _Tok) -> str:
    if tok.kind == "end":
        return "end of annotation"
    if tok.kind in ("name", "number"):
        return f'"{tok.value}"'
    return f"'{tok.value}'"


# ---------------------------------------------------------------- parser


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.toks = _tokenize(text)
        self.i = 0

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def take(self) -> _Tok:
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def fail(self, pos: int | None, message: str) -> AnnotationError:
        where = "" if pos is None else f"position {pos}: "
        return anno_error(self.text, where + message)

    def parse(self) -> Annotation:
        inputs = self.side(is_input=True)
        tok = self.peek()
        if tok.kind == "end":
            raise self.fail(None, "missing '->' between the inputs and the outputs")
        self.take()  # '->' (side() stops only at '->' or end)
        outputs = self.side(is_input=False)
        tok = self.peek()
        if tok.kind == "->":
            raise self.fail(tok.pos, "a second '->' (an annotation has exactly one)")
        anno = Annotation(tuple(inputs), tuple(outputs))
        self.check(anno)
        return anno

    def side(self, is_input: bool) -> list[TensorAnno | None]:
        if is_input and self.peek().kind == "->":
            return []  # an op with no tensor inputs (arange, full, ...)
        tensors = []
        while True:
            tensors.append(self.tensor(is_input, len(tensors)))
            if self.peek().kind != ",":
                return tensors
            self.take()

    def tensor(self, is_input: bool, index: int) -> TensorAnno | None:
        tok = self.peek()
        if tok.kind == "?":
            if not is_input:
                raise self.fail(tok.pos, "an output cannot be '?' (outputs are tensors)")
            self.take()
            after = self.peek()
            if after.kind not in (",", "->", "end"):
                raise self.fail(after.pos, f"'?' must stand alone for a whole input, found {_desc(after)} after it")
            return None
        dims: list[Dim] = []
        while True:
            tok = self.peek()
            if dims and tok.kind in (",", "->", "end"):
                break
            if dims and tok.kind == ")":
                raise self.fail(tok.pos, "')' without a matching '('")
            if dims and tok.kind == "?":
                raise self.fail(tok.pos, "'?' must stand alone for a whole input, not be one of its dimensions")
            if dims and not tok.space_before:
                raise self.fail(tok.pos, f"expected a space, ',' or '->' after a dimension, found {_desc(tok)}")
            dims.append(self.dim(is_input))
        side = "input" if is_input else "output"
        self.check_tensor(dims, f"{side} {index}")
        return TensorAnno(tuple(dims))

    def dim(self, is_input: bool) -> Dim:
        expected = "an identifier, a number, '*', '?' or '('" if is_input else "an identifier, a number, '*' or '('"
        tok = self.take()
        if tok.kind == "*":
            after = self.peek()
            if after.kind in ("+", "^") and not after.space_before:
                raise self.fail(after.pos, f"'*' takes no reduction, found '{after.value}' after it")
            return Dim((Ident(STAR, "", tok.pos),))
        if tok.kind in ("name", "number"):
            return Dim((self.ident(tok),))
        if tok.kind == "(":
            return self.group(tok)
        if tok.kind in ("+", "^"):
            raise self.fail(tok.pos, f"expected {expected}, found '{tok.value}' (a reduction follows its identifier with no space)")
        raise self.fail(tok.pos, f"expected {expected}, found {_desc(tok)}")

    def group(self, open_tok: _Tok) -> Dim:
        idents: list[Ident] = []
        while True:
            tok = self.peek()
            if tok.kind == ")":
                if not idents:
                    raise self.fail(open_tok.pos, "empty group '()' (a group holds at least one identifier)")
                self.take()
                break
            if tok.kind == "(":
                raise self.fail(tok.pos, "nested groups are not allowed")
            if tok.kind == "*":
                raise self.fail(tok.pos, "'*' cannot be inside a group")
            if tok.kind == "?":
                raise self.fail(tok.pos, "'?' cannot be inside a group")
            if tok.kind in (",", "->", "end"):
                raise self.fail(tok.pos, f"expected ')' to close the group opened at position {open_tok.pos}, found {_desc(tok)}")
            if tok.kind not in ("name", "number"):
                raise self.fail(tok.pos, f"expected an identifier or a number inside a group, found {_desc(tok)}")
            if idents and not tok.space_before:
                raise self.fail(tok.pos, f"expected a space or ')' after an identifier in a group, found {_desc(tok)}")
            self.take()
            idents.append(self.ident(tok))
        after = self.peek()
        if after.kind in ("+", "^") and not after.space_before:
            raise self.fail(after.pos, f"a reduction goes on an identifier inside the group, found '{after.value}' after ')'")
        return Dim(tuple(idents))

    def ident(self, tok: _Tok) -> Ident:
        reduce = ""
        after = self.peek()
        if after.kind in ("+", "^") and not after.space_before:
            self.take()
            reduce = after.kind
        if tok.kind == "number":
            if reduce == "+":
                raise self.fail(after.pos, f"number \"{tok.value}\" cannot take '+' (numbers are fixed sizes, always '^')")
            return Ident(str(int(tok.value)), "^", tok.pos)
        return Ident(tok.value, reduce, tok.pos)

    def check_tensor(self, dims: list[Dim], where: str) -> None:
        seen: set[str] = set()
        star_seen = False
        for d in dims:
            for i in d.idents:
                if i.is_star:
                    if star_seen:
                        raise self.fail(i.pos, f"a second '*' in {where} (at most one per tensor)")
                    star_seen = True
                elif i.is_name:
                    if i.name in seen:
                        raise self.fail(i.pos, f'identifier "{i.name}" appears twice in {where}')
                    seen.add(i.name)

    def check(self, anno: Annotation) -> None:
        first: dict[str, Ident] = {}
        for t in anno.inputs + anno.outputs:
            for d in t.dims if t is not None else ():
                for i in d.idents:
                    if not i.is_name:
                        continue
                    f = first.setdefault(i.name, i)
                    if f.reduce != i.reduce:
                        raise self.fail(
                            i.pos,
                            f'identifier "{i.name}" is "{i.name}{i.reduce}" here but "{f.name}{f.reduce}" '
                            f"at position {f.pos} (every occurrence needs the same reduction)",
                        )
        in_names = {n for t in anno.inputs if t is not None for n in t.names}
        in_star = any(t is not None and t.has_star for t in anno.inputs)
        for t in anno.outputs:
            for d in t.dims:
                for i in d.idents:
                    if i.is_name and i.name not in in_names:
                        raise anno_error(self.text, f'output identifier "{i.name}" appears in no input')
                    if i.is_star and not in_star:
                        raise self.fail(i.pos, "output '*' needs a '*' in some input")


@functools.lru_cache(maxsize=4096)
def _parse_cached(text: str) -> Annotation:
    return _Parser(text).parse()


def parse(text: str) -> Annotation:
    """Parse an annotation string (see the module docstring for the grammar)."""
    if isinstance(text, Annotation):
        return text
    if not isinstance(text, str):
        raise AnnotationError(f"an annotation must be a string, found {type(text).__name__}")
    return _parse_cached(text)


# ---------------------------------------------------------------- format


def _fmt_ident(i: Ident) -> str:
    return i.name if (i.is_number or i.is_star) else i.name + i.reduce


def _fmt_dim(d: Dim) -> str:
    if d.is_group:
        return "(" + " ".join(_fmt_ident(i) for i in d.idents) + ")"
    return _fmt_ident(d.idents[0])


def format_tensor(t: TensorAnno | None) -> str:
    """``"m k+"``, ``"(h d^)"``, ``"?"`` for ``None``."""
    return "?" if t is None else " ".join(_fmt_dim(d) for d in t.dims)


def format_annotation(anno: Annotation) -> str:
    """The canonical text: ``"m k+, k+ n -> m n"``; numbers without ``^``;
    ``"-> 4 5"`` when there are no inputs. ``sizes`` is not written."""
    ins = ", ".join(format_tensor(t) for t in anno.inputs)
    outs = ", ".join(format_tensor(t) for t in anno.outputs)
    return f"{ins} -> {outs}" if ins else f"-> {outs}"


format = format_annotation  # noqa: A001  (the name the design uses; shadows the builtin only here)
