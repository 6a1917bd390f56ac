"""fastpipe.lower: Pipeline -> Program, the checker/simulator, the step x slot table, buffer sizes."""
import itertools
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastpipe.errors import ValidationError
from fastpipe.format import parse_pipeline, read_pipeline
from fastpipe.lower import (Action, Program, ProgramError, Step, check_program, format_table, lower,
                            parse_action, parse_table, simulate)
from fastpipe.validate import validate_structure
from tests.docs import tp_doc
from tests.examples import EXAMPLES, GRAPHS


def checked_example(name):
    return validate_structure(read_pipeline(GRAPHS / name / "pipeline.json"))


def total_steps(program: Program) -> int:
    return sum(len(s) for s in program.steps.values())


def assert_sound(program: Program, checked) -> None:
    """The invariants every lowered Program has (beyond check_program itself)."""
    p = checked.pipeline
    check_program(program, checked)
    done = simulate(program)
    assert sorted(done) == sorted((s, i) for s in program.slots for i in range(len(program.steps[s])))
    finished = set()
    for slot, i in done:                              # every wait completed before the step
        for w in program.steps[slot][i].waits:
            assert w in finished
        finished.add((slot, i))
    # every comm group: one step on each member slot, listed in device_idx order
    for g, cg in checked.groups.items():
        want = [p.supertasks[m].device for m in cg.members]
        assert [s for s, _ in program.groups[g]] == want
        for slot in want:
            assert sum(st.group == g for st in program.steps[slot]) == 1
    # frees: never a pipeline output; every intermediate freed exactly once, on its producer slot
    outputs = set(p.output_names)
    freed = [(slot, t) for slot in program.slots for s in program.steps[slot] for t in s.frees]
    assert not outputs & {t for _, t in freed}
    assert len(freed) == len(set(freed)) == len({t for _, t in freed})
    produced = {(slot, t) for slot in program.slots for s in program.steps[slot]
                for t in p.supertasks[s.supertask].outputs if t not in outputs}
    assert set(freed) == produced
    # the table round-trips, with and without the pipeline
    for pipe in (p, None):
        back = parse_table(format_table(program, pipeline=pipe))
        assert list(back) == list(program.slots)
        for slot in program.slots:
            kinds = [(p.supertasks[s.supertask].kind if pipe else s.kind) for s in program.steps[slot]]
            assert back[slot] == [Action(k, s.supertask if s.kind == "compute" else s.group, s.waits)
                                  for k, s in zip(kinds, program.steps[slot])]


# ------------------------------------------------------------------------------ the examples
@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_lower_check_and_simulate(name):
    c = checked_example(name)
    program = lower(c)
    assert program.slots == tuple(c.pipeline.devices)
    assert_sound(program, c)
    assert len(simulate(program)) == total_steps(program)
    n_compute = sum(st.is_compute for st in c.pipeline.supertasks.values())
    n_comm = sum(st.is_comm for st in c.pipeline.supertasks.values())
    assert total_steps(program) == n_compute + n_comm
    assert all(program.peak_bytes[s] > 0 for s in program.slots)


def test_tp_mlp_table():
    c = checked_example("tp_mlp")
    program = lower(c)
    text = format_table(program, pipeline=c.pipeline)
    lines = text.splitlines()
    assert lines[0].split() == ["step", "0", "1"]
    assert lines[3].split() == ["2", "all_reduce:ar0<-1:0", "fx:7"]
    assert lines[5].split() == ["4", "reduce:red0<-1:2", "."]
    assert lines[-2].split() == ["peak", "4.0KiB", "4.0KiB"]
    assert lines[-1].split() == ["constants", "65.5KiB", "65.0KiB"]
    cells = parse_table(text)
    assert [str(a) for a in cells["0"]] == ["fx:1", "fx:2", "all_reduce:ar0<-1:0", "fx:6", "reduce:red0<-1:2"]
    groups0 = [a.name for a in cells["0"] if a.op in ("all_reduce", "reduce")]
    assert groups0 == ["ar0", "red0"]                 # the all_reduce group before the reduce group
    assert [str(a) for a in cells["1"]] == ["fx:3", "all_reduce:ar0<-0:1", "fx:7", "reduce:red0<-0:3"]
    # frees: a comm input stays alive until its group step; buffer sizes
    assert program.steps["0"][2].frees == ("pb_0",) and program.steps["1"][1].frees == ("p_1",)
    assert program.peak_bytes == {"0": 4096, "1": 4096}     # two [8, 64] f32 alive at most
    # f32 w1..w4 [64, 64], b1, b3, lnw, lnb [64]; slot 0 also reads b2 and b4
    assert program.constant_bytes == {"0": 4 * (4 * 64 * 64 + 6 * 64), "1": 4 * (4 * 64 * 64 + 4 * 64)}


