"""Compile fastpipe's Triton kernels for a GPU (Hopper by default) on a machine that has none.

    python scripts/compile_kernels.py                     # the benchmark grid, bf16: the configs pick_config picks
    python scripts/compile_kernels.py --tune-candidates   # and every config bench_fused_kernels --tune times
    python scripts/compile_kernels.py --quick --json compiled.json   # the few distinct configs (CI)
    python scripts/compile_kernels.py --arch 80 --sms 108 --device-name "NVIDIA A100-SXM4-80GB"
    python scripts/compile_kernels.py --quick --config 128,256,64,8,3   # does this config fit? (bm,bn,bk,warps,stages)
    python scripts/compile_kernels.py --kernel matmul_reduce_scatter --ms 128 --config 128,128,64,8,3,4   # split-K 4
    python scripts/compile_kernels.py --kernel matmul_reduce_scatter --config 128,256,64,8,3,tma   # the TMA kernel

The interpreter (TRITON_INTERPRET=1) runs the kernels' arithmetic on the CPU, but never compiles
them: a config that cannot compile, or that needs more shared memory than the GPU gives one block
(it fails at launch there, with OutOfResources), would otherwise first show on a GPU, at its first
launch. Triton's wheel ships ptxas, so the whole compile (TTIR -> TTGIR -> LLVM -> PTX ->
cubin) runs here for a target named by hand. This script calls the public entry points
(matmul_reduce_scatter, all_gather_matmul) on meta tensors of the benchmark's layouts (b[i] =
w_i.t()), with Triton's driver replaced by one that names the target and launches nothing, and
pick_config answering as on that GPU (its SM count and name: the tuned table applies too). Each
compiled kernel is reported with its shared memory, registers and spills (ptxas -v), the MMA
instruction it uses (wgmma on Hopper; mma.sync is the pre-Hopper one) and how its loads are
pipelined (cp.async, or TMA), and Triton's launcher for it is generated as the first launch on
the GPU would (not built). It exits 1 when a config fails to compile, needs more shared memory than
the target has, spills registers, or has an argument list the launcher cannot take.

Nothing runs on a GPU: speed is for bench/bench_fused_kernels.py on the device.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fastpipe.kernels.launch_config import KernelConfig  # noqa: E402

mrs = agm = None  # the kernel modules, imported by main() once TRITON_INTERPRET is out of the way

# dynamic shared memory one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin), by compute capability
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
DEFAULT_NAME = {80: "NVIDIA A100-SXM4-80GB", 90: "NVIDIA H100 80GB HBM3"}


@dataclass
class Compiled:
    """One compiled kernel: what was called, the config, and what ptxas made of it."""

    call: str          # e.g. "matmul_reduce_scatter dim=0 M=1024 NK=4096 n=2 bf16"
    kernel: str        # _mm_sum_kernel / _split_k_sum_kernel / _gather_rows_kernel / _gather_cols_kernel / ...
    config: str        # "128x256x64 w8 s3"
    shared_bytes: int = 0
    registers: int = 0
    spill_bytes: int = 0
    mma: str = ""      # wgmma / mma.sync / none
    loads: str = ""    # tma / cp.async / ld.global
    loads_16b: bool = False   # every per-thread cp.async copies 16 bytes (the loads are vectorized)
    compile_s: float = 0.0
    error: str = ""
    launcher: str = "" # why Triton's launcher for it cannot be generated ('' where it can)
    problems: tuple = ()


def config_text(cfg: KernelConfig) -> str:
    return cfg.text()


class _TargetDriver:
    """Stands in for Triton's CUDA driver: names the target, has device 0 and stream 0, launches nothing."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("meta")


