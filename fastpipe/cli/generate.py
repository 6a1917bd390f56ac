"""`fastpipe generate`: stream tokens from a serving set (`fastpipe build --serve`) for one prompt.

Text in and out when the folder holds a tokenizer (build_serving_set links the model folder's
tokenizer files and config.json beside the pipelines; fastpipe.serving.tokenizer reads them and
detokenises the stream), token ids otherwise. Tokens go to stdout
as the engine makes them; stderr gets the load/warm-up time, a progress bar (only when stderr is
a terminal and stdout is not: on one terminal the streamed text is the progress) and one closing
line "N tokens in X s (Y tokens/s, first token after Z ms)". --quiet keeps stderr for errors.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from fastpipe.errors import InputError

DEFAULT_MAX_NEW_TOKENS = 32


def cmd_generate(args) -> int:
    from fastpipe.cli.common import compile_mode, device_map_of
    from fastpipe.serving.tokenizer import Tokenizer, has_tokenizer

    folder = Path(args.serving_set)
    check_serving_folder(folder)
    sampling = sampling_params(args)
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens: expected an integer >= 1, found {args.max_new_tokens}")
    device_map = device_map_of(args)
    want_text = not args.ids
    tok = None
    if (args.prompt is not None or want_text) and has_tokenizer(folder):
        tok = Tokenizer.load(folder, who="generate", otherwise="give token ids with --prompt-ids and print ids with --ids")
    if args.prompt is not None:
        if tok is None:
            raise InputError(f"--prompt: expected a folder with a tokenizer (tokenizer.json, tokenizer_config.json, ...), "
                             f"found none in \"{folder}\"; give token ids with --prompt-ids 5,7,9")
        ids = tok.encode(args.prompt)
    else:
        ids = parse_ids(args.prompt_ids, "--prompt-ids")
    printer = TextPrinter(tok, sys.stdout) if want_text and tok is not None else IdPrinter(sys.stdout)
    say = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))

    t = time.perf_counter()
    mode = compile_mode(args)
    engine = open_engine(folder, args.batch, processor=args.processor, compile=mode, device_map=device_map)
    failed = True
    try:
        load_s = time.perf_counter() - t
        # default: 32 tokens, or what fits in max_len after the prompt (an explicit value is checked as given)
        max_new = args.max_new_tokens if args.max_new_tokens is not None else \
            max(1, min(DEFAULT_MAX_NEW_TOKENS, engine.max_len - len(ids)))
        engine.check(ids, max_new_tokens=max_new, sampling=sampling)   # bad input fails now, not after compiling
        warm_s = engine.warmup()                # Engine(warmup=True) would do the same in its constructor
        how = {"wait": f", compiled in {warm_s:.1f} s", "off": " (eager)",
               "background": " (eager at once; each bucket compiled in the background as it is used)"}[mode]
        say(f"loaded {len(engine.buckets.sessions())} pipelines from {folder} in {load_s:.1f} s{how}"
            + f": decode batch {engine.batch}, max_len {engine.max_len}, prompts up to "
              f"{engine.buckets.longest_prompt} tokens")
        bar = Progress(sys.stderr, enabled=not args.quiet and _isatty(sys.stderr) and not _isatty(sys.stdout))
        t0 = time.perf_counter()
        req = engine.submit(ids, max_new_tokens=max_new, sampling=sampling, ignore_eos=args.ignore_eos)
        first, n, swap = None, 0, None         # swap: (tokens, seconds) when the decode step ran compiled first
        bar.start(max_new, t0)
        try:
            for token in req:
                n += 1
                if first is None:
                    first = time.perf_counter() - t0
                if swap is None and mode == "background" and runs_compiled(engine.decode):
                    swap = (n, time.perf_counter() - t0)
                printer.add(token)
                bar.update(n)
        finally:
            bar.clear()
            printer.finish()
        seconds = time.perf_counter() - t0
        compiled = compile_line(engine.decode, swap, n, seconds, first) if mode == "background" else None
        failed = False
    finally:
        engine.close(cancel=failed)
    stop = {"eos": "stopped at EOS", "length": "reached --max-new-tokens"}.get(req.finish_reason, req.finish_reason)
    say(f"{n} tokens in {seconds:.2f} s ({n / seconds:.1f} tokens/s, first token after {first * 1e3:.0f} ms); {stop}")
    if compiled is not None:
        say(compiled)
    return 0


def runs_compiled(session) -> bool:
    """Whether the session runs a compiled graph now (tiered: swapped in and kept after measuring)."""
    return any(cg.stage == "compiled" for cg in session.compiled_graphs().values())


def compile_line(decode, swap, n: int, seconds: float, first: float) -> str:
    """The decode step's compile, in one line: when it was swapped in and the speed before and after."""
    if swap is None:
        return f"decode step: {decode.compile_state()} (ran eagerly throughout)"
    k, at = swap
    eager = (k - 1) / (at - first) if k > 1 and at > first else float("nan")
    after = (n - k) / (seconds - at) if n > k and seconds > at else float("nan")
    return (f"decode step: compiled in the background, swapped in at token {k} ({at:.1f} s): {eager:.1f} tokens/s "
            f"eager before, {after:.1f} tokens/s compiled after")


