"""The region pass (fastpipe.lower.regions) as pure data: how it cuts a Program, and the checker that
refuses region lists which would run a step twice, out of order, split a group, read what is not
there, or put a step on another device."""
import dataclasses

import pytest

import fastpipe
from fastpipe.lower import ProgramError, check_program, check_regions, lower, with_regions
from fastpipe.lower.regions import Region, region_lines
from tests.examples import GRAPHS


@pytest.fixture(scope="module")
def tp():
    return fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="reference")


def _with(program, regions):
    return dataclasses.replace(program, regions=tuple(regions))


def test_one_device_is_one_region_with_the_pipeline_io(tp):
    program = with_regions(tp.program, {"0": "cpu", "1": "cpu"})
    (r,) = program.regions
    assert r.name == "r0" and r.device == "cpu" and r.reads == ("x",) and r.writes == ("y",) and r.frees == ("x",)
    check_program(program, tp.checked)
    assert region_lines(program) == ["region r0 on cpu: 9 steps of slots 0, 1; takes x; hands on y"]


def test_devices_are_cut_into_runs_and_crossing_groups(tp):
    program = with_regions(lower(tp.checked), {"0": "A", "1": "B"})      # unbound: devices are just labels
    kinds = [r.device for r in program.regions]
    assert set(kinds) == {"A", "B", None}
    for r in program.regions:
        if r.device is None:             # a group across devices is a region of its own
            (slot, i), *_ = r.steps
            assert sorted(r.steps) == sorted(program.groups[program.steps[slot][i].group])
    check_regions(program)
    # what crosses a cut is handed on and taken, and dropped after its last reader
    made = {n for r in program.regions for n in r.writes}
    assert {n for r in program.regions for n in r.reads} <= made | {"x"}
    assert "y" in program.regions[-1].writes and "y" not in {n for r in program.regions for n in r.frees}


def test_the_pass_stays_on_a_device_while_it_can(tp):
    """Slot 0's first compute and slot 1's first compute both precede the first group: with 'A' for
    both slots they are one region; the simulator's round-robin order would not change that."""
    program = with_regions(tp.program, {"0": "A", "1": "A"})
    assert len(program.regions) == 1


def _regions(tp):
    return with_regions(tp.program, {"0": "cpu", "1": "cpu"}).regions[0]


def test_refuses_a_step_run_twice_or_never(tp):
    r = _regions(tp)
    with pytest.raises(ProgramError, match=r'region "r1" runs slot "0" step 0, which region "r0" runs'):
        check_regions(_with(tp.program, [dataclasses.replace(r, frees=()),
                                         dataclasses.replace(r, name="r1", steps=r.steps[:1], reads=("x",), writes=(),
                                                             frees=())]))
    short = dataclasses.replace(r, steps=r.steps[:-2], writes=(), frees=())      # without the last group
    with pytest.raises(ProgramError, match=r'program: slot "0" step 4 is in no region'):
        check_regions(_with(tp.program, [short]))


def test_refuses_out_of_order_and_split_groups(tp):
    r = _regions(tp)
    swapped = dataclasses.replace(r, steps=(r.steps[1], r.steps[0], *r.steps[2:]))
    with pytest.raises(ProgramError, match=r'runs slot "0" step 1 before step 0'):
        check_regions(_with(tp.program, [swapped]))
    g = tp.program.groups["ar0"]
    split = [dataclasses.replace(r, steps=tuple(s for s in r.steps if s != g[1]))]
    with pytest.raises(ProgramError, match=r'runs part of group "ar0"'):
        check_regions(_with(tp.program, split))


def test_refuses_reads_that_are_not_there(tp):
    r = _regions(tp)
    with pytest.raises(ProgramError, match=r'slot "0" step 0 reads pipeline input "x", which is not in the region\'s reads'):
        check_regions(_with(tp.program, [dataclasses.replace(r, reads=())]))
    with pytest.raises(ProgramError, match=r'reads "p_0", which no earlier region hands on'):
        check_regions(_with(tp.program, [dataclasses.replace(r, reads=("x", "p_0"))]))
    with pytest.raises(ProgramError, match=r'hands on "nope", which it does not make'):
        check_regions(_with(tp.program, [dataclasses.replace(r, writes=("y", "nope"))]))
    with pytest.raises(ProgramError, match=r'frees pipeline output "y"'):
        check_regions(_with(tp.program, [dataclasses.replace(r, frees=("x", "y"))]))


def test_refuses_a_step_bound_to_another_device(tp):
    r = _regions(tp)
    with pytest.raises(ProgramError, match=r'region "r0" is on cuda:0, but slot "0" step 0 is bound to cpu'):
        check_regions(_with(tp.program, [dataclasses.replace(r, device="cuda:0")]))
    cross = Region("r0", None, r.steps, r.reads, r.writes, r.frees)
    with pytest.raises(ProgramError, match=r'spans devices but is not one comm group'):
        check_regions(_with(tp.program, [cross]))


def test_session_checks_its_regions(tp):
    sess = fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="region", compile="off")
    assert sess.program.regions and sess.program.regions[0].steps
    check_program(sess.program, sess.checked)            # what runs is what was proved
    assert tp.program.regions == ()                      # other processors get no regions
