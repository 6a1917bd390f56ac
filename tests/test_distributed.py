"""The dist processor (fastpipe.runtime.processors.dist, dist_setup): pipelines run by several
processes with torch.distributed (gloo on CPU here; NCCL in the test marked cuda).

Multi-process tests launch `python -m torch.distributed.run --standalone --nproc-per-node N
-m fastpipe run ...` (or a small script using fastpipe.load(processor="dist")) in a subprocess
with a timeout, and compare what rank 0 wrote with the single-process reference processor.
Which launch covers what (each launch costs seconds, so they are few and each does much):
  2 ranks  every example (moe_all_to_all: 4 slots on 2 ranks, the generic path; seq_parallel
           with its slots swapped across ranks), the builder's tp=2 x pp=2 pipeline, a rank
           that fails, `--nproc 2` with micro-batches;
           a zoo of every comm kind in narrow and odd dtypes (bf16 avg, i16, bool, f8) on 3 slots,
           two of them sharing a rank (generic path);
  3 ranks  the zoo in member order (native path, the chunks already where the one-tensor
           collectives want them: no copies);
  4 ranks  moe_all_to_all with slots permuted over ranks; the zoo on 3 slots permuted over
           ranks 1..3 with rank 0 idle (native path); the builder pipeline through the Python
           API with chunks and a trace.
Every comm kind on a real one-rank group, NCCL and gloo, in-process: tests/test_dist_nccl_gpu.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastpipe
from fastpipe.cli import dist as cli_dist
from fastpipe.errors import InputError
from fastpipe.runtime.processors import dist_setup
from fastpipe.runtime.processors.dist import _acc, _Group, _stacked, _unstacked, _unwire, _wire, reduce_dtype

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"
ROOT = GRAPHS.parent
LAUNCH_TIMEOUT = 120


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("WORLD_SIZE", None)
    return env


def torchrun(n: int, *args: str, module: bool = True, timeout: float = LAUNCH_TIMEOUT) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "--max-restarts", "0",
           *(["-m", "fastpipe", "run"] if module else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)


def reference(pipeline, inputs: dict, chunks: int = 1) -> dict:
    return fastpipe.load(pipeline).run(inputs, chunks=chunks)


def assert_written(out_dir: Path, ref: dict, *, rtol=1e-4, atol=1e-5, name="out.safetensors") -> None:
    """Exactly one output file (no stray temporaries) holding outputs equal to the reference."""
    assert sorted(p.name for p in out_dir.iterdir()) == [name]
    got = load_file(out_dir / name)
    assert sorted(got) == sorted(ref)
    for k, v in ref.items():
        if v.dtype.is_floating_point:
            torch.testing.assert_close(got[k].float(), v.float(), rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")
        else:
            assert torch.equal(got[k], v), k


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


# ---------------------------------------------------------------------------- every example, 2 ranks
@pytest.mark.parametrize("example, slot_ranks", [
    ("tp_mlp", None),
    ("two_stage_skip", None),
    ("seq_parallel", "0=1,1=0"),      # members in the opposite order of their ranks
    ("moe_all_to_all", None),         # 4 slots on 2 ranks: two members of each group per rank (generic path)
])
def test_example_on_2_ranks(tmp_path, example, slot_ranks):
    g = GRAPHS / example
    out = tmp_path / "o"
    out.mkdir()
    args = [str(g / "pipeline.json"), "--inputs", str(g / "inputs.safetensors"), "--outputs", str(out / "out.safetensors"),
            "--check", str(g / "expected.safetensors"), "--no-compile", "--repeat", "2"]
    proc = ok(torchrun(2, *args, *(["--slot-ranks", slot_ranks] if slot_ranks else [])))
    assert "dist processor, 2 ranks (gloo)" in proc.stdout and "check: " in proc.stdout
    assert proc.stdout.count("dist processor") == 1          # rank 1 prints nothing
    assert_written(out, reference(g / "pipeline.json", load_file(g / "inputs.safetensors")))


def test_moe_on_4_ranks_permuted(tmp_path):
    g = GRAPHS / "moe_all_to_all"
    out = tmp_path / "o"
    out.mkdir()
    ok(torchrun(4, str(g / "pipeline.json"), "--inputs", str(g / "inputs.safetensors"), "--outputs", str(out / "out.safetensors"),
                "--no-compile", "--repeat", "1", "--warmup", "0", "--slot-ranks", "0=2,1=0,2=3,3=1"))
    assert_written(out, reference(g / "pipeline.json", load_file(g / "inputs.safetensors")))


# ---------------------------------------------------------------------------- every comm kind, odd dtypes
def _zoo(folder: Path) -> Path:
    """3 slots; each comm kind once, in dtypes the backends lack or reduce differently."""
    from fastpipe.builder.assemble import Assembler

    a = Assembler("zoo")
    for s in "012":
        a.slot(s, f"cpu:{s}")
    for s in "012":
        a.input(f"a{s}", (6, 6), "bf16")
        a.input(f"b{s}", (6, 6), "i16")
        a.input(f"c{s}", (6, 6), "bool")
        a.input(f"d{s}", (6, 6), "f8")
        a.input(f"e{s}", (6, 6), "f32")
    m = lambda v, o=None: [(s, [f"{v}{s}"], [f"{o}{s}"] if o else []) for s in "012"]  # noqa: E731
    a.comm("all_reduce", "ar_avg", m("a", "ar"), reduce_op="avg")
    a.comm("all_reduce", "ar_or", m("c", "or"), reduce_op="sum")
    a.comm("reduce_scatter", "rs_i16", m("b", "rs"), reduce_op="sum", dim=1)
    a.comm("reduce_scatter", "rs_min", m("e", "rn"), reduce_op="min", dim=0)
    a.comm("reduce", "red_max", [(s, [f"b{s}"], ["rmax"] if s == "2" else []) for s in "012"], reduce_op="max", dst="2")
    a.comm("all_gather", "ag_f8", m("d", "ag"), dim=1)
    a.comm("all_gather", "ag_rows", m("e", "ag0"), dim=0)
    a.comm("all_to_all", "a2a", m("a", "aa"), src_dim=0, dst_dim=1)
    a.comm("gather", "ga", [(s, [f"c{s}"], ["gat"] if s == "1" else []) for s in "012"], dim=0, dst="1")
    a.comm("broadcast", "bc", [(s, ["d1"] if s == "1" else [], [f"bc{s}"]) for s in "012"], src="1")
    a.send_recv("p2p", "2", "b2", "0", "sr0")
    outs = [f"{o}{s}" for o in ("ar", "or", "rs", "rn", "ag", "ag0", "aa", "bc") for s in "012"] + ["rmax", "gat", "sr0"]
    a.output(outs)
    path = folder / "zoo.json"
    path.write_text(json.dumps(a.to_json()))
    g = torch.Generator().manual_seed(0)
    inputs = {}
    for s in "012":
        inputs[f"a{s}"] = torch.randn(6, 6, generator=g).bfloat16()
        inputs[f"b{s}"] = torch.randint(-30000, 30000, (6, 6), generator=g, dtype=torch.int16)   # sums wrap
        inputs[f"c{s}"] = torch.rand(6, 6, generator=g) < 0.3
        inputs[f"d{s}"] = torch.randn(6, 6, generator=g).to(torch.float8_e4m3fn)
        inputs[f"e{s}"] = torch.randn(6, 6, generator=g)
    save_file(inputs, folder / "zoo_in.safetensors")
    return path


@pytest.mark.parametrize("nproc, slot_ranks", [
    (4, "0=3,1=1,2=2"),     # native: member i on sub-group rank (2, 0, 1)[i]; rank 0 idle, still gathers the outputs
    (3, "0=0,1=1,2=2"),     # native in member order: dim-0 chunks go as views of the input, no copy
    (2, "0=1,1=0,2=1"),     # generic: slots 0 and 2 share rank 1 (the send/recv pair is local there)
])
def test_every_comm_kind(tmp_path, nproc, slot_ranks):
    path = _zoo(tmp_path)
    out = tmp_path / "o"
    out.mkdir()
    ok(torchrun(nproc, str(path), "--inputs", str(tmp_path / "zoo_in.safetensors"), "--outputs", str(out / "out.safetensors"),
                "--no-compile", "--repeat", "1", "--warmup", "0", "--slot-ranks", slot_ranks))
    ref = reference(path, load_file(tmp_path / "zoo_in.safetensors"))
    assert_written(out, ref, rtol=1e-2, atol=1e-2)        # bf16 avg: the only rounding; the rest is exact
    got = load_file(out / "out.safetensors")
    for k in ref:
        if not k.startswith("ar"):
            assert torch.equal(got[k].view(torch.uint8) if got[k].dtype == torch.float8_e4m3fn else got[k],
                               ref[k].view(torch.uint8) if ref[k].dtype == torch.float8_e4m3fn else ref[k]), k


# ---------------------------------------------------------------------------- a builder-made pipeline
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    import torch.nn.functional as F
    from torch import nn

    from fastpipe.builder.api import build

    class Block(nn.Module):
        def __init__(self, d=16, h=32):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(x)))

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.b0, self.b1 = Block(), Block()

        def forward(self, x):
            return self.b1(self.b0(x))

    torch.manual_seed(0)
    m = Two().eval()
    x = torch.randn(4, 16)
    b = build(m, (x,), tp=2, pp=2, split_points=["b1"],
              plan={"b0.fc1": "column", "b0.fc2": "row", "b1.fc1": "column", "b1.fc2": "row"})
    d = tmp_path_factory.mktemp("built")
    path = b.save(d / "p")
    xs = torch.randn(8, 16)                      # two micro-batches of 4
    save_file({"input_0": xs[:4].contiguous()}, d / "in.safetensors")
    save_file({"input_0": xs}, d / "in2.safetensors")
    return path, d, m


def test_builder_tp2_pp2_on_2_ranks(tmp_path, built):
    path, d, m = built
    out = tmp_path / "o"
    out.mkdir()
    ok(torchrun(2, str(path), "--inputs", str(d / "in.safetensors"), "--outputs", str(out / "out.safetensors"),
                "--no-compile", "--repeat", "1"))
    x = load_file(d / "in.safetensors")
    assert_written(out, reference(path, x))
    with torch.no_grad():
        torch.testing.assert_close(load_file(out / "out.safetensors")["output"], m(x["input_0"]), rtol=1e-4, atol=1e-5)


API_SCRIPT = """
import sys, torch, torch.distributed as dist, fastpipe
from safetensors.torch import load_file, save_file
path, inputs, out, trace = sys.argv[1:]
sess = fastpipe.load(path, processor="dist")
outs = sess.run(load_file(inputs), chunks=2, trace=trace)
if dist.get_rank() == 0:
    save_file({k: v.contiguous() for k, v in outs.items()}, out)
