"""`fastpipe build`: split a local Hugging Face checkpoint folder into a tp x pp pipeline."""
from __future__ import annotations

from fastpipe.errors import InputError


def cmd_build(args) -> int:
    import time
    from pathlib import Path

    from fastpipe.builder.hf.build import build_hf

    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise InputError(f"model: expected a Hugging Face checkpoint folder with config.json, found \"{model_dir}\"")
    if args.tp < 1 or args.pp < 1 or args.batch < 1 or args.seq_len < 1:
        raise InputError(f"--tp/--pp/--batch/--seq-len: expected values >= 1, found {args.tp}/{args.pp}/{args.batch}/{args.seq_len}")
    if args.past_len is not None and args.past_len < 0:
        raise InputError(f"--past-len: expected >= 0, found {args.past_len}")
    t0 = time.perf_counter()
    try:
        built = build_hf(model_dir, tp=args.tp, pp=args.pp, batch=args.batch, seq_len=args.seq_len,
                         past_len=args.past_len, sequence_parallel=args.sequence_parallel,
                         split_points=args.split_points.split(",") if args.split_points else None)
    except ValueError as e:
        raise InputError(f"build: {' '.join(str(e).split())}") from None
    try:
        path = built.save(args.output, style=args.style)
    except OSError as e:
        raise InputError(f"-o/--output: {' '.join(str(e).split())}") from None
    n = len(built.doc["supertasks"]) - 2
    print(f"wrote {path}: {len(built.doc['devices'])} slots, {n} supertasks, built in {time.perf_counter() - t0:.1f} s")
    return 0