def sampling_params(args):
    """SamplingParams of the flags; each bad value is an InputError naming its flag."""
    from fastpipe.serving.sampling import MIN_TEMPERATURE, SamplingParams

    t, k, p, s = args.temperature, args.top_k, args.top_p, args.seed
    if not (math.isfinite(t) and (t == 0 or t >= MIN_TEMPERATURE)):
        raise InputError(f"--temperature: expected 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, found {t}")
    if k is not None and k < 0:
        raise InputError(f"--top-k: expected an integer >= 0 (0: off), found {k}")
    if p is not None and not 0 < p <= 1:
        raise InputError(f"--top-p: expected 0 < top-p <= 1, found {p}")
    if s is not None and not 0 <= s < 2**64:
        raise InputError(f"--seed: expected 0 <= seed < 2**64, found {s}")
    if t == 0 and (k is not None or p is not None):
        given = "/".join(f for f, v in (("--top-k", k), ("--top-p", p)) if v is not None)
        raise InputError(f"{given}: expected --temperature > 0 with it (greedy decoding ignores it), found temperature 0")
    params = SamplingParams(temperature=t, top_k=k or 0, top_p=1.0 if p is None else p, seed=s)
    params.check()
    return params


def parse_ids(text: str, option: str) -> list[int]:
    parts = text.replace(",", " ").split()
    try:
        return [int(x) for x in parts]
    except ValueError:
        bad = next(x for x in parts if not x.lstrip("-").isdigit())
        raise InputError(f"{option}: expected comma-separated integer token ids, found {bad!r}") from None


def check_serving_folder(folder: Path) -> None:
    """One InputError line unless `folder` looks like a serving set."""
    if not folder.is_dir():
        raise InputError(f"serving set: expected a folder written by `fastpipe build --serve`, found no folder \"{folder}\"")
    if (folder / "pipeline.json").is_file() and not any(folder.glob("*/pipeline.json")):
        raise InputError(f"serving set: expected prefill and decode pipelines in subfolders of \"{folder}\", found a "
                         "single pipeline.json (build with `fastpipe build MODEL -o OUT --serve --max-len M`)")


def open_engine(folder: Path, batch: int | None, *, largest: bool = False, **load_kwargs):
    """The Engine on the folder, not warmed up yet (ServingBuckets.warmup compiles every bucket).
    batch None: the smallest decode bucket (one prompt runs on as few rows as the set allows), or with
    largest=True the largest (a server: as many rows as the set allows)."""
    from fastpipe.serving.buckets import ServingBuckets
    from fastpipe.serving.engine import Engine

    buckets = ServingBuckets(folder, **load_kwargs)
    try:
        rows = sorted(buckets.decodes)
        if batch is not None and batch not in rows:
            raise InputError(f"--batch: expected one of the decode buckets {rows}, found {batch}")
        default = rows[-1] if largest else rows[0]
        return Engine(folder, batch=batch if batch is not None else default, buckets=buckets, warmup=False)
    except BaseException:
        buckets.close()
        raise


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class IdPrinter:
    def __init__(self, out):
        self.out, self.started = out, False

    def add(self, token: int) -> None:
        self.out.write(f" {token}" if self.started else str(token))
        self.out.flush()
        self.started = True

    def finish(self) -> None:
        if self.started:
            self.out.write("\n")
            self.out.flush()


class TextPrinter:
    """Writes the text of the tokens as they come (fastpipe.serving.tokenizer.TextStream: never half a
    character), then the rest and a newline at the end. tok: anything with decode(ids, skip_special_tokens=)."""

    def __init__(self, tok, out):
        from fastpipe.serving.tokenizer import TextStream

        self.stream, self.out = TextStream(tok), out

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()

    def add(self, token: int) -> None:
        self._write(self.stream.add(token))

    def finish(self) -> None:
        if not self.stream.tokens:
            return
        self._write(self.stream.finish())
        self.out.write("\n")
        self.out.flush()


class Progress:
    """`\\r[#####     ] 12/32 tokens  85.1 tok/s` on a terminal, redrawn at most 10 times a second."""

    WIDTH = 30

    def __init__(self, out, enabled: bool):
        self.out, self.enabled = out, enabled
        self.total, self.t0, self.last, self.drawn = 1, 0.0, 0.0, 0

    def start(self, total: int, t0: float) -> None:
        self.total, self.t0 = total, t0

    def update(self, n: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if n < self.total and now - self.last < 0.1:
            return
        self.last = now
        fill = self.WIDTH * n // self.total
        rate = n / max(now - self.t0, 1e-9)
        line = f"\r[{'#' * fill}{' ' * (self.WIDTH - fill)}] {n}/{self.total} tokens  {rate:.1f} tok/s"
        self.out.write(line + " " * max(0, self.drawn - len(line)))
        self.out.flush()
        self.drawn = len(line)

    def clear(self) -> None:
        if self.enabled and self.drawn:
            self.out.write("\r" + " " * self.drawn + "\r")
            self.out.flush()
            self.drawn = 0