else:
    assert outs == {}, sorted(outs)
"""


def test_builder_tp2_pp2_on_4_ranks_python_api_chunks_trace(tmp_path, built):
    path, d, _ = built
    script = tmp_path / "api.py"
    script.write_text(API_SCRIPT)
    out = tmp_path / "o"
    out.mkdir()
    ok(torchrun(4, str(script), str(path), str(d / "in2.safetensors"), str(out / "out.safetensors"), str(tmp_path / "t.json"),
                module=False))
    assert_written(out, reference(path, load_file(d / "in2.safetensors"), chunks=2))
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert lanes == {"slot 0", "slot 1", "slot 2", "slot 3"}
    steps = [e for e in ev if e["ph"] == "X"]
    assert {e["args"]["chunk"] for e in steps} == {0, 1} and {e["tid"] for e in steps} == {0, 1, 2, 3}


# ---------------------------------------------------------------------------- failures
def _failing(folder: Path) -> Path:
    """Slot 1 indexes a table with an out-of-range id (fails at run time); slot 0 waits for it in a recv."""
    from fastpipe.builder.assemble import Assembler

    a = Assembler("fails_on_slot_1")
    a.slot("0", "cpu:0")
    a.slot("1", "cpu:1")
    a.input("x", (3, 2), "f32")
    a.input("ids", (3,), "i64")
    a.input("table", (4, 2), "f32")
    a.fx("0", lambda x: x * 2, ["x"], ["h"], sid="7")
    a.fx("1", lambda i, t: t[i], ["ids", "table"], ["z"], sid="8")
    a.send_recv("p", "1", "z", "0", "z0")
    a.fx("0", lambda h, z: h + z, ["h", "z0"], ["y"])
    a.output(["y"])
    path = folder / "p.json"
    path.write_text(json.dumps(a.to_json()))
    save_file({"x": torch.ones(3, 2), "ids": torch.tensor([0, 9, 1]), "table": torch.zeros(4, 2)}, folder / "in.safetensors")
    return path


def test_a_failing_rank_ends_every_rank(tmp_path):
    path = _failing(tmp_path)
    t = time.monotonic()
    proc = torchrun(2, str(path), "--inputs", str(tmp_path / "in.safetensors"), "--outputs", str(tmp_path / "out.safetensors"),
                    "--no-compile", "--slot-ranks", "0=0,1=1", "--dist-timeout", "30", timeout=60)
    assert time.monotonic() - t < 60
    assert proc.returncode != 0
    line = next(x for x in proc.stderr.splitlines() if x.startswith("fastpipe: error: [rank 1]"))
    assert line.startswith('fastpipe: error: [rank 1] supertasks["8"] on slot "1": failed: IndexError'), line
    assert not (tmp_path / "out.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


@pytest.mark.parametrize("value, message", [
    ("0=0,1=5", '--slot-ranks["1"]: expected a rank 0..1, found 5'),
    ("0=0", '--slot-ranks: expected a rank for every slot, found none for slot "1"'),
    ("0=0,9=1", '--slot-ranks["9"]: expected a slot of the pipeline (0, 1), found an unknown slot'),
    ("0=0,1", '--slot-ranks[1]: expected SLOT=RANK (e.g. 0=0,1=1), found "1"'),
])
def test_bad_slot_ranks_refused_before_launch(value, message):
    proc = subprocess.run([sys.executable, "-m", "fastpipe", "run", str(GRAPHS / "tp_mlp" / "pipeline.json"), "--nproc", "2",
                           "--slot-ranks", value], capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"fastpipe: error: {message}"]


def test_forced_fusion_refused_before_launch():
    """The dist processor runs no fused kernels: --fuse always is refused in the parent, before any worker."""
    proc = subprocess.run([sys.executable, "-m", "fastpipe", "run", str(GRAPHS / "seq_parallel" / "pipeline.json"),
                           "--nproc", "2", "--fuse", "always"], capture_output=True, text=True, timeout=60, env=_env(),
                          cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        'fastpipe: error: fuse: "always" cannot fuse under the dist processor: the dist processor runs no fused '
        "kernels (a group's members may sit on different ranks, and a fused kernel needs every member in one "
        'process, on one device) (fuse="auto" or "off")']


def test_nproc_launches_micro_batches(tmp_path):
    """`fastpipe run --nproc 2` relaunches itself through torch's elastic launcher."""
    g = GRAPHS / "two_stage_skip"
    out = tmp_path / "o"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "fastpipe", "run", str(g / "pipeline.json"), "--nproc", "2", "--chunks", "2",
                           "--seed", "3", "--outputs", str(out / "out.safetensors"), "--no-compile", "--repeat", "1"],
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env=_env(), cwd=ROOT)
    ok(proc)
    from fastpipe.random_inputs import random_inputs

    p = fastpipe.format.read_pipeline(g / "pipeline.json")
    inputs = {k: torch.cat([v, v]) for k, v in random_inputs(p, 3).items()}
    assert_written(out, reference(g / "pipeline.json", inputs, chunks=2))