def test_two_stage_skip_send_recv():
    c = checked_example("two_stage_skip")
    program = lower(c)
    cells = parse_table(format_table(program, pipeline=c.pipeline))
    assert [str(a) for a in cells["0"]] == ["fx:1", "send:p2p_skip", "send:p2p_h2<-1:0"]
    assert [str(a) for a in cells["1"]] == ["recv:p2p_skip<-0:0", "recv:p2p_h2<-0:1", "fx:6"]
    assert program.groups["p2p_h2"] == (("0", 2), ("1", 1))


# ------------------------------------------------------------------------------ buffer planning
def chain_doc() -> dict:
    """One slot: x -> a -> b -> c; y = f(a, c). w is a constant read twice."""
    t = {"x": {"shape": [4, 8], "dtype": "f32"},
         "w": {"shape": [8, 8], "dtype": "f32", "value": {"path": "w.safetensors", "format": "safetensors", "name": "w"}},
         "a": {"shape": [4, 8], "dtype": "f32"},       # 128 B
         "b": {"shape": [16, 8], "dtype": "f16"},      # 256 B
         "c": {"shape": [32, 8], "dtype": "f32"},      # 1024 B
         "y": {"shape": [2, 8], "dtype": "f32"}}       # 64 B (pipeline output)
    s = {"in": {"kind": "input", "inputs": [], "outputs": ["x"]},
         "1": {"kind": "fx", "inputs": ["x", "w"], "outputs": ["a"], "device": "0", "data": "AAAA"},
         "2": {"kind": "fx", "inputs": ["a"], "outputs": ["b"], "device": "0", "data": "AAAA"},
         "3": {"kind": "fx", "inputs": ["b"], "outputs": ["c"], "device": "0", "data": "AAAA"},
         "4": {"kind": "fx", "inputs": ["a", "c", "w"], "outputs": ["y"], "device": "0", "data": "AAAA"},
         "out": {"kind": "output", "inputs": ["y"], "outputs": []}}
    return {"name": "chain", "devices": {"0": {"kind": "cpu", "idx": 0}}, "tensors": t, "supertasks": s}


def test_peak_bytes_of_a_chain():
    c = validate_structure(parse_pipeline(chain_doc()))
    program = lower(c)
    assert_sound(program, c)
    assert [s.supertask for s in program.steps["0"]] == ["1", "2", "3", "4"]
    assert [s.frees for s in program.steps["0"]] == [(), (), ("b",), ("a", "c")]
    # step 0: a=128; step 1: +b=384; step 2: +c=1408 (peak), -b; step 3: +y=1216, -a -c
    assert program.peak_bytes == {"0": 128 + 256 + 1024}
    assert program.constant_bytes == {"0": 256}     # w counted once


def test_peak_bytes_keep_comm_inputs_alive():
    c = validate_structure(parse_pipeline(tp_doc()))
    program = lower(c)
    assert_sound(program, c)
    # slot r: p_r (128 B), then all_reduce -> y_r (128 B, an output) while p_r is still read
    assert program.steps["0"][1].frees == ("p_0",)
    assert program.peak_bytes == {"0": 256, "1": 256}
    assert program.constant_bytes == {"0": 256, "1": 256}


# ------------------------------------------------------------------------------ the checker refuses
def comm(slot, group, sid=None, waits=()):
    return Step(slot, "comm", sid or f"{group}{slot}", group=group, waits=tuple(waits))


def compute(slot, sid, waits=()):
    return Step(slot, "compute", sid, waits=tuple(waits))


def refused(program, message, marks=None, fn=check_program):
    with pytest.raises(ProgramError) as e:
        fn(program)
    assert isinstance(e.value, ValidationError)
    assert str(e.value) == message
    if marks is not None:
        assert e.value.marks == marks
    return e.value


def opposite_orders() -> Program:
    return Program(("0", "1"), {"0": (comm("0", "A"), comm("0", "B")), "1": (comm("1", "B"), comm("1", "A"))},
                   {"A": (("0", 0), ("1", 1)), "B": (("0", 1), ("1", 0))})


def test_refuses_collectives_in_opposite_orders():
    program = opposite_orders()
    err = refused(program, 'program: groups "A" and "B" are issued in opposite orders on slots "0" and "1"',
                  {"0": 0, "1": 0})
    table = format_table(program, mark=err.marks)
    rows = [ln.split() for ln in table.splitlines()]
    assert rows[1] == ["0", "!!comm:A", "!!comm:B"]
    assert rows[2] == ["1", "comm:B", "comm:A"]
    assert rows[-2] == ["peak", "-", "-"]
    cells = parse_table(table)
    assert cells["0"][0] == Action("comm", "A", (), marked=True) and not cells["0"][1].marked
    # the simulator alone sees the same hang as a deadlock
    refused(program, 'program: deadlock: slot "0" blocked at step 0 (group "A"), '
                     'slot "1" blocked at step 0 (group "B")', {"0": 0, "1": 0}, fn=simulate)