@contextlib.contextmanager
def compiling_for(arch: int, sms: int, device_name: str, record: list):
    """Within: the kernels compile for ``arch`` and never launch; each compile is appended to ``record``
    as (kernel name, config, CompiledKernel); pick_config answers as on a GPU with ``sms`` SMs named
    ``device_name``. Everything is restored on exit."""
    from triton.runtime.driver import driver

    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    real_pick = mrs.pick_config
    tma_kernels = (mrs.mm_sum_tma._mm_sum_tma_kernel, agm.gather_rows_tma._gather_rows_tma_kernel)

    def pick_as_on_gpu(M, N, K, dtype, device="cuda", **kw):
        return real_pick(M, N, K, dtype, torch.device("cuda"), **kw)

    def compile_only(kernel):
        run = kernel.run

        def run_warmup(*args, grid, warmup, **kwargs):
            compiled = run(*args, grid=grid, warmup=True, **kwargs)
            # (the split-K sum kernel has no K step and no grouping: 16 and 1 stand in)
            cfg = KernelConfig(kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs.get("BLOCK_K", 16),
                               kwargs.get("GROUP_M", 1), kwargs.get("num_warps", 4), kwargs.get("num_stages", 3),
                               kwargs.get("SPLIT_K", 1), tma=kernel in tma_kernels)
            record.append((kernel.fn.__name__, cfg, compiled))
            return compiled
        return run_warmup

    active = driver._active            # None until something asks: no CUDA driver needed to restore it
    driver.set_active(_TargetDriver(arch))
    try:
        for mod in (mrs, agm):                     # (all_gather_mm_kernel imported its own name)
            patch(mod, "_num_sms", lambda device: sms)
        patch(mrs, "_device_name", lambda device: device_name)
        for mod in (mrs, agm):
            patch(mod, "pick_config", pick_as_on_gpu)
            patch(mod, "_require_launchable", lambda what, device: None)
        patch(mrs._mm_sum_kernel, "run", compile_only(mrs._mm_sum_kernel))
        patch(mrs._split_k_sum_kernel, "run", compile_only(mrs._split_k_sum_kernel))
        for kernel in tma_kernels:
            patch(kernel, "run", compile_only(kernel))
        patch(agm._gather_rows_kernel, "run", compile_only(agm._gather_rows_kernel))
        patch(agm._gather_cols_kernel, "run", compile_only(agm._gather_cols_kernel))
        patch(agm._gather_split_k_sum_kernel, "run", compile_only(agm._gather_split_k_sum_kernel))
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        driver._active = active