@pytest.mark.cuda
def test_world_size_1_nccl(tmp_path):
    """The CLI on one NCCL rank. Its groups have every member on rank 0, so they run the reference
    ("local"), not a collective: tests/test_dist_nccl_gpu.py runs every kind on NCCL."""
    g = GRAPHS / "tp_mlp"
    out = tmp_path / "o"
    out.mkdir()
    proc = ok(torchrun(1, str(g / "pipeline.json"), "--inputs", str(g / "inputs.safetensors"), "--outputs",
                       str(out / "out.safetensors"), "--device-map", "0=cuda:0,1=cuda:0", "--no-compile"))
    assert "(nccl)" in proc.stdout
    assert_written(out, reference(g / "pipeline.json", load_file(g / "inputs.safetensors")))


# ---------------------------------------------------------------------------- in-process units
def test_default_slot_ranks_are_contiguous_blocks():
    assert dist_setup.default_slot_ranks(list("abcde"), 2) == {"a": 0, "b": 0, "c": 0, "d": 1, "e": 1}
    assert dist_setup.default_slot_ranks(list("abcd"), 4) == {"a": 0, "b": 1, "c": 2, "d": 3}
    assert dist_setup.default_slot_ranks(list("abcdefg"), 3) == dict(zip("abcdefg", [0, 0, 0, 1, 1, 2, 2]))