def test_refuses_a_cycle_of_waits():
    program = Program(("0", "1"),
                      {"0": (compute("0", "a", [("1", 1)]), compute("0", "b")),
                       "1": (compute("1", "c", [("0", 1)]), compute("1", "d"))}, {})
    err = refused(program, 'program: deadlock: slot "0" blocked at step 0 (supertask "a" waits for slot "1" step 1), '
                           'slot "1" blocked at step 0 (supertask "c" waits for slot "0" step 1)', {"0": 0, "1": 0})
    assert "!!compute:a<-1:1" in format_table(program, mark=err.marks)


def test_deadlock_after_progress_names_each_blocked_step():
    # slot 1 finishes a group with slot 2, then slot 0 waits for a step slot 1 never reaches
    program = Program(("0", "1", "2"),
                      {"0": (compute("0", "a"), comm("0", "G", waits=[("1", 2)])),
                       "1": (comm("1", "H"), compute("1", "b"), comm("1", "G")),
                       "2": (comm("2", "H"),)},
                      {"G": (("0", 1), ("1", 2)), "H": (("1", 0), ("2", 0))})
    refused(program, 'program: deadlock: slot "0" blocked at step 1 (group "G" waits for slot "1" step 2), '
                     'slot "1" blocked at step 2 (group "G" waits for slot "1" step 2)', {"0": 1, "1": 2})


def test_refuses_a_group_with_a_missing_member_step():
    program = Program(("0", "1"), {"0": (comm("0", "A"),), "1": (compute("1", "x"),)}, {"A": (("0", 0), ("1", 1))})
    refused(program, 'program: group "A" lists slot "1" step 1, which does not exist (slot "1" has 1 step)', {"0": 0})
    program = Program(("0", "1"), {"0": (comm("0", "A"),), "1": (compute("1", "x"), comm("1", "A"))},
                      {"A": (("0", 0),)})
    refused(program, 'program: slot "1" step 1 is a step of group "A", which does not list it', {"1": 1})
    program = Program(("0", "1"), {"0": (comm("0", "A"),), "1": (compute("1", "x"),)}, {"A": (("0", 0), ("1", 0))})
    refused(program, 'program: group "A" lists slot "1" step 0, which is a compute step', {"1": 0})


def test_refuses_a_wait_past_the_end():
    program = Program(("0", "1"), {"0": (compute("0", "a", [("1", 5)]),), "1": (compute("1", "b"),)}, {})
    err = refused(program, 'program: slot "0" step 0 waits for slot "1" step 5, past the end of slot "1" (1 step)',
                  {"0": 0})
    assert format_table(program, mark=err.marks).splitlines()[1].split() == ["0", "!!compute:a<-1:5", "compute:b"]
    refused(program, 'program: slot "0" step 0 waits for slot "1" step 5, past the end of slot "1" (1 step)', fn=simulate)


def test_refuses_against_the_pipeline():
    c = checked_example("tp_mlp")
    good = lower(c)
    s0 = list(good.steps["0"])
    # data not ready: fx:2 reads p_0 before fx:1 made it
    swapped = Program(good.slots, {**good.steps, "0": (s0[1], s0[0], *s0[2:])}, good.groups)
    with pytest.raises(ProgramError) as e:
        check_program(swapped, c)
    assert str(e.value) == ('program: slot "0" step 0 (supertask "2") reads "p_0" before any earlier step on slot "0" '
                            'produces it') and e.value.marks == {"0": 0}
    check_program(swapped)                               # structurally fine: only the pipeline knows
    # a pass that renames what a step writes must rename its readers too: the checker reads the steps
    renamed = Program(good.slots, {**good.steps, "0": (replace(s0[0], writes=("p_0#renamed", "pb_0")), *s0[1:])},
                      good.groups)
    with pytest.raises(ProgramError, match=r'^program: slot "0" step 1 \(supertask "2"\) reads "p_0" before'):
        check_program(renamed, c)
    # freeing too early, freeing a pipeline output, never freeing
    early = Program(good.slots, {**good.steps, "0": (s0[0], replace(s0[1], frees=("p_0", "pb_0")),
                                                     *s0[2:])}, good.groups)
    with pytest.raises(ProgramError, match=r'^program: slot "0" step 2 \(supertask "4"\) reads "pb_0", freed after step 1$'):
        check_program(early, c)
    out = Program(good.slots, {**good.steps, "0": (*s0[:4], replace(s0[4], frees=("d_0", "y")))},
                  good.groups)
    with pytest.raises(ProgramError, match=r'^program: slot "0" step 4 frees pipeline output "y"$'):
        check_program(out, c)
    leak = Program(good.slots, {**good.steps, "0": (*s0[:4], replace(s0[4], frees=()))},
                   good.groups)
    with pytest.raises(ProgramError, match=r'^program: slot "0" never frees "d_0"$'):
        check_program(leak, c)
    # a step missing against the pipeline's groups
    dropped = Program(good.slots, {**good.steps, "0": tuple(s0[:4])}, {**good.groups, "red0": (("1", 3),)})
    with pytest.raises(ProgramError, match=r'^program: supertask "8" \(reduce on slot "0"\) has no step$'):
        check_program(dropped, c)


