"""`fastpipe build`: split a local Hugging Face checkpoint folder into a tp x pp pipeline, or (--serve)
into a serving set for `fastpipe generate` (fastpipe.serving.build.build_serving_set)."""
from __future__ import annotations

from fastpipe.errors import InputError

DEFAULT_SEQ_LEN = 128


HF_EXTRA = "pip install 'fastpipe[hf]'"


def need_transformers(command: str) -> None:
    """An InputError naming `command` when transformers cannot be imported (it is the [hf] extra)."""
    try:
        import transformers  # noqa: F401
    except ModuleNotFoundError as e:
        if (e.name or "transformers").split(".")[0] != "transformers":
            raise InputError(f"{command}: needs transformers ({HF_EXTRA}), which failed to import: "
                             f"{' '.join(str(e).split())}") from None
        raise InputError(f"{command}: needs transformers ({HF_EXTRA}), not installed") from None
    except ImportError as e:      # installed but broken (a missing or mismatched dependency of its own)
        raise InputError(f"{command}: needs transformers ({HF_EXTRA}), which failed to import: "
                         f"{' '.join(str(e).split())}") from None


def cmd_build(args) -> int:
    import time
    from pathlib import Path

    need_transformers("build")
    from fastpipe.builder.hf.build import build_hf

    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise InputError(f"model: expected a Hugging Face checkpoint folder with config.json, found \"{model_dir}\"")
    if args.tp < 1 or args.pp < 1:
        raise InputError(f"--tp/--pp: expected values >= 1, found {args.tp}/{args.pp}")
    if args.serve:
        return _build_serving_set(args, model_dir)
    given = _given(args, "--batches", "--prompt-lens")
    if args.cache_rows is not None and args.max_len is None:
        raise InputError("--cache-rows: expected with --max-len (a prefill into a static cache of cache-rows x "
                         "max-len positions), found without")
    if args.last_logits and args.max_len is not None and args.cache_rows is None:
        raise InputError("--last-logits/--max-len: expected one of them, found both (a static-cache step's logits "
                         "are one per row already; a prefill into the cache takes --cache-rows)")
    if given:
        raise InputError(f"{'/'.join(given)}: expected with --serve (they shape a serving set), found without")
    batch = 1 if args.batch is None else args.batch
    # a static-cache step (--max-len) is a decode step: one token unless --seq-len says otherwise
    seq_len = args.seq_len if args.seq_len is not None else (1 if args.max_len is not None else DEFAULT_SEQ_LEN)
    if batch < 1 or seq_len < 1:
        raise InputError(f"--batch/--seq-len: expected values >= 1, found {batch}/{seq_len}")
    if args.past_len is not None and args.past_len < 0:
        raise InputError(f"--past-len: expected >= 0, found {args.past_len}")
    if args.max_len is not None:
        if args.past_len is not None:
            raise InputError("--past-len/--max-len: expected one of them, found both (--max-len builds a step on a "
                             "static cache of max-len positions: no past length)")
        if args.sequence_parallel:
            raise InputError("--sequence-parallel/--max-len: expected one of them, found both (a static-cache "
                             "step has no sequence parallelism)")
        if args.max_len < seq_len:
            raise InputError(f"--max-len: expected >= --seq-len ({seq_len}), found {args.max_len}")
        if args.cache_rows is not None and args.cache_rows < batch:
            raise InputError(f"--cache-rows: expected >= --batch ({batch}: a cache row per prompt), "
                             f"found {args.cache_rows}")
    t0 = time.perf_counter()
    try:
        built = build_hf(model_dir, tp=args.tp, pp=args.pp, batch=batch, seq_len=seq_len,
                         past_len=args.past_len, sequence_parallel=args.sequence_parallel,
                         split_points=args.split_points.split(",") if args.split_points else None,
                         max_len=args.max_len, last_logits=args.last_logits, cache_rows=args.cache_rows)
    except ValueError as e:
        raise InputError(f"build: {' '.join(str(e).split())}") from None
    try:
        path = built.save(args.output, style=args.style)
    except OSError as e:
        raise InputError(f"-o/--output: {' '.join(str(e).split())}") from None
    n = len(built.doc["supertasks"]) - 2
    print(f"wrote {path}: {len(built.doc['devices'])} slots, {n} supertasks, built in {time.perf_counter() - t0:.1f} s")
    return 0


