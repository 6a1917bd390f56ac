"""Tiling patterns and topologies (SPEC §3): formulas, notation, placements, comm inference."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpipe.builder.tiling import (
    CommStep, Tiling, TilingError, Topology, TopologyError, format_tiling, infer_comm, input_layout, mesh,
    parse_tiling, parse_topology, placements, ring, star, tile, tiles_by_instance, topology_to_json, torus, tree,
)
from fastpipe.errors import InvalidInput

FAST = settings(max_examples=150, deadline=None)


# ---------------------------------------------------------------- reference (SPEC's literal formula)

def literal_tiles(shape, pattern):
    """SPEC §3 verbatim: start/stop with coordinate ((V != 1 ? j : 0) % P[i % r])."""
    r, v = len(pattern), math.prod(pattern)
    out = []
    for j in range(v):
        box = []
        for i, s in enumerate(shape):
            p = pattern[i % r]
            c = (j if v != 1 else 0) % p
            box.append((math.floor(c * s / p), min(s, math.floor((c + 1) * s / p))))
        out.append(box)
    return out


# ---------------------------------------------------------------- worked examples (by hand)

def test_one_dim_three_way():
    # S=10, P=3: floor(0*10/3)=0, floor(10/3)=3, floor(20/3)=6, min(10, floor(30/3))=10
    assert tile([10], [3]) == {0: [(0, 3)], 1: [(3, 6)], 2: [(6, 10)]}


def test_two_dims_row_major():
    # S=[4,6], P=[2,3]; tile j at (j // 3, j % 3); rows split [0,2),[2,4); cols [0,2),[2,4),[4,6)
    assert tile([4, 6], [2, 3]) == {
        0: [(0, 2), (0, 2)], 1: [(0, 2), (2, 4)], 2: [(0, 2), (4, 6)],
        3: [(2, 4), (0, 2)], 4: [(2, 4), (2, 4)], 5: [(2, 4), (4, 6)],
    }


def test_two_by_two_tiles_are_distinct():
    # SPEC's literal j % P[i]: tile 2 -> (2%2, 2%2) = (0,0), same as tile 0; tile 3 = tile 1.
    lit = literal_tiles([4, 4], [2, 2])
    assert lit[0] == lit[2] == [(0, 2), (0, 2)] and lit[1] == lit[3]
    # mixed radix: 0->(0,0), 1->(0,1), 2->(1,0), 3->(1,1)
    assert tile([4, 4], [2, 2]) == {
        0: [(0, 2), (0, 2)], 1: [(0, 2), (2, 4)], 2: [(2, 4), (0, 2)], 3: [(2, 4), (2, 4)],
    }


def test_leading_ones_omitted_means_left_padding():
    # {2} on [4,6] == {1,2}: split the last dim: cols [0,3),[3,6)
    assert tile([4, 6], [2]) == tile([4, 6], [1, 2]) == {0: [(0, 4), (0, 3)], 1: [(0, 4), (3, 6)]}
    # {4} on [2,3,8]: last dim in four of 2
    assert tile([2, 3, 8], [4]) == {j: [(0, 2), (0, 3), (2 * j, 2 * j + 2)] for j in range(4)}
    # {2,1} on [2,4,6] == {1,2,1}: the middle dim
    assert tile([2, 4, 6], [2, 1]) == {0: [(0, 2), (0, 2), (0, 6)], 1: [(0, 2), (2, 4), (0, 6)]}
    with pytest.raises(TilingError, match="at most 2 entries"):
        tile([4, 6], [1, 2, 1])


def test_scalar_one_replicates():
    whole = [(0, 3), (0, 5)]
    assert tile([3, 5], 1) == {0: whole}                         # default: instance 0
    assert tile([3, 5], 1, [0, 2, 5]) == {0: whole, 2: whole, 5: whole}
    assert tile([3, 5], [1, 1], [1, 0]) == {1: whole, 0: whole}  # any volume-1 pattern replicates
    assert tile([3, 5], (), [4]) == {4: whole}
    assert tile([], 1, [0, 1]) == {0: [], 1: []}                  # rank-0 tensor
    assert tile([3, 5], Tiling((1,), (0, -1, 3))) == {0: whole, 3: whole}


def test_suppression_and_custom_assignment():
    assert tile([10], [3], [4, -1, 7]) == {4: [(0, 3)], 7: [(6, 10)]}
    assert tile([6], [2], [3, 1]) == {3: [(0, 3)], 1: [(3, 6)]}
    assert list(tile([6], [2], [3, 1])) == [3, 1]                 # tile order kept
    assert tile([4], [2], [-1, -1]) == {}


def test_empty_tiles():
    # S=2, P=3: 0, floor(2/3)=0, floor(4/3)=1, 2 -> [0,0),[0,1),[1,2)
    assert tile([2], [3]) == {0: [(0, 0)], 1: [(0, 1)], 2: [(1, 2)]}
    # S=3, P=5: c*3//5 for c=0..5: 0,0,1,1,2,3
    assert tile([3], [5]) == {0: [(0, 0)], 1: [(0, 1)], 2: [(1, 1)], 3: [(1, 2)], 4: [(2, 3)]}
    assert tile([0, 4], [2, 2]) == {0: [(0, 0), (0, 2)], 1: [(0, 0), (2, 4)], 2: [(0, 0), (0, 2)], 3: [(0, 0), (2, 4)]}


def test_instance_with_several_tiles():
    with pytest.raises(TilingError, match="instance 0 again at tile 2"):
        tile([6], [3], [0, 1, 0])
    assert tiles_by_instance([6], [3], [0, 1, 0]) == {0: [[(0, 2)], [(4, 6)]], 1: [[(2, 4)]]}
    with pytest.raises(TilingError, match="instance 1 again"):
        tile([6], 1, [1, 1])


@pytest.mark.parametrize("shape, pattern, assignment, match", [
    ([4], [0], None, r"pattern\[0\]: expected an integer >= 1, found 0"),
    ([4], [2, -1], None, r"pattern\[1\]: expected an integer >= 1"),
    ([4], [True], None, r"pattern\[0\]"),
    ([4], "2", None, "expected a list of integers"),
    ([4], [2], [0], "expected 2 entries .* found 1"),
    ([4], [2], [0, 1, 2], "expected 2 entries .* found 3"),
    ([4], [2], [0, -2], r"assignment\[1\]: expected an instance >= 0 or -1"),
    ([4], 1, [], "at least one instance"),
    ([4, -1], [2], None, r"shape\[1\]: expected a non-negative integer, found -1"),
    ([4], [2, 2], None, "at most 1 entries"),
])
def test_tiling_errors(shape, pattern, assignment, match):
    with pytest.raises(TilingError, match=match) as e:
        tile(shape, pattern, assignment)
    assert isinstance(e.value, InvalidInput) and e.value.exit_code == 2 and "\n" not in str(e.value)


# ---------------------------------------------------------------- properties

@st.composite
def shape_and_pattern(draw, max_rank=3, max_dim=7, max_p=4):
    rank = draw(st.integers(1, max_rank))
    shape = draw(st.lists(st.integers(0, max_dim), min_size=rank, max_size=rank))
    plen = draw(st.integers(1, rank))
    pattern = draw(st.lists(st.integers(1, max_p), min_size=plen, max_size=plen))
    return shape, pattern


@st.composite
def single_split(draw):
    rank = draw(st.integers(1, 4))
    shape = draw(st.lists(st.integers(0, 12), min_size=rank, max_size=rank))
    pattern = [1] * rank
    if draw(st.booleans()):
        pattern[draw(st.integers(0, rank - 1))] = draw(st.integers(1, 9))
    return shape, pattern


@FAST
@given(single_split())
def test_single_split_matches_literal_formula(sp):
    shape, pattern = sp
    ours = tile(shape, pattern) if math.prod(pattern) > 1 else {0: tile(shape, pattern)[0]}
    assert [ours[j] for j in range(math.prod(pattern))] == literal_tiles(shape, pattern)


@FAST
@given(shape_and_pattern())
def test_tiles_partition_the_tensor(sp):
    shape, pattern = sp
    boxes = [b for [b] in tiles_by_instance(shape, pattern).values()]
    assert len(boxes) == math.prod(pattern)
    count = torch.zeros(shape, dtype=torch.int32)
    for box in boxes:
        count[tuple(slice(s, e) for s, e in box)] += 1
    assert bool((count == 1).all())


@FAST
@given(shape_and_pattern(), st.randoms(use_true_random=False))
def test_placements_round_trip(sp, rnd):
    shape, pattern = sp
    v = math.prod(pattern)
    asg = list(range(10, 10 + v))
    rnd.shuffle(asg)
    x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    pl = placements(shape, Tiling(pattern, asg))
    assert sorted(pl) == sorted(asg)
    y = torch.full(shape, -1.0)
    for inst, p in pl.items():
        assert all(isinstance(pair, list) and len(pair) == 2 for pair in p)
        piece = x[tuple(slice(s, e) for s, e in p)].clone()
        y[tuple(slice(s, e) for s, e in p)] = piece
    assert torch.equal(x, y)


def test_placements_format():
    assert placements([4, 6], "{2,1:1,0}") == {1: [[0, 2], [0, 6]], 0: [[2, 4], [0, 6]]}
    assert placements([4, 6], "{1:0,1}") == {0: [[0, 4], [0, 6]], 1: [[0, 4], [0, 6]]}
    assert input_layout("x", [8], "{2:3,2}") == {3: [[0, 4]], 2: [[4, 8]]}
    with pytest.raises(TilingError, match=r"^input 'x': tiling '\{2:0\}': tile assignment: expected 2 entries"):
        input_layout("x", [8], "{2:0}")
    with pytest.raises(TilingError, match=r"^input 'kv': tile pattern \{2,2\}: expected at most 1"):
        input_layout("kv", [8], Tiling((2, 2)))


# ---------------------------------------------------------------- notation

@pytest.mark.parametrize("text, pattern, assignment", [
    ("{2,1:0,1}", (2, 1), (0, 1)), ("{1:0,1}", (1,), (0, 1)), ("{1:0}", (1,), (0,)),
    ("{2,2}", (2, 2), None), ("{1}", (1,), None), (" { 2 , 1 : 0 , -1 } ", (2, 1), (0, -1)),
])
def test_parse(text, pattern, assignment):
    t = parse_tiling(text)
    assert (t.pattern, t.assignment) == (pattern, assignment)


@pytest.mark.parametrize("text, match", [
    ("2,1:0,1", "found no braces"), ("{}", "expected comma-separated integers"),
    ("{2,1:}", "expected comma-separated"), ("{2,,1}", "expected comma-separated"),
    ("{a}", "expected comma-separated"), ("{2:0:1}", "expected comma-separated"),
    ("{0:0}", r"pattern\[0\]: expected an integer >= 1, found 0"),
    ("{2,1:0}", "expected 2 entries"), ("{2:0,-3}", r"assignment\[1\]"),
])
def test_parse_errors(text, match):
    with pytest.raises(TilingError, match=match) as e:
        parse_tiling(text)
    assert str(e.value).startswith(f"tiling {text!r}: ")


def test_format_and_normalization():
    assert format_tiling(Tiling([2, 1], [0, 1])) == "{2,1:0,1}"
    assert format_tiling(Tiling((), None)) == "{1}" and Tiling(()).pattern == (1,)
    assert str(Tiling((2, 2))) == "{2,2}"
    assert Tiling([2], [1, 0]) == Tiling((2,), (1, 0))
    assert Tiling((2,)).resolved_assignment() == (0, 1) and Tiling((1,)).resolved_assignment() == (0,)


def test_parse_non_string():
    with pytest.raises(TilingError, match="expected a string"):
        parse_tiling(5)


@st.composite
def tilings(draw):
    pattern = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    v = math.prod(pattern)
    if draw(st.booleans()):
        return Tiling(pattern)
    n = draw(st.integers(1, 4)) if v == 1 else v
    return Tiling(pattern, draw(st.lists(st.integers(-1, 20), min_size=n, max_size=n)))


@FAST
@given(tilings())
def test_notation_round_trip(t):
    assert parse_tiling(format_tiling(t)) == t


# ---------------------------------------------------------------- communication

def test_comm_replicated_to_tiled():
    # {1:0} -> {2:0,1} on [4]: 1 lacks the tensor -> broadcast from 0, then slices
    assert infer_comm([4], "{1:0}", "{2:0,1}") == [
        CommStep("broadcast", (0, 1), src=0),
        CommStep("slice", (0,), placements=((0, 2),)), CommStep("slice", (1,), placements=((2, 4),)),
    ]
    # both already hold a replica: only local slices
    assert infer_comm([4], "{1:0,1}", "{2:1,0}") == [
        CommStep("slice", (1,), placements=((0, 2),)), CommStep("slice", (0,), placements=((2, 4),)),
    ]


def test_comm_tiled_to_replicated():
    assert infer_comm([4, 6], "{2,1:0,1}", "{1:0,1}") == [CommStep("all_gather", (0, 1), dim=0)]
    assert infer_comm([4, 6], "{3:2,0,1}", "{1:0}") == [CommStep("all_gather", (2, 0, 1), dim=1)]
    # {2,2}: gather dim 1 within rows (0,1),(2,3), then dim 0 within columns (0,2),(1,3)
    assert infer_comm([4, 4], Tiling((2, 2)), Tiling((1,), (0, 1, 2, 3))) == [
        CommStep("all_gather", (0, 1), dim=1), CommStep("all_gather", (2, 3), dim=1),
        CommStep("all_gather", (0, 2), dim=0), CommStep("all_gather", (1, 3), dim=0),
    ]
    # consumer on instances the producer does not use: gather, then broadcast from 0
    assert infer_comm([4], "{2:0,1}", "{1:2}") == [
        CommStep("all_gather", (0, 1), dim=0), CommStep("broadcast", (0, 2), src=0),
    ]


def test_comm_tiled_to_other_tiling():
    assert infer_comm([4, 6], "{2,1:0,1}", "{1,2:0,1}") == [
        CommStep("all_gather", (0, 1), dim=0),
        CommStep("slice", (0,), placements=((0, 4), (0, 3))), CommStep("slice", (1,), placements=((0, 4), (3, 6))),
    ]


def test_comm_equal():
    assert infer_comm([4, 6], "{2,1:0,1}", "{2,1:0,1}") == []
    assert infer_comm([4, 6], "{2}", "{1,2:0,1}") == []          # same placements, other spelling
    assert infer_comm([4, 6], "{1:1,0}", "{1,1:0,1}") == []


def test_comm_errors():
    with pytest.raises(TilingError, match=r"tile 1 \[3, 6\) suppressed"):
        infer_comm([10], "{3:0,-1,2}", "{1:0}")
    with pytest.raises(TilingError, match="more than one dim is split"):
        infer_comm([4, 4], "{2,2:0,1,2,-1}", "{1:0}")
    with pytest.raises(TilingError, match="every tile suppressed"):
        infer_comm([4], "{1:-1}", "{1:0}")
    # a suppressed EMPTY tile (S=2, P=3: tile 0 is [0,0)) is fine
    assert infer_comm([2], "{3:-1,1,2}", "{1:1}") == [CommStep("all_gather", (1, 2), dim=0)]


def simulate(steps, tensors):
    """Apply steps with plain torch: tensors {instance: tensor} -> new dict."""
    st_ = dict(tensors)
    for s in steps:
        if s.kind == "all_gather":
            y = torch.cat([st_[i] for i in s.instances], dim=s.dim)
            for i in s.instances:
                st_[i] = y.clone()
        elif s.kind == "broadcast":
            assert s.src in s.instances
            for i in s.instances:
                st_[i] = st_[s.src].clone()
        elif s.kind == "slice":
            (i,) = s.instances
            st_[i] = st_[i][tuple(slice(a, b) for a, b in s.placements)]
        else:
            raise AssertionError(s.kind)
    return st_


def cut(x, tiling):
    return {i: x[tuple(slice(s, e) for s, e in box)].clone() for i, box in tile(list(x.shape), tiling).items()}


def test_simulate_worked_example():
    x = torch.arange(24.0).reshape(4, 6)
    prod, cons = Tiling((2, 3)), Tiling((3, 1), (5, 0, 7))
    got = simulate(infer_comm([4, 6], prod, cons), cut(x, prod))
    # consumer: rows [0,1),[1,2),[2,4) on 5, 0, 7
    assert torch.equal(got[5], x[0:1]) and torch.equal(got[0], x[1:2]) and torch.equal(got[7], x[2:4])


@st.composite
def comm_case(draw):
    rank = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(0, 6), min_size=rank, max_size=rank))

    def one():
        plen = draw(st.integers(1, rank))
        pattern = draw(st.lists(st.integers(1, 3), min_size=plen, max_size=plen))
        v = math.prod(pattern)
        if v == 1:
            n = draw(st.integers(1, 4))
            return Tiling(pattern, draw(st.lists(st.integers(0, 9), min_size=n, max_size=n, unique=True)))
        return Tiling(pattern, draw(st.permutations(range(max(v, 10))))[:v])

    return shape, one(), one()


@settings(max_examples=200, deadline=None)
@given(comm_case())
def test_inferred_steps_produce_consumer_tiles(case):
    shape, prod, cons = case
    x = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    steps = infer_comm(shape, prod, cons)
    got = simulate(steps, cut(x, prod))
    for i, want in cut(x, cons).items():
        assert torch.equal(got[i], want), (i, steps)
    kinds = [s.kind for s in steps]
    assert kinds == sorted(kinds, key=["all_gather", "broadcast", "slice"].index)  # gather, broadcast, slice
    if tile(shape, prod) == tile(shape, cons):
        assert steps == []


# ---------------------------------------------------------------- topology

def test_builders():
    assert ring(4).instance_map == ((1, 3), (0, 2), (1, 3), (0, 2))
    assert ring(1).instance_map == ((),) and ring(2).instance_map == ((1,), (0,))
    # 2x3 mesh: 0 1 2 / 3 4 5
    assert mesh(2, 3).instance_map == ((1, 3), (0, 2, 4), (1, 5), (0, 4), (1, 3, 5), (2, 4))
    # 3x3 torus: every node has 4 distinct neighbours; 0's are 1, 2 (row wrap), 3, 6 (column wrap)
    t = torus(3, 3)
    assert t.instance_map[0] == (1, 2, 3, 6) and all(len(r) == 4 for r in t.instance_map)
    assert len(torus(2, 2).links()) == 4 and torus(1, 1).instance_map == ((),)
    assert star(4).instance_map == ((1, 2, 3), (0,), (0,), (0,))
    assert tree(6).instance_map == ((1, 2), (0, 3, 4), (0, 5), (1,), (1,), (2,))
    assert tree(5, arity=3).instance_map == ((1, 2, 3), (0, 4), (0,), (0,), (1,))
    assert tree(4, arity=1).links() == mesh(1, 4).links() == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("build", [
    lambda: ring(7), lambda: mesh(3, 4), lambda: torus(4, 5), lambda: torus(2, 3), lambda: star(6),
    lambda: tree(10), lambda: tree(13, 3),
])
def test_builders_validate_and_round_trip(build):
    t = build()
    assert parse_topology(topology_to_json(t)) == t and Topology(t.instance_count, t.instance_map) == t
    assert t.is_connected()
    for i, row in enumerate(t.instance_map):
        assert list(row) == sorted(set(row)) and i not in row and all(i in t.instance_map[n] for n in row)


def test_link_counts():
    assert len(ring(5).links()) == 5 and len(mesh(3, 4).links()) == 3 * 3 + 2 * 4
    assert len(torus(3, 4).links()) == 24 and len(star(5).links()) == 4 and len(tree(9).links()) == 8


@pytest.mark.parametrize("bad, match", [
    (lambda: ring(0), r"ring\(n\): expected an integer >= 1, found 0"),
    (lambda: mesh(2, 0), r"mesh\(cols\)"), (lambda: torus(-1, 2), r"torus\(rows\)"),
    (lambda: star(True), r"star\(n\)"), (lambda: tree(3, 0), r"tree\(arity\)"),
])
def test_builder_arguments(bad, match):
    with pytest.raises(TopologyError, match=match):
        bad()


@pytest.mark.parametrize("obj, match", [
    ({"instance_count": 0, "instance_map": []}, r"topology.instance_count: expected an integer >= 1, found 0"),
    ({"instance_count": "2", "instance_map": [[1], [0]]}, "instance_count: expected an integer"),
    ({"instance_count": 2, "instance_map": [[1]]}, "expected 2 entries .* found 1"),
    ({"instance_count": 2, "instance_map": [[2], [0]]}, r"instance_map\[0\]\[0\]: expected an instance 0 <= n < 2, found 2"),
    ({"instance_count": 2, "instance_map": [[1], [-1]]}, r"instance_map\[1\]\[0\].*found -1"),
    ({"instance_count": 2, "instance_map": [[0], []]}, r"instance_map\[0\]\[0\]: expected no self loop, found 0"),
    ({"instance_count": 2, "instance_map": [[1, 1], [0]]}, r"instance_map\[0\]\[1\]: expected each neighbour once"),
    ({"instance_count": 3, "instance_map": [[1], [0, 2], []]}, r"instance_map\[2\]: expected 1 \(links are undirected"),
    ({"instance_count": 2, "instance_map": [1, [0]]}, r"instance_map\[0\]: expected a list"),
    ({"instance_count": 2, "instance_map": "01"}, "expected a list of neighbour lists"),
    ({"instance_count": 2}, "expected field 'instance_map'"),
    ({"instance_count": 1, "instance_map": [[]], "x": 1}, "found field 'x'"),
    ({"instance_count": 2, "instance_map": {"0": [1]}}, "found none for \"1\""),
    ({"instance_count": 1, "instance_map": {"0": [], "1": []}}, "found key '1'"),
    ([1], "expected an object"),
])
def test_topology_refused(obj, match):
    with pytest.raises(TopologyError, match=match) as e:
        parse_topology(obj)
    assert isinstance(e.value, InvalidInput) and "\n" not in str(e.value)


def test_topology_forms():
    t = parse_topology({"instance_count": 3, "instance_map": {"0": [1], "1": [0, 2], "2": [1]}})
    assert t == mesh(1, 3) and topology_to_json(t) == {"instance_count": 3, "instance_map": [[1], [0, 2], [1]]}
    assert not parse_topology({"instance_count": 3, "instance_map": [[1], [0], []]}).is_connected()
    with pytest.raises(TopologyError, match="self loop"):
        Topology(1, ((0,),))