@pytest.mark.parametrize("mapping, world, message", [
    ({"0": 2, "1": 0}, 2, 'slot_ranks["0"]: expected a rank 0..1, found 2'),
    ({"0": "x", "1": 0}, 2, 'slot_ranks["0"]: expected a rank 0..1, found "x"'),
    ({"0": True, "1": 0}, 2, 'slot_ranks["0"]: expected a rank 0..1, found True'),
    (None, 3, "WORLD_SIZE: expected at most 2 ranks"),
])
def test_check_slot_ranks(mapping, world, message):
    with pytest.raises(InputError) as e:
        dist_setup.check_slot_ranks(mapping, ["0", "1"], world)
    assert str(e.value).startswith(message)
    assert dist_setup.check_slot_ranks({"1": "0", "0": 1}, ["0", "1"], 2) == {"0": 1, "1": 0}


def test_child_argv_drops_nproc():
    assert cli_dist.child_argv(["run", "p.json", "--nproc", "2", "--no-compile"]) == ["run", "p.json", "--no-compile"]
    assert cli_dist.child_argv(["-v", "run", "p.json", "--nproc=4"]) == ["-v", "run", "p.json"]
    assert cli_dist.child_argv(["run", "p.json", "--npr", "2"]) == ["run", "p.json"]