def operands(kernel: str, M: int, NK: int, n: int, dim: int, dtype: torch.dtype):
    """Meta tensors in bench_fused_kernels' layouts (make_mrs / make_agm): b[i] = w_i.t()."""
    meta = dict(device="meta", dtype=dtype)
    if kernel == "matmul_reduce_scatter":
        a = [torch.empty(M, NK, **meta) for _ in range(n)]                  # [M, K] each
        w = [torch.empty(NK, NK, **meta) for _ in range(n)]                 # [N, K] each
    else:
        shape = (M // n, NK) if dim == 0 else (M, NK // n)
        a = [torch.empty(*shape, **meta) for _ in range(n)]                 # shards of [M, K]
        w = [torch.empty(NK // n, NK, **meta) for _ in range(n)]            # [N/n, K] each
    return a, [x.t() for x in w]


def call(kernel: str, a, b, dim: int, config: KernelConfig | None) -> None:
    if kernel == "matmul_reduce_scatter":
        mrs.matmul_reduce_scatter(a, b, dim=dim, config=config)
    else:
        agm.all_gather_matmul(a, b, dim=dim, config=config)


def ptxas_report(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill bytes stored) from ``ptxas -v`` of the kernel's PTX, with Triton's own ptxas."""
    from triton.backends.nvidia.compiler import get_ptxas
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        done = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", str(src), "-o", str(Path(d) / "k.o")],
                              capture_output=True, text=True, check=True)
    log = done.stdout + done.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else -1


def launcher_problem(compiled) -> str:
    """Generate Triton's CUDA launcher for this kernel as the GPU's first launch would (its argument
    list: pointers, tuples, TMA descriptors expanded to CUtensorMap), without building or calling it.
    '' where that works, else the error: a kernel can compile and still fail there (Triton 3.6 expands
    a tensor descriptor only as a top-level argument, not inside a tuple)."""
    from triton.backends.nvidia import driver as nvd

    src = compiled.src
    arg_idx = lambda x: (src.fn.arg_names.index(x),) if isinstance(x, str) else x  # noqa: E731
    constants = {arg_idx(k): v for k, v in getattr(src, "constants", {}).items()}
    signature = dict(src.signature)
    meta = getattr(compiled.metadata, "tensordesc_meta", None)
    try:
        if hasattr(nvd, "make_launcher"):                      # Triton <= 3.6: C source per kernel
            nvd.make_launcher(constants, signature, meta)
        else:                                                  # newer: one generic launcher, the signature expanded
            from triton.backends.driver import expand_signature
            expand_signature(signature.values(), meta, "nvTmaDesc")
        nvd.wrap_handle_tensordesc(lambda *args: None, signature, meta)
    except Exception as e:  # noqa: BLE001 - reported as the kernel's problem
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return ""


def describe(name: str, cfg: KernelConfig, compiled, arch: int, what: str, seconds: float) -> Compiled:
    ptx = compiled.asm["ptx"]
    regs, spill = ptxas_report(ptx, arch)
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    loads = "tma" if "cp.async.bulk.tensor" in ptx else "cp.async" if "cp.async" in ptx else "ld.global"
    sizes = set(re.findall(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)? \[[^\]]*\], \[[^\]]*\], (\w+)", ptx))
    wide = bool(sizes) and all(int(x, 0) == 16 for x in sizes)
    return Compiled(what, name, config_text(cfg), int(compiled.metadata.shared), regs, spill, mma, loads, wide,
                    round(seconds, 2), launcher=launcher_problem(compiled))


def check(row: Compiled, arch: int) -> Compiled:
    problems = []
    limit = SHARED_LIMIT.get(arch)
    if row.error:
        problems.append(f"does not compile: {row.error}")
    else:
        if limit is not None and row.shared_bytes > limit:
            problems.append(f"needs {row.shared_bytes} B of shared memory, sm_{arch} gives a block {limit}")
        if row.spill_bytes > 0:
            problems.append(f"spills {row.spill_bytes} B of registers")
        if row.launcher:
            problems.append(f"compiles, but Triton cannot make its launcher: {row.launcher}")
    row.problems = tuple(problems)
    return row


def cases(args) -> list[tuple[str, int, int, int, int, torch.dtype]]:
    """(kernel, M, NK, n, dim, dtype) of the benchmark grid (bench_fused_kernels' default), dims 0 and 1."""
    out = []
    kernels = ("matmul_reduce_scatter", "all_gather_matmul") if args.kernel == "both" else (args.kernel,)
    for kernel in kernels:
        for dt in args.dtypes:
            for M in args.ms:
                for NK in args.nks:
                    for n in args.ns:
                        for dim in (0, 1):
                            if (M if dim == 0 else NK) % n or NK % n:
                                continue
                            out.append((kernel, M, NK, n, dim, DTYPES[dt]))
    return out


def tune_configs(kernel: str, M: int, NK: int, n: int, dim: int, dtype: torch.dtype, arch: int) -> list[KernelConfig]:
    from bench.bench_fused_kernels import launcher_shape, tune_candidates   # the repository root is on sys.path
    launcher, lm, ln, _ = launcher_shape(kernel, M, NK, n, dim)
    return tune_candidates(lm, ln, dtype, smoke=False, launcher=launcher, tma=arch >= 90, n=n)


def compile_all(args) -> list[Compiled]:
    rows: list[Compiled] = []
    seen: set = set()
    for kernel, M, NK, n, dim, dtype in cases(args):
        a, b = operands(kernel, M, NK, n, dim, dtype)
        what = f"{kernel} dim={dim} M={M} NK={NK} n={n} {str(dtype).replace('torch.', '')}"
        configs = [args.config]
        if args.tune_candidates:
            configs += tune_configs(kernel, M, NK, n, dim, dtype, args.arch)
        for cfg in configs:
            record: list = []
            t0 = time.perf_counter()
            try:
                with compiling_for(args.arch, args.sms, args.device_name, record):
                    call(kernel, a, b, dim, cfg)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a row, reported
                rows.append(check(Compiled(what, kernel, config_text(cfg) if cfg else "picked",
                                           error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"), args.arch))
                continue
            for name, used, compiled in record:
                key = (name, compiled.metadata.hash)
                if key in seen:
                    continue
                seen.add(key)
                rows.append(check(describe(name, used, compiled, args.arch, what, time.perf_counter() - t0),
                                  args.arch))
    return rows


def table(rows: list[Compiled]) -> str:
    head = ("first call", "kernel", "config", "smem KiB", "regs", "spill B", "mma", "loads", "status")
    body = [(r.call, r.kernel, r.config, f"{r.shared_bytes / 1024:.0f}", str(r.registers), str(r.spill_bytes),
             r.mma, r.loads, "; ".join(r.problems) or "ok") for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: Hopper, 80: Ampere)")
    p.add_argument("--sms", type=int, default=132, help="the GPU's SM count, as pick_config would read it")
    p.add_argument("--device-name", default=None, help="the GPU's name, the tuned table's key")
    p.add_argument("--dtypes", default="bf16", help="comma list of bf16, f16, f32")
    p.add_argument("--ms", default="16,128,1024,8192")
    p.add_argument("--nk", dest="nks", default="4096,8192")
    p.add_argument("--ns", default="2,4")
    p.add_argument("--kernel", choices=("matmul_reduce_scatter", "all_gather_matmul", "both"), default="both")
    p.add_argument("--tune-candidates", action="store_true", help="also every config --tune would time")
    p.add_argument("--quick", action="store_true", help="M 16 and 1024, N = K 4096, n 2 (one config per "
                   "kernel, size class and dim: what CI compiles)")
    p.add_argument("--tf32", action="store_true", help="fp32 as with torch.backends.cuda.matmul.allow_tf32 "
                   "(tl.dot in tf32 on the tensor cores; default: exact fp32 on FMAs, as torch's default)")
    p.add_argument("--config", help="compile this config instead of pick_config's: block_m,block_n,block_k,"
                   "num_warps,num_stages[,split_k][,tma]")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.config:
        try:
            fields = args.config.split(",")
            tma = fields[-1].strip() == "tma"
            bm, bn, bk, warps, stages, *split = (int(x) for x in fields[:len(fields) - tma])
            if len(split) > 1:
                raise ValueError("too many fields")
            args.config = KernelConfig(bm, bn, bk, group_m=8, num_warps=warps, num_stages=stages,
                                       split_k=split[0] if split else 1, tma=tma)
        except ValueError as e:
            p.error(f"--config: expected block_m,block_n,block_k,num_warps,num_stages[,split_k][,tma] (powers of "
                    f"two >= 16 for the blocks), found {args.config!r} ({e})")
        if args.config.tma and args.arch < 90:
            p.error(f"--config: tma needs --arch 90 or newer (TMA came with Hopper), found --arch {args.arch}")
    if args.quick:
        args.ms, args.nks, args.ns = "16,1024", "4096", "2"
    args.ms = [int(x) for x in args.ms.split(",")]
    args.nks = [int(x) for x in args.nks.split(",")]
    args.ns = [int(x) for x in args.ns.split(",")]
    args.dtypes = [x.strip() for x in args.dtypes.split(",")]
    for dt in args.dtypes:
        if dt not in DTYPES:
            p.error(f"--dtypes: expected some of {sorted(DTYPES)}, found {dt!r}")
    args.device_name = args.device_name or DEFAULT_NAME.get(args.arch, "")
    return args


def main(argv=None) -> int:
    global mrs, agm
    args = parse(argv)
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True   # read by the launchers (_input_precision)
    if "fastpipe.kernels.mm_reduce_scatter_kernel" not in sys.modules:
        os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's
    from fastpipe.kernels import all_gather_mm_kernel as agm
    from fastpipe.kernels import mm_reduce_scatter_kernel as mrs
    if mrs.interpreting():
        print("compile_kernels: the kernels were imported under TRITON_INTERPRET=1; run this in a fresh process",
              file=sys.stderr)
        return 2
    if mrs._mm_sum_kernel is None:
        print("compile_kernels: needs triton, which is not installed", file=sys.stderr)
        return 2
    import triton
    t0 = time.perf_counter()
    rows = compile_all(args)
    print(f"# fastpipe Triton kernels compiled for sm_{args.arch} ({args.device_name or 'no name'}, {args.sms} SMs), "
          f"triton {triton.__version__}, torch {torch.__version__}: {len(rows)} kernels in "
          f"{time.perf_counter() - t0:.0f} s")
    print(table(rows))
    bad = [r for r in rows if r.problems]
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps({"arch": args.arch, "device_name": args.device_name, "sms": args.sms,
                                   "triton": triton.__version__, "torch": torch.__version__,
                                   "rows": [asdict(r) for r in rows]}, indent=1))
        tmp.replace(args.json)
    if bad:
        print(f"{len(bad)} of {len(rows)} kernels have problems (status column)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