def test_parse_action():
    for text in ["fx:7", "all_reduce:g0<-1:3", "!!send:p2p_h2<-1:0<-2:11", "recv:a:b<-x:y:0"]:
        assert str(parse_action(text)) == text
    assert parse_action("!!all_reduce:g0<-1:3<-2:0") == Action("all_reduce", "g0", (("1", 3), ("2", 0)), True)
    assert parse_action("recv:a:b<-x:y:0") == Action("recv", "a:b", (("x:y", 0),))
    for bad in ["fx", ":7", "fx:", "fx:7<-1", "fx:7<-1:x", "fx:7<-:3"]:
        with pytest.raises(ValueError):
            parse_action(bad)


# ------------------------------------------------------------------------------ property: random DAGs
@st.composite
def dag_docs(draw):
    """Compute chains on 2-3 slots joined by all_reduce groups (and send/recv pairs) in a random global order."""
    n = draw(st.integers(2, 3))
    slots = [str(i) for i in range(n)]
    ids = itertools.count(1)
    tensors = {"x": {"shape": [4, 8], "dtype": "f32"}}
    sts = {"in": {"kind": "input", "inputs": [], "outputs": ["x"]}}
    cur = {s: "x" for s in slots}                # the slot's running value
    made = {s: [] for s in slots}                # intermediates made on the slot (for extra reads)
    pending = {s: [] for s in slots}             # received tensors the next compute must read

    def tensor(slot, rows=4):
        name = f"t{next(ids)}_{slot}"
        tensors[name] = {"shape": [rows, 8], "dtype": "f32"}
        made[slot].append(name)
        return name

    def fx(slot, extra=()):
        ins = list(dict.fromkeys([cur[slot], *pending[slot], *extra]))
        out = tensor(slot)
        sts[str(next(ids))] = {"kind": "fx", "inputs": ins, "outputs": [out], "device": slot, "data": "AAAA"}
        pending[slot], cur[slot] = [], out

    event = st.one_of(st.tuples(st.just("fx"), st.sampled_from(slots), st.booleans()),
                      st.tuples(st.just("all_reduce"), st.lists(st.sampled_from(slots), min_size=2, unique=True)),
                      st.tuples(st.just("p2p"), st.permutations(slots)))
    for ev in draw(st.lists(event, max_size=10)):
        if ev[0] == "fx":
            slot, reuse = ev[1], ev[2]
            extra = [draw(st.sampled_from(made[slot]))] if reuse and made[slot] else []
            fx(slot, extra)
        elif ev[0] == "all_reduce":
            group = f"g{next(ids)}"
            for rank, slot in enumerate(sorted(ev[1])):
                out = tensor(slot)
                sts[str(next(ids))] = {"kind": "all_reduce", "inputs": [cur[slot]], "outputs": [out], "device": slot,
                                       "group": group, "device_idx": rank, "metadata": {"reduce_op": "sum"}}
                cur[slot] = out
        else:
            a, b = ev[1][0], ev[1][1]
            group = f"p{next(ids)}"
            r = tensor(b)
            sts[str(next(ids))] = {"kind": "send", "inputs": [cur[a]], "outputs": [], "device": a,
                                   "group": group, "device_idx": 0, "metadata": {}}
            sts[str(next(ids))] = {"kind": "recv", "inputs": [], "outputs": [r], "device": b,
                                   "group": group, "device_idx": 1, "metadata": {}}
            pending[b].append(r)
    for slot in slots:
        fx(slot)
    sts["out"] = {"kind": "output", "inputs": [cur[s] for s in slots], "outputs": []}
    return {"name": "dag", "devices": {s: {"kind": "cpu", "idx": int(s)} for s in slots},
            "tensors": tensors, "supertasks": sts}


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dag_docs())
def test_random_dags_lower_check_and_simulate(doc):
    c = validate_structure(parse_pipeline(doc))
    program = lower(c)
    assert_sound(program, c)
    # every slot issues the groups it shares with another slot in the one global order
    rank = {node: i for i, node in enumerate(c.order)}
    for slot in program.slots:
        seq = [rank[f'group "{s.group}"'] for s in program.steps[slot] if s.kind == "comm"]
        assert seq == sorted(seq)