def test_dist_needs_a_launched_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(InputError, match="expected a process launched by torchrun"):
        fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="dist")
    with pytest.raises(InputError, match='slot_ranks: expected processor="dist"'):
        fastpipe.load(GRAPHS / "tp_mlp" / "pipeline.json", processor="cpu", slot_ranks={"0": 0, "1": 0}, compile="off")


def test_wire_and_accumulation_dtypes():
    for dt, wire in [(torch.int16, torch.float16), (torch.float8_e4m3fn, torch.uint8), (torch.bfloat16, torch.bfloat16),
                     (torch.bool, torch.bool)]:
        x = torch.arange(6).to(dt)
        w = _wire(x)
        assert w.dtype == wire and torch.equal(_unwire(w, dt).view(torch.uint8), x.view(torch.uint8))
    assert _acc(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.float32
    assert _acc(torch.ones(2, dtype=torch.bool)).dtype == torch.uint8
    assert _acc(torch.ones(2, dtype=torch.int16)).dtype == torch.int32
    x = torch.ones(2)
    assert _acc(x) is not x
    assert _acc(torch.ones(2, dtype=torch.bfloat16), nccl=True).dtype == torch.bfloat16


def test_reduce_dtype_on_the_wire():
    """NCCL reduces f16/bf16 as they are; gloo (CPU) in f32, rounded once like the reference; f8 has
    no NCCL reduction in torch; neither backend has i16; bool goes as u8."""
    f8 = torch.float8_e4m3fn
    for dt, nccl, gloo in [(torch.bfloat16, torch.bfloat16, torch.float32), (torch.float16, torch.float16, torch.float32),
                           (f8, torch.float32, torch.float32), (torch.bool, torch.uint8, torch.uint8),
                           (torch.int16, torch.int32, torch.int32), (torch.float32, torch.float32, torch.float32),
                           (torch.int64, torch.int64, torch.int64)]:
        assert (reduce_dtype(dt, True), reduce_dtype(dt, False)) == (nccl, gloo), dt


def test_one_tensor_collectives_copy_only_when_they_must():
    x = torch.arange(24.).reshape(6, 4)
    s = _stacked(x, 0, 3, [0, 1, 2], torch.float32)          # dim 0, member order: a view
    assert s.shape == (3, 2, 4) and s.data_ptr() == x.data_ptr()
    for dim, order, dtype in [(-2, [0, 1, 2], torch.float32), (0, [2, 0, 1], torch.float32), (1, [1, 0], torch.float32),
                              (0, [0, 1, 2], torch.float64)]:
        n = len(order)
        s = _stacked(x, dim, n, order, dtype)
        chunks = x.split(x.shape[dim] // n, dim=dim)
        assert s.dtype == dtype and s.is_contiguous()
        assert all(torch.equal(s[k], chunks[i].to(dtype)) for k, i in enumerate(order)), (dim, order)
        if (dim % 2, order) == (0, [0, 1, 2]) and dtype == torch.float32:
            assert s.data_ptr() == x.data_ptr()
        else:
            assert s.data_ptr() != x.data_ptr()
    t = torch.arange(24.).reshape(3, 2, 4)
    u = _unstacked(t, 0, [0, 1, 2])
    assert u.shape == (6, 4) and u.data_ptr() == t.data_ptr()
    assert torch.equal(_unstacked(t, 0, [2, 0, 1]), torch.cat([t[2], t[0], t[1]], 0))
    assert torch.equal(_unstacked(t, -1, [1, 2, 0]), torch.cat([t[1], t[2], t[0]], 1))


def _plan(rank, local_rank, types, ranks, backend):
    devices = {s: torch.device("cuda", local_rank) if ranks[s] == rank and t == "cuda" else torch.device("cpu")
               for s, t in types.items()}
    return dist_setup.RankPlan(rank, 2, local_rank, ranks, types, devices, backend)


def test_only_a_rank_with_a_cuda_slot_sets_a_device(monkeypatch):
    """Mixed slots on a one-GPU machine: rank 0 (cuda:0) and rank 1 (LOCAL_RANK 1, CPU slots only).
    Only rank 0 calls set_device; device_id (eager NCCL init, a collective over the world) only when
    every rank uses a GPU (pure NCCL, an idle rank included)."""
    import torch.distributed as tdist

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(tdist, "is_initialized", lambda: False)
    monkeypatch.setattr(tdist, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend, kw.get("device_id", "absent"))))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    mixed, types, ranks = "cpu:gloo,cuda:nccl", {"0": "cuda", "1": "cpu"}, {"0": 0, "1": 1}
    cases = [
        (_plan(1, 1, types, ranks, mixed), None, [("init", mixed, "absent")]),
        (_plan(0, 0, types, ranks, mixed), torch.device("cuda", 0),
         [("set_device", torch.device("cuda", 0)), ("init", mixed, "absent")]),
        (_plan(1, 1, {"0": "cuda", "1": "cuda"}, {"0": 0, "1": 0}, "nccl"), torch.device("cuda", 1),    # idle rank
         [("set_device", torch.device("cuda", 1)), ("init", "nccl", torch.device("cuda", 1))]),
    ]
    for plan, dev, want in cases:
        calls.clear()
        assert dist_setup.rank_cuda_device(plan) == dev
        assert dist_setup.init_process_group(plan) is True
        assert calls == want, (plan, calls)


