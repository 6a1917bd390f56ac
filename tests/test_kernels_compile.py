"""The fused kernels compile for Hopper (sm_90a) with the configs pick_config picks, on a machine with no GPU.

The interpreter tests check the kernels' arithmetic; this checks what only a real compile shows:
that each config compiles, fits an H100's shared memory per block, does not spill registers, runs
its tiles on the Hopper MMA (wgmma) where the tile allows it, and pipelines its loads (cp.async).
scripts/compile_kernels.py does the work in a fresh process (the kernels must not have been defined
under TRITON_INTERPRET=1); Triton's wheel ships the ptxas it needs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "compile_kernels.py"


def compile_kernels(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "compiled.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")   # a cold compile, not a cached one
    done = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600)
    rows = json.loads(out.read_text())["rows"] if out.exists() else []
    return done, rows


def test_picked_configs_compile_for_hopper(tmp_path):
    done, rows = compile_kernels(tmp_path, "--quick", "--dtypes", "bf16,f32")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {r["kernel"] for r in rows} == {"_mm_sum_kernel", "_gather_rows_kernel", "_gather_cols_kernel"}
    for r in rows:
        assert not r["error"] and not r["problems"], r
        assert 0 < r["shared_bytes"] <= 227 * 1024 and 0 < r["registers"] <= 255 and r["spill_bytes"] == 0, r
        assert r["loads"] == "cp.async", r          # K loop software-pipelined (gather_rows: the alignment hint)
        assert r["loads_16b"], r                    # every copy 16 bytes: vectorized along K and N
        bm = int(r["config"].split("x")[0])
        if "bfloat16" in r["call"]:
            # 128-row tiles on the warpgroup MMA; decode-sized tiles (16 rows) on mma.sync
            assert r["mma"] == ("wgmma" if bm >= 64 else "mma.sync"), r
    bf16 = [r for r in rows if "bfloat16" in r["call"]]
    assert {int(r["config"].split("x")[0]) for r in bf16} == {16, 128}   # M=16 and M=1024 pick both classes
    f32 = [r for r in rows if "float32" in r["call"]]
    assert f32 and all(r["config"].endswith("w8 s3") for r in f32 if r["config"] != "64x128x32 w8 s2")   # 4 warps spilled
    assert [r["kernel"] for r in f32 if r["config"] == "64x128x32 w8 s2"] == ["_gather_cols_kernel"]  # 3 stages spilled
    assert "compiled for sm_90" in done.stdout and "| ok" in done.stdout


def test_a_config_too_big_for_the_gpu_fails(tmp_path):
    # (128 + 256) x 128 bf16 x 4 stages = 384 KiB of shared memory; an H100 gives a block 227 KiB
    done, rows = compile_kernels(tmp_path, "--quick", "--kernel", "matmul_reduce_scatter",
                                 "--ms", "1024", "--config", "128,256,128,8,4")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert rows and all(any("shared memory" in p for p in r["problems"]) for r in rows), rows
    assert "have problems" in done.stderr


def test_bad_config_argument_is_refused(tmp_path):
    done, rows = compile_kernels(tmp_path, "--quick", "--config", "100,32,32,4,3")
    assert done.returncode == 2 and not rows
    assert "--config: expected block_m,block_n,block_k,num_warps,num_stages" in done.stderr
    assert "Traceback" not in done.stderr


def test_spills_and_errors_are_problems():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import compile_kernels as ck
    finally:
        sys.path.remove(str(SCRIPT.parent))
    ok = ck.check(ck.Compiled("c", "k", "cfg", shared_bytes=1024, registers=100), 90)
    assert ok.problems == ()
    spill = ck.check(ck.Compiled("c", "k", "cfg", shared_bytes=1024, registers=255, spill_bytes=8), 90)
    assert spill.problems == ("spills 8 B of registers",)
    broken = ck.check(ck.Compiled("c", "k", "cfg", error="CompilationError: x"), 90)
    assert broken.problems == ("does not compile: CompilationError: x",)
    no_launcher = ck.check(ck.Compiled("c", "k", "cfg", shared_bytes=1024, registers=100, launcher="AssertionError: "),
                           90)
    assert no_launcher.problems == ("compiles, but Triton cannot make its launcher: AssertionError: ",)
    ampere = ck.check(ck.Compiled("c", "k", "cfg", shared_bytes=200 * 1024, registers=100), 80)
    assert ampere.problems and "sm_80" in ampere.problems[0]


def test_importing_the_script_leaves_the_environment_alone():
    code = ("import os, sys; os.environ['TRITON_INTERPRET'] = '1'; sys.path.insert(0, 'scripts'); "
            "import compile_kernels; assert os.environ['TRITON_INTERPRET'] == '1'; "
            "assert 'fastpipe.kernels.mm_reduce_scatter_kernel' not in sys.modules; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_tf32_puts_fp32_on_the_tensor_cores(tmp_path):
    done, rows = compile_kernels(tmp_path, "--quick", "--dtypes", "f32", "--tf32", "--kernel", "matmul_reduce_scatter",
                                 "--ms", "1024")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert rows and all(r["mma"] == "wgmma" and not r["problems"] for r in rows), rows


def test_a_split_k_config_compiles_for_hopper(tmp_path):
    """split-K 4 on 128x128 tiles (M 128, where a plain config has few tiles): the shares' kernel keeps
    wgmma and pipelined loads, and the kernel that adds the shares compiles without spills."""
    done, rows = compile_kernels(tmp_path, "--kernel", "matmul_reduce_scatter", "--ms", "128", "--nk", "4096",
                                 "--ns", "2", "--config", "128,128,64,8,3,4")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    shares = [r for r in rows if r["kernel"] == "_mm_sum_kernel"]
    sums = [r for r in rows if r["kernel"] == "_split_k_sum_kernel"]
    assert shares and sums and len(rows) == len(shares) + len(sums), rows
    for r in rows:
        assert not r["problems"] and r["spill_bytes"] == 0 and r["config"].endswith(" k4"), r
    assert all(r["mma"] == "wgmma" and r["loads"] == "cp.async" for r in shares), shares


def test_the_gather_split_k_configs_compile_for_hopper(tmp_path):
    """all_gather_matmul split-K 4 at a decode's M (16 x 2048 tiles of 64 columns, 2 outputs), dims 0 (gather_rows)
    and 1 (gather_cols): the shares' kernels keep pipelined loads, and the one launch that adds every output's
    shares compiles without spills."""
    done, rows = compile_kernels(tmp_path, "--kernel", "all_gather_matmul", "--ms", "16", "--nk", "4096",
                                 "--ns", "2", "--config", "16,64,64,4,4,4")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    shares = [r for r in rows if r["kernel"] in ("_gather_rows_kernel", "_gather_cols_kernel")]
    sums = [r for r in rows if r["kernel"] == "_gather_split_k_sum_kernel"]
    assert {r["kernel"] for r in shares} == {"_gather_rows_kernel", "_gather_cols_kernel"} and sums, rows
    for r in shares + sums:
        assert not r["problems"] and r["spill_bytes"] == 0 and r["config"].endswith(" k4"), r
    assert all(r["loads"] == "cp.async" for r in shares), shares


def test_the_tma_kernels_compile_for_hopper_with_tma_loads(tmp_path):
    """KernelConfig(tma=True): both persistent kernels load every operand tile with TMA
    (cp.async.bulk.tensor) into the warpgroup MMA, for b = w.t() (transposed boxes) in bf16, dims 0 and
    1, without spills (128x256x64 on 8 warps, 3 stages: 144 KiB of shared memory); gather_rows' builds
    its descriptors on the device (global scratch, which its launcher must pass)."""
    done, rows = compile_kernels(tmp_path, "--ms", "1024", "--nk", "4096", "--ns", "2",
                                 "--config", "128,256,64,8,3,tma")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kernels = [r["kernel"] for r in rows]
    assert kernels.count("_gather_rows_tma_kernel") == 1 and set(kernels) == {"_mm_sum_tma_kernel",
                                                                              "_gather_rows_tma_kernel"}, rows
    for r in rows:
        assert not r["problems"] and r["spill_bytes"] == 0 and r["config"] == "128x256x64 w8 s3 tma", r
        assert r["mma"] == "wgmma" and r["loads"] == "tma", r
        assert r["launcher"] == "", r       # the descriptors are top-level arguments (Triton 3.6's launcher)


def test_tma_needs_a_hopper_target(tmp_path):
    done, rows = compile_kernels(tmp_path, "--arch", "80", "--config", "128,256,64,8,3,tma")
    assert done.returncode == 2 and not rows
    assert "--config: tma needs --arch 90 or newer" in done.stderr and "Traceback" not in done.stderr
