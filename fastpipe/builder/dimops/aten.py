"""Annotations of the aten ops transformer models lower to.

Fixed annotations are strings; ops whose annotation depends on their
arguments (ranks, dims, target shapes) have factories ``fn(*args, **kwargs)``
(see :mod:`fastpipe.builder.dimops.registry`). A factory returns ``None`` for a
call it cannot describe (chiefly a 0-d output, which annotations cannot
write, or arguments torch itself would reject); such a call has no
annotation, and a builder must not split it.

Choices worth knowing:

* contractions: ``k+`` (``mm``, ``bmm``, ``matmul``, ``linear`` without bias);
  with an added bias (``addmm`` with ``beta != 0``, ``linear`` with bias) k is
  ``k^``: a replicated bias would be summed n times (split such an op as
  ``mm`` + ``add``).
* reductions: ``sum`` dims are ``+``; ``mean`` dims are ``^`` (a sum of means
  is not the mean); ``softmax``/``log_softmax`` dim and ``layer_norm``'s
  normalized dims are ``^``.
* ``view``/``reshape``: matching runs of dims become groups, ``(a b^) -> a
  b^``, with the sizes of all but the last identifier of an input group in
  ``Annotation.sizes``; only a group's outermost identifier is partitionable.
  Size-1 dims are ``1``; runs that are groups on both sides become numbers.
* pieces of one dim (``cat``, ``split``, ``slice``, ``select``, new dims of
  ``expand``): numbers, i.e. not partitionable along that dim.
* ``scaled_dot_product_attention``: ``b h s d^, b h t^ d^, b h t^ e -> b h s e``
  (``s^`` when ``is_causal``, whose mask is anchored at query 0; the head dims
  are ``^`` under GQA); a mask broadcasts against ``b h s t^``. The CPU flash
  variant make_fx emits has ``e^`` (its kernel needs equal head sizes) and a
  second output, the logsumexp ``b h s``.
"""
from __future__ import annotations

import math

import torch

aten = torch.ops.aten

# (op, annotation string or factory), in order; the registry registers them all before its
# first use (registry._ensure_builtins), so this module imports nothing from the registry.
BUILTINS: list[tuple[object, object]] = []


def _builtin(op, entry) -> None:
    BUILTINS.append((op, entry))


# ---------------------------------------------------------------- helpers


def _shape(x: object) -> tuple[int, ...] | None:
    return tuple(int(s) for s in x.shape) if isinstance(x, torch.Tensor) else None