def test_make_plan_on_a_one_gpu_machine(monkeypatch):
    """LOCAL_RANK 1 with one GPU: fine when the rank holds only CPU slots, refused when it holds a CUDA one."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    p = SimpleNamespace(devices={"0": "cuda:0", "1": "cpu:0"})
    devs = {"0": torch.device("cuda", 0), "1": torch.device("cpu")}
    plan = dist_setup.make_plan(p, devs, None)
    assert plan.backend == "cpu:gloo,cuda:nccl" and plan.local_slots == ("1",)
    assert plan.slot_devices == {"0": torch.device("cpu"), "1": torch.device("cpu")}
    assert dist_setup.rank_cuda_device(plan) is None
    with pytest.raises(InputError, match=r"environment LOCAL_RANK: expected 0\.\.0 \(one GPU per rank\), found 1"):
        dist_setup.make_plan(p, devs, {"0": 1, "1": 0})


def test_member_order_vs_subgroup_order():
    g = _Group("g", "all_gather", {}, ("a", "b", "c"), ("0", "1", "2"), (3, 1, 2), "native", None, torch.device("cpu"),
               (), None)
    assert [g.gr(i) for i in range(3)] == [2, 0, 1]      # sub-group ranks sort the global ranks 1, 2, 3
    assert [g.at(k) for k in range(3)] == [1, 2, 0]
