"""Processors are plugins: a processor registered from outside the library loads, runs, takes its own
options by keyword and shows up wherever processors are chosen, with no library file edited."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import fastpipe
from fastpipe.errors import InputError
from fastpipe.options import RunOptions
from fastpipe.runtime.processors import registry
from fastpipe.runtime.processors.base import Processor
from fastpipe.runtime.processors.reference import ReferenceProcessor
from tests.examples import GRAPHS

TP_MLP = GRAPHS / "tp_mlp" / "pipeline.json"


@dataclasses.dataclass(frozen=True)
class CountingOptions:
    """The counting processor's own option: how many calls it refuses after."""
    max_calls: int = 1000

    def __post_init__(self):
        if not isinstance(self.max_calls, int) or self.max_calls < 1:
            raise InputError(f"max_calls: expected an integer >= 1, found {self.max_calls!r}")


class CountingProcessor(Processor):
    """Wraps the reference processor and counts the parts it runs."""
    options = (CountingOptions,)
    background_compile = "eager"

    def __init__(self, program):
        self.program = program
        self.inner = ReferenceProcessor(program)
        self.parts = 0

    @classmethod
    def prepare(cls, program, prepared):
        proc = cls(program).attach(prepared)
        proc.max_calls = prepared.run_options.of(CountingOptions).max_calls
        return proc

    def run(self, parts, *, trace=None):
        self.parts += len(parts)
        if self.parts > self.max_calls:
            raise RuntimeError("too many calls")
        return self.inner.run(parts, trace=trace)

    def describe(self) -> str:
        return f"{self.parts} parts run"


@pytest.fixture
def counting():
    registry.register_processor("counting", CountingProcessor)
    yield CountingProcessor
    registry.unregister_processor("counting")


def test_a_processor_registered_from_outside_runs_a_pipeline(counting):
    ref = fastpipe.load(TP_MLP, processor="reference")
    sess = fastpipe.load(TP_MLP, processor="counting")
    assert sess.processor == "counting" and isinstance(sess.runner, CountingProcessor)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    out = sess.run({"x": x})
    torch.testing.assert_close(out["y"], ref.run({"x": x})["y"], rtol=0, atol=0)
    sess.run({"x": torch.cat([x, x])}, chunks=2)              # micro-batches reach run() as parts
    assert sess.runner.parts == 3
    assert sess.describe() == "counting processor (3 parts run)"
    assert set(sess.memory_report()) == {"cpu"}               # the base's defaults answer the rest
    assert sess.compile_state() == "compile off" and sess.capture() is False


def test_its_options_are_keywords_and_dataclasses(counting):
    sess = fastpipe.load(TP_MLP, processor="counting", max_calls=1)
    x = torch.randn(8, 64)
    sess.run({"x": x})
    with pytest.raises(RuntimeError, match="too many calls"):
        sess.run({"x": x})
    ro = RunOptions(processor="counting", processor_options=(CountingOptions(max_calls=5),))
    assert fastpipe.load(TP_MLP, run_options=ro).runner.max_calls == 5
    with pytest.raises(InputError, match=r"^max_calls: expected an integer >= 1, found 0$"):
        fastpipe.load(TP_MLP, processor="counting", max_calls=0)
    assert "max_calls" in registry.option_names()


def test_it_is_a_choice_everywhere_processors_are_chosen(counting):
    from fastpipe.cli.main import parser

    assert "counting" in registry.processor_names(one_process=True)
    args = parser().parse_args(["run", str(TP_MLP), "--processor", "counting"])
    assert args.processor == "counting"
    assert registry.with_fields(None, processor="counting").processor == "counting"


def test_unregistered_it_is_refused_with_the_list():
    with pytest.raises(InputError) as e:
        registry.with_fields(None, processor="counting")
    assert str(e.value) == ('processor: expected one of auto, reference, region, cpu, cuda, dist, found "counting"')
    with pytest.raises(ValueError, match="already registered"):
        registry.register_processor("region", CountingProcessor)
    with pytest.raises(ValueError, match="built-in"):
        registry.unregister_processor("region")
    with pytest.raises(TypeError, match="subclass of fastpipe.runtime.processors.base.Processor"):
        registry.register_processor("plain", object)


@pytest.mark.parametrize("name", registry.processor_names(), ids=lambda n: f"processor-{n}".replace("cuda", "gpu"))
def test_every_built_in_processor_implements_the_protocol(name):
    cls = registry.processor_class(name)
    assert issubclass(cls, Processor) and cls.name == name
    assert cls.run is not Processor.run                      # each runs parts its own way
    sig = inspect.signature(cls.run)
    assert list(sig.parameters)[:2] == ["self", "parts"] and "trace" in sig.parameters
    assert cls.background_compile in ("tiered", "warm-up", "eager")
    assert all(dataclasses.is_dataclass(t) for t in cls.options)