def int_list(text: str, option: str, low: int, high: int | None = None) -> list[int]:
    """'1,8' -> [1, 8] (sorted, without repeats); anything else is an InputError naming `option`."""
    parts = text.replace(",", " ").split()
    rng = f">= {low}" + (f" and <= {high}" if high is not None else "")
    try:
        vals = [int(x) for x in parts]
    except ValueError:
        vals = None
    if not vals or any(v < low or (high is not None and v > high) for v in vals):
        raise InputError(f"{option}: expected comma-separated integers {rng}, found {text!r}")
    return sorted(set(vals))


def _given(args, *flags: str) -> list[str]:
    """The flags the user gave (a value other than None; store_true flags: True; 0 counts as given)."""
    values = {f: getattr(args, f.lstrip("-").replace("-", "_")) for f in flags}
    return [f for f, v in values.items() if v is not None and v is not False]


def _build_serving_set(args, model_dir) -> int:
    import time
    from pathlib import Path

    from fastpipe.serving.build import SIDE_FILES, build_serving_set, default_prompt_lens

    given = _given(args, "--seq-len", "--past-len", "--batch", "--split-points", "--sequence-parallel",
                   "--cache-rows")
    if given:
        raise InputError(f"{'/'.join(given)}: expected none with --serve, found {len(given)} (a serving set takes "
                         "its shapes from --batches, --prompt-lens and --max-len, and has no split points or "
                         "sequence parallelism)")
    if args.max_len is None:
        raise InputError("--serve: expected --max-len M (the most positions a request uses: prompt + new tokens), "
                         "found none")
    if args.max_len < 2:
        raise InputError(f"--max-len: expected an integer >= 2, found {args.max_len}")
    _check_decoder(model_dir, args.max_len)
    batches = int_list(args.batches, "--batches", 1) if args.batches is not None else [1]
    lens = (int_list(args.prompt_lens, "--prompt-lens", 1, args.max_len) if args.prompt_lens is not None
            else default_prompt_lens(args.max_len))
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise InputError(f"-o/--output: expected a folder, found a file \"{out}\"")
    names = {f"prefill_b{b}_s{s}" for b in batches for s in lens} | {f"decode_b{b}" for b in batches}
    stale = sorted(p.parent.name for p in out.glob("*/pipeline.json") if p.parent.name not in names)
    if stale:           # fastpipe generate loads every */pipeline.json: old buckets would join the new set
        raise InputError(f"-o/--output: expected an empty folder or one this set overwrites, found other pipelines in "
                         f"\"{out}\": {', '.join(stale)} (remove them or write elsewhere)")
    t0 = time.perf_counter()
    try:
        paths = build_serving_set(model_dir, out, max_len=args.max_len, batches=batches, prompt_lens=lens,
                                  tp=args.tp, pp=args.pp, style=args.style)
    except (ValueError, OSError) as e:
        raise InputError(f"build: {' '.join(str(e).split())}") from None
    for p in paths:
        print(f"wrote {p}")
    side = [n for n in SIDE_FILES if (out / n).is_file()]
    print(f"wrote {len(paths)} pipelines under {out} (prefill: batches {batches} x prompt lengths {lens}; "
          f"decode: batches {batches}; max_len {args.max_len}) in {time.perf_counter() - t0:.1f} s"
          + (f"; beside them: {', '.join(side)}" if side else ""))
    return 0


def _check_decoder(model_dir, max_len: int) -> None:
    """Refuse, before any tracing, what build_serving_set would find out only while building: an
    encoder, or a max_len past the model's positions (the builder checks again)."""
    import json

    from fastpipe.builder.hf.families import family_for_model_type

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"model: expected a readable config.json in \"{model_dir}\", found: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict):
        raise InputError(f"model: expected config.json to hold an object, found {type(config).__name__}")
    try:
        family = family_for_model_type(config.get("model_type"))
    except ValueError as e:
        raise InputError(f"build: {' '.join(str(e).split())}") from None
    if not family.decoder:
        raise InputError(f"--serve: expected a decoder checkpoint (generation needs a KV cache), found model_type "
                         f"{config.get('model_type')!r}")
    limit = config.get("n_positions") or config.get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and max_len > limit:
        raise InputError(f"--max-len: expected at most the model's {limit} positions (config.json), found {max_len}")
