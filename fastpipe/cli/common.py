"""What the CLI's commands share: load options from flags, reading and writing files, reporting a run."""
from __future__ import annotations

from contextlib import contextmanager

from fastpipe.errors import InputError

EXIT_INVALID = 2
EXIT_FAILED = 1


def load_options(args):
    from fastpipe.options import LoadOptions

    return LoadOptions(allow_outside_paths=args.allow_outside_paths, trust_export_archives=args.trust_export_archives,
                       upload=getattr(args, "upload", "pinned"))


def run_options(args, **overrides):
    """The RunOptions of the run flags (processor auto unless --processor), each field routed to its
    dataclass (fastpipe.runtime.processors.registry.with_fields)."""
    from fastpipe.runtime.processors.registry import with_fields

    fields = dict(processor=args.processor, compile=compile_mode(args), compile_policy=args.compile_errors,
                  cuda_graph=not args.no_cuda_graph, merge_shards=not getattr(args, "no_merge_shards", False),
                  fuse=getattr(args, "fuse", "auto"))
    fields.update(overrides)
    return with_fields(None, **fields)


def compile_mode(args) -> str:
    """RunOptions.compile of the flags: --compile background|wait|off (default background); --no-compile is off."""
    return "off" if getattr(args, "no_compile", False) else (getattr(args, "compile", None) or "background")


def device_map_of(args):
    from fastpipe.runtime.binding.device_map import parse_device_map_option

    return parse_device_map_option(args.device_map) if getattr(args, "device_map", None) else None


@contextmanager
def reading_safetensors(path: str, option: str):
    """Around opening a safetensors file: a missing or unreadable file becomes one InputError naming `option`."""
    from safetensors import SafetensorError

    try:
        yield
    except FileNotFoundError:
        raise InputError(f"{option}: expected a safetensors file, found no file \"{path}\"") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(f"{option}: expected a safetensors file, found \"{path}\" unreadable: {' '.join(str(e).split())}") from None


def read_tensors(path: str, option: str):
    from safetensors.torch import load_file

    with reading_safetensors(path, option):
        return load_file(path)


def check_counts(args) -> None:
    """--repeat, --warmup and --chunks of `fastpipe run` (one process or many)."""
    if args.repeat < 1 or args.warmup < 0:
        raise InputError(f"--repeat/--warmup: expected --repeat >= 1 and --warmup >= 0, found {args.repeat} and {args.warmup}")
    if args.chunks < 1:
        raise InputError(f"--chunks: expected >= 1, found {args.chunks}")


def check_writable(path: str, option: str) -> None:
    import os
    from pathlib import Path

    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise InputError(f"{option}: expected a file in an existing folder, found no folder \"{parent}\"")
    if Path(path).is_dir():
        raise InputError(f"{option}: expected a file path, found a folder \"{path}\"")
    if not os.access(parent, os.W_OK):
        raise InputError(f"{option}: expected a writable folder, found \"{parent}\" read-only")


def report_results(args, outs, expected) -> int:
    """The end of `fastpipe run` (single process, or rank 0 of a distributed run): the trace note,
    outputs written atomically, and the --check comparison (CheckMismatch on a mismatch)."""
    from fastpipe.atomic import atomic_path
    from fastpipe.compare import compare
    from fastpipe.errors import CheckMismatch

    if args.trace:
        print(f"wrote trace {args.trace}")
    if args.outputs:
        from safetensors.torch import save_file

        with atomic_path(args.outputs) as tmp:
            save_file({k: v.detach().cpu().contiguous() for k, v in outs.items()}, str(tmp))
        print(f"wrote {len(outs)} outputs to {args.outputs}")
    if expected is not None:
        rows = compare(outs, expected, args.rtol, args.atol)
        for r in rows:
            extra = f" ({r.why})" if r.why else ""
            print(f"  {r.name}: max abs {r.max_abs:.3g}, max rel {r.max_rel:.3g}: {'ok' if r.ok else 'MISMATCH'}{extra}")
        bad = [r.name for r in rows if not r.ok]
        if bad:
            raise CheckMismatch(f"--check: expected outputs to match {args.check}, found {len(bad)} mismatching ({', '.join(bad)})")
        print(f"check: {len(rows)} outputs match {args.check}")
    return 0