def _letters(k: int, skip: int = 0) -> list[str]:
    out = []
    for i in range(skip, skip + k):
        out.append(chr(97 + i % 26) + ("" if i < 26 else str(i // 26)))
    return out


def _norm(d: int, rank: int) -> int | None:
    if not isinstance(d, int) or isinstance(d, bool):
        return None
    d = d + rank if d < 0 else d
    return d if 0 <= d < max(rank, 1) else None


def _j(tokens) -> str:
    return " ".join(tokens)


def _against(shape: tuple[int, ...] | None, tokens: list[str], out: tuple[int, ...]) -> str | None:
    """Tokens of a tensor that broadcasts against ``out`` (named ``tokens``),
    right-aligned; ``"?"`` for a 0-d tensor or a non-tensor; None if it does
    not broadcast."""
    if shape is None or len(shape) == 0:
        return "?"
    if len(shape) > len(out):
        return None
    off = len(out) - len(shape)
    res = []
    for j, s in enumerate(shape):
        if s == out[off + j]:
            res.append(tokens[off + j])
        elif s == 1:
            res.append("1")
        else:
            return None
    return _j(res)


def _broadcast(shapes, names_from=_letters):
    """(tokens per input, output tokens) for elementwise broadcasting, or None."""
    real = [s for s in shapes if s is not None and len(s) > 0]
    if not real:
        return None
    rank = max(len(s) for s in real)
    out = [1] * rank
    for s in real:
        for j, size in enumerate(s):
            k = rank - len(s) + j
            if size != 1:
                if out[k] not in (1, size):
                    return None
                out[k] = size
    names = names_from(rank)
    parts = [_against(s, names, tuple(out)) for s in shapes]
    if any(p is None for p in parts):
        return None
    return parts, _j(names)


def _reg(ops, entry) -> None:
    for op in ops:
        _builtin(op, entry)


def _ops(*names: str):
    """The existing overloads among ``"name.overload"`` (skips any this torch lacks)."""
    found = []
    for n in names:
        name, _, overload = n.partition(".")
        packet = getattr(aten, name, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is not None:
            found.append(op)
    return found


# ---------------------------------------------------------------- elementwise


def unary(x, *args, **kwargs):
    s = _shape(x)
    if not s:
        return None
    t = _j(_letters(len(s)))
    return f"{t} -> {t}"


def elementwise(*args, **kwargs):
    """Broadcasting over every leading tensor-or-scalar argument."""
    slots = []
    for a in args:
        if isinstance(a, torch.Tensor) or isinstance(a, (int, float, bool)) or a is None:
            slots.append(a)
        else:
            break
    # trailing non-tensor arguments are left out
    while slots and not isinstance(slots[-1], torch.Tensor):
        slots.pop()
    b = _broadcast([_shape(a) for a in slots])
    if b is None:
        return None
    parts, out = b
    return f"{', '.join(parts)} -> {out}"


_reg(_ops("relu.default", "gelu.default", "silu.default", "tanh.default", "exp.default", "rsqrt.default",
          "neg.default", "sigmoid.default", "pow.Tensor_Scalar", "_to_copy.default", "clone.default",
          "abs.default", "cos.default", "sin.default", "log.default", "sqrt.default", "erf.default",
          "reciprocal.default", "alias.default", "detach.default", "rsub.Scalar", "zeros_like.default",
          "ones_like.default", "full_like.default", "empty_like.default", "bitwise_not.default",
          "logical_not.default", "add.Scalar", "sub.Scalar", "mul.Scalar", "div.Scalar",
          "eq.Scalar", "ne.Scalar", "lt.Scalar", "le.Scalar", "gt.Scalar", "ge.Scalar",
          "clamp.default"), unary)
_reg(_ops("add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "pow.Tensor_Tensor", "where.self",
          "masked_fill.Scalar", "eq.Tensor", "ne.Tensor", "lt.Tensor", "le.Tensor", "gt.Tensor", "ge.Tensor",
          "maximum.default", "minimum.default", "bitwise_and.Tensor", "bitwise_or.Tensor",
          "logical_and.default", "logical_or.default", "rsub.Tensor"), elementwise)


def triangular(x, *args, **kwargs):
    s = _shape(x)
    if s is None or len(s) < 2:
        return None
    t = _letters(len(s))
    t[-2:] = [t[-2] + "^", t[-1] + "^"]
    return f"{_j(t)} -> {_j(t)}"


_reg(_ops("triu.default", "tril.default"), triangular)


# ---------------------------------------------------------------- contractions

_builtin(aten.mm.default, "m k+, k+ n -> m n")
_builtin(aten.bmm.default, "b m k+, b k+ n -> b m n")


def addmm(bias, m1, m2, beta=1, alpha=1):
    a, b = _shape(m1), _shape(m2)
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return None
    if beta == 0:
        return "?, m k+, k+ n -> m n"
    bias_t = _against(_shape(bias), ["m", "n"], (a[0], b[1]))
    if bias_t is None:
        return None
    return f"{bias_t}, m k^, k^ n -> m n"


_builtin(aten.addmm.default, addmm)


def linear(x, w, bias=None):
    s, ws = _shape(x), _shape(w)
    if not s or ws is None or len(ws) != 2:
        return None
    lead = [f"b{i}" for i in range(len(s) - 1)]
    if bias is None:
        return f"{_j(lead + ['k+'])}, n k+ -> {_j(lead + ['n'])}"
    bias_t = _against(_shape(bias), lead + ["n"], s[:-1] + (ws[0],))
    if bias_t is None:
        return None
    return f"{_j(lead + ['k^'])}, n k^, {bias_t} -> {_j(lead + ['n'])}"


_builtin(aten.linear.default, linear)


def matmul(a, b):
    sa, sb = _shape(a), _shape(b)
    if not sa or not sb or (len(sa) == 1 and len(sb) == 1):
        return None
    if len(sa) == 1:
        lead = [f"b{i}" for i in range(len(sb) - 2)]
        return f"k+, {_j(lead + ['k+', 'n'])} -> {_j(lead + ['n'])}"
    if len(sb) == 1:
        lead = [f"b{i}" for i in range(len(sa) - 2)]
        return f"{_j(lead + ['m', 'k+'])}, k+ -> {_j(lead + ['m'])}"
    batch = _broadcast([sa[:-2], sb[:-2]], lambda k: [f"b{i}" for i in range(k)])
    if batch is None:  # no batch dims at all, or they do not broadcast
        if sa[:-2] or sb[:-2]:
            return None
        return "m k+, k+ n -> m n"
    (pa, pb), out = batch
    pa = "" if pa == "?" else pa + " "
    pb = "" if pb == "?" else pb + " "
    return f"{pa}m k+, {pb}k+ n -> {out} m n"


_builtin(aten.matmul.default, matmul)


# ---------------------------------------------------------------- layout ops


def t(x):
    s = _shape(x)
    if not s:
        return None
    return "a -> a" if len(s) == 1 else "a b -> b a"


def transpose(x, dim0, dim1):
    s = _shape(x)
    if not s:
        return None
    d0, d1 = _norm(dim0, len(s)), _norm(dim1, len(s))
    if d0 is None or d1 is None:
        return None
    names = _letters(len(s))
    out = list(names)
    out[d0], out[d1] = out[d1], out[d0]
    return f"{_j(names)} -> {_j(out)}"


def permute(x, dims):
    s = _shape(x)
    if not s or len(dims) != len(s):
        return None
    idx = [_norm(d, len(s)) for d in dims]
    if None in idx or sorted(idx) != list(range(len(s))):
        return None
    names = _letters(len(s))
    return f"{_j(names)} -> {_j(names[i] for i in idx)}"


_builtin(aten.t.default, t)
_builtin(aten.transpose.int, transpose)
_builtin(aten.permute.default, permute)


def _resolve_shape(shape, numel):
    shape = [int(s) for s in shape]
    if shape.count(-1) > 1:
        return None
    if -1 in shape:
        rest = math.prod(s for s in shape if s != -1)
        if rest == 0 or numel % rest:
            return None
        shape[shape.index(-1)] = numel // rest
    return tuple(shape) if math.prod(shape) == numel else None


def reshape(x, shape):
    """``view``/``reshape``/``_unsafe_view``: match runs of dims by product."""
    s = _shape(x)
    if not s:
        return None
    out = _resolve_shape(shape, math.prod(s))
    if not out:
        return None
    if 0 in s:
        return f"{_j(str(d) for d in s)} -> {_j(str(d) for d in out)}"
    ins_t, outs_t = [str(d) for d in s], [str(d) for d in out]  # size-1 dims stay "1"
    in_nz = [i for i, d in enumerate(s) if d != 1]
    out_nz = [j for j, d in enumerate(out) if d != 1]
    names = iter(_letters(len(s) + len(out)))
    sizes: dict[str, int] = {}
    i = j = 0
    while i < len(in_nz) and j < len(out_nz):
        ii, jj = [in_nz[i]], [out_nz[j]]
        pi, pj = s[in_nz[i]], out[out_nz[j]]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                ii.append(in_nz[i])
                pi *= s[in_nz[i]]
                i += 1
            else:
                jj.append(out_nz[j])
                pj *= out[out_nz[j]]
                j += 1
        if len(ii) == 1 and len(jj) == 1:
            n = next(names)
            ins_t[ii[0]] = outs_t[jj[0]] = n
        elif len(ii) == 1:  # one input dim becomes several: the group is on the input
            ns = [next(names) for _ in jj]
            toks = [ns[0]] + [m + "^" for m in ns[1:]]
            ins_t[ii[0]] = "(" + _j(toks) + ")"
            for jx, tok in zip(jj, toks):
                outs_t[jx] = tok
            for m, jx in zip(ns[:-1], jj[:-1]):
                sizes[m] = out[jx]
        elif len(jj) == 1:  # several input dims become one: the group is on the output
            ns = [next(names) for _ in ii]
            toks = [ns[0]] + [m + "^" for m in ns[1:]]
            for ix, tok in zip(ii, toks):
                ins_t[ix] = tok
            outs_t[jj[0]] = "(" + _j(toks) + ")"
        # else: several to several: the dims keep their numbers
    text = f"{_j(ins_t)} -> {_j(outs_t)}"
    return (text, sizes) if sizes else text


_reg(_ops("view.default", "reshape.default", "_unsafe_view.default"), reshape)


def expand(x, size, implicit=False):
    s = _shape(x)
    if not s or len(size) < len(s):
        return None
    off = len(size) - len(s)
    names = _letters(len(s))
    ins, outs = [], [str(int(d)) for d in size[:off]]
    if any(int(d) < 0 for d in size[:off]):
        return None
    for j, d in enumerate(s):
        want = int(size[off + j])
        want = d if want == -1 else want
        if want == d:
            ins.append(names[j])
            outs.append(names[j])
        elif d == 1:
            ins.append("1")
            outs.append(str(want))
        else:
            return None
    return f"{_j(ins)} -> {_j(outs)}"


_builtin(aten.expand.default, expand)


def unsqueeze(x, dim):
    s = _shape(x)
    if s is None:
        return None
    d = _norm(dim, len(s) + 1)
    if d is None or not s:
        return None
    names = _letters(len(s))
    return f"{_j(names)} -> {_j(names[:d] + ['1'] + names[d:])}"


def _squeeze(s, dims):
    names = _letters(len(s))
    ins, outs = [], []
    for k, (n, d) in enumerate(zip(names, s)):
        if k in dims and d == 1:
            ins.append("1")
        else:
            ins.append(n)
            outs.append(n)
    if not outs:
        return None
    return f"{_j(ins)} -> {_j(outs)}"


def squeeze(x, dim=None):
    s = _shape(x)
    if not s:
        return None
    if dim is None:
        dims = set(range(len(s)))
    else:
        dims = {_norm(d, len(s)) for d in (dim if isinstance(dim, (list, tuple)) else [dim])}
        if None in dims:
            return None
    return _squeeze(s, dims)


_builtin(aten.unsqueeze.default, unsqueeze)
_reg(_ops("squeeze.default", "squeeze.dim", "squeeze.dims"), squeeze)


# ---------------------------------------------------------------- reductions


def _reduce(x, dim, keepdim, mark):
    s = _shape(x)
    if not s:
        return None
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        dims = set(range(len(s)))
    else:
        dims = {_norm(d, len(s)) for d in (dim if isinstance(dim, (list, tuple)) else [dim])}
        if None in dims:
            return None
    names = _letters(len(s))
    ins = [n + mark if k in dims else n for k, n in enumerate(names)]
    outs = []
    for k, n in enumerate(names):
        if k not in dims:
            outs.append(n)
        elif keepdim:
            outs.append("1")
    if not outs:
        return None  # 0-d output
    return f"{_j(ins)} -> {_j(outs)}"


def sum_dim(x, dim=None, keepdim=False, dtype=None):
    return _reduce(x, dim, keepdim, "+")


def mean_dim(x, dim=None, keepdim=False, dtype=None):
    return _reduce(x, dim, keepdim, "^")


def amax(x, dim=(), keepdim=False):
    return _reduce(x, dim, keepdim, "^")


_builtin(aten.sum.dim_IntList, sum_dim)
_builtin(aten.mean.dim, mean_dim)
_reg(_ops("amax.default", "amin.default"), amax)


def softmax(x, dim, *args, **kwargs):
    s = _shape(x)
    if not s:
        return None
    d = _norm(dim, len(s))
    if d is None:
        return None
    names = [n + "^" if k == d else n for k, n in enumerate(_letters(len(s)))]
    return f"{_j(names)} -> {_j(names)}"


_reg(_ops("_softmax.default", "softmax.int", "_log_softmax.default", "log_softmax.int"), softmax)


def _norm_tokens(x, normalized_shape):
    s = _shape(x)
    k = len(normalized_shape)
    if not s or k == 0 or k > len(s) or tuple(s[-k:]) != tuple(int(d) for d in normalized_shape):
        return None
    names = _letters(len(s))
    lead, norm = names[: len(s) - k], [n + "^" for n in names[len(s) - k:]]
    return lead, norm


def native_layer_norm(x, normalized_shape, weight, bias, eps):
    tok = _norm_tokens(x, normalized_shape)
    if tok is None:
        return None
    lead, norm = tok
    w = "?" if weight is None else _j(norm)
    b = "?" if bias is None else _j(norm)
    stat = _j(lead + ["1"] * len(norm))
    return f"{_j(lead + norm)}, ?, {w}, {b} -> {_j(lead + norm)}, {stat}, {stat}"


def layer_norm(x, normalized_shape, weight=None, bias=None, *args, **kwargs):
    tok = _norm_tokens(x, normalized_shape)
    if tok is None:
        return None
    lead, norm = tok
    w = "?" if weight is None else _j(norm)
    b = "?" if bias is None else _j(norm)
    return f"{_j(lead + norm)}, ?, {w}, {b} -> {_j(lead + norm)}"


def rms_norm(x, normalized_shape, weight=None, eps=None):
    tok = _norm_tokens(x, normalized_shape)
    if tok is None:
        return None
    lead, norm = tok
    w = "?" if weight is None else _j(norm)
    return f"{_j(lead + norm)}, ?, {w} -> {_j(lead + norm)}"


_builtin(aten.native_layer_norm.default, native_layer_norm)
_builtin(aten.layer_norm.default, layer_norm)
_reg(_ops("rms_norm.default"), rms_norm)


def embedding(weight, indices, *args, **kwargs):
    ws, s = _shape(weight), _shape(indices)
    if ws is None or len(ws) != 2 or s is None:
        return None
    names = [f"i{k}" for k in range(len(s))]
    idx = _j(names) if names else "?"
    return f"v^ e, {idx} -> {_j(names + ['e'])}"


_builtin(aten.embedding.default, embedding)


# ---------------------------------------------------------------- pieces of a dim


def cat(tensors, dim=0):
    shapes = [_shape(x) for x in tensors]
    if any(s is None for s in shapes):
        return None
    ref = next((s for s in shapes if s != (0,)), None)
    if not ref:
        return None
    d = _norm(dim, len(ref))
    if d is None:
        return None
    names = _letters(len(ref))
    parts, total = [], 0
    for s in shapes:
        if s == (0,) and len(ref) != 1:
            parts.append("?")  # legacy empty tensor, skipped by cat
            continue
        if len(s) != len(ref) or any(a != b for k, (a, b) in enumerate(zip(s, ref)) if k != d):
            return None
        parts.append(_j(str(s[k]) if k == d else names[k] for k in range(len(s))))
        total += s[d]
    out = _j(str(total) if k == d else names[k] for k in range(len(ref)))
    return f"{', '.join(parts)} -> {out}"


_builtin(aten.cat.default, cat)


def _pieces(x, sizes, dim, drop=False):
    s = _shape(x)
    if not s:
        return None
    d = _norm(dim, len(s))
    if d is None or sum(sizes) != s[d]:
        return None
    names = _letters(len(s))
    ins = _j(str(s[k]) if k == d else names[k] for k in range(len(s)))
    outs = []
    for size in sizes:
        toks = [names[k] for k in range(len(s)) if k != d] if drop else [str(size) if k == d else names[k] for k in range(len(s))]
        if not toks:
            return None
        outs.append(_j(toks))
    return f"{ins} -> {', '.join(outs)}"


def split_tensor(x, split_size, dim=0):
    s = _shape(x)
    if not s or _norm(dim, len(s)) is None or split_size <= 0:
        return None
    size = s[_norm(dim, len(s))]
    sizes = [split_size] * (size // split_size) + ([size % split_size] if size % split_size else [])
    return _pieces(x, sizes or [0], dim)


def split_with_sizes(x, split_sizes, dim=0):
    return _pieces(x, [int(v) for v in split_sizes], dim)


def unbind(x, dim=0):
    s = _shape(x)
    if not s or _norm(dim, len(s)) is None:
        return None
    return _pieces(x, [1] * s[_norm(dim, len(s))], dim, drop=True)


_builtin(aten.split.Tensor, split_tensor)
_builtin(aten.split_with_sizes.default, split_with_sizes)
_builtin(aten.unbind.int, unbind)


def slice_tensor(x, dim=0, start=None, end=None, step=1):
    s = _shape(x)
    if not s:
        return None
    d = _norm(dim, len(s))
    if d is None or step is None or step < 1:
        return None
    length = len(range(s[d])[slice(start, end, step)])
    names = _letters(len(s))
    if length == s[d] and step == 1:
        return f"{_j(names)} -> {_j(names)}"
    ins = _j(str(s[k]) if k == d else names[k] for k in range(len(s)))
    outs = _j(str(length) if k == d else names[k] for k in range(len(s)))
    return f"{ins} -> {outs}"


def select(x, dim, index):
    s = _shape(x)
    if not s or len(s) < 2:
        return None
    d = _norm(dim, len(s))
    if d is None:
        return None
    names = _letters(len(s))
    ins = _j(str(s[k]) if k == d else names[k] for k in range(len(s)))
    return f"{ins} -> {_j(names[k] for k in range(len(s)) if k != d)}"


_builtin(aten.slice.Tensor, slice_tensor)
_builtin(aten.select.int, select)


# ---------------------------------------------------------------- attention


def _attention(q, k, v, attn_mask, is_causal):
    sq, sk, sv = _shape(q), _shape(k), _shape(v)
    if not sq or not sk or not sv or not (len(sq) == len(sk) == len(sv) >= 2):
        return None
    lq, lk, lv = sq[:-2], sk[:-2], sv[:-2]
    if sk[-2] != sv[-2] or sq[-1] != sk[-1]:
        return None
    lead_q = [f"b{i}" for i in range(len(lq))]
    lead_kv = list(lead_q)
    if lk != lv:
        return None
    if lq != lk:
        # GQA: only the head dim (-3) may differ, by an integer factor
        if len(lq) < 1 or lq[:-1] != lk[:-1] or lq[-1] % lk[-1]:
            return None
        lead_q[-1], lead_kv[-1] = "h^", "g^"
    s = "s^" if is_causal else "s"
    qt = _j(lead_q + [s, "d^"])
    kt = _j(lead_kv + ["t^", "d^"])
    vt = _j(lead_kv + ["t^", "e"])
    out = _j(lead_q + [s, "e"])
    mask = None
    if attn_mask is not None:
        mask = _against(_shape(attn_mask), lead_q + [s, "t^"], lq + (sq[-2], sk[-2]))
        if mask is None:
            return None
    return qt, kt, vt, mask, out, _j(lead_q + [s])


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    parts = _attention(q, k, v, attn_mask, is_causal)
    if parts is None:
        return None
    qt, kt, vt, mask, out, _ = parts
    ins = [qt, kt, vt] + ([mask] if mask is not None else [])
    return f"{', '.join(ins)} -> {out}"


def sdpa_flash_cpu(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """Outputs (out, logsumexp). The kernel needs q, k and v to share the head
    size, so e is ``e^`` here."""
    parts = _attention(q, k, v, attn_mask, is_causal)
    if parts is None:
        return None
    qt, kt, vt, mask, out, lse = parts
    vt, out = vt[:-1] + "e^", out[:-1] + "e^"
    ins = [qt, kt, vt] + (["?", "?", mask] if mask is not None else [])  # mask: keyword-only, after dropout_p, is_causal
    return f"{', '.join(ins)} -> {out}, {lse}"


_builtin(aten.scaled_dot_product_attention.default, sdpa)
_reg(_ops("_scaled_dot_product_flash_attention_for_cpu.default"), sdpa_flash_cpu)


# ---------------------------------------------------------------- factories (no tensor inputs)


def _new(size):
    size = [int(d) for d in size]
    if not size or any(d < 0 for d in size):
        return None
    return f"-> {_j(str(d) for d in size)}"


def arange(*args, **kwargs):
    nums = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    if len(nums) == 1:
        start, end, step = 0, nums[0], 1
    elif len(nums) == 2:
        (start, end), step = nums, 1
    elif len(nums) == 3:
        start, end, step = nums
    else:
        return None
    if step == 0:
        return None
    return _new([max(0, math.ceil((end - start) / step))])


def full(size, fill_value=None, **kwargs):
    return _new(size)


def zeros(size, *args, **kwargs):
    return _new(size)


_reg(_ops("arange.default", "arange.start", "arange.start_step"), arange)
_builtin(aten.full.default, full)
_reg(_ops("zeros.default", "ones.default", "empty.memory_format"), zeros)
