"""The `fastpipe` command line (also `python -m fastpipe`): the parser and the one-line error contract.

Exit status: 0 success; 2 anything given is invalid (pipeline, param files,
payloads, inputs, options); 1 a valid run failed or --check found a mismatch.
Errors print as one line (`fastpipe: error: ...`); --verbose adds the traceback.
The commands live in fastpipe.cli.show (validate, show), fastpipe.cli.run, fastpipe.cli.dist
(multi-process runs), fastpipe.cli.build (also --serve: a serving set), fastpipe.cli.generate,
fastpipe.cli.serve (the OpenAI-compatible server) and fastpipe.cli.tune.
"""
from __future__ import annotations

import argparse
import difflib
import sys
import traceback

from fastpipe.cli import build, generate, run, serve, show, tune
from fastpipe.cli.common import EXIT_FAILED
from fastpipe.errors import FastpipeError, InputError
from fastpipe.runtime.processors.registry import AUTO, processor_names


PROG = "fastpipe"


class UsageError(InputError):
    """An argparse error: one `fastpipe: error: ...` line naming the (sub)command, then its usage line."""

    def __init__(self, message: str, usage: str):
        super().__init__(message)
        self.usage = usage


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: exit 2, the message once, no traceback
        raise UsageError(f"{self.command_context()}{message}", short_usage(self))

    def command_context(self) -> str:
        """'run: ' for `fastpipe run`'s parser; '' for the top-level one (main prints 'fastpipe: error: ')."""
        rest = self.prog[len(PROG):].strip() if self.prog.startswith(PROG) else self.prog
        return f"{rest}: " if rest else ""

    def option_strings(self) -> list[str]:
        return [o for a in self._actions for o in a.option_strings if a.help is not argparse.SUPPRESS]

    def _check_value(self, action, value):  # invalid choices: suggest the closest where argparse does not
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as e:
            msg = e.message
            if action.choices is not None and isinstance(value, str) and "meant" not in msg:
                close = difflib.get_close_matches(value, [str(c) for c in action.choices], n=1)
                if close:
                    raise argparse.ArgumentError(action, f"{msg} (did you mean {close[0]!r}?)") from None
            raise


class _Version(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def version_text() -> str:
    """'fastpipe 0.1.0 (torch 2.13.0+cpu)': the installed distribution's version, else the package's."""
    from importlib import metadata

    try:
        ours = metadata.version("fastpipe")
    except metadata.PackageNotFoundError:
        from fastpipe import __version__ as ours
    import torch

    return f"fastpipe {ours} (torch {torch.__version__})"


def short_usage(p: argparse.ArgumentParser) -> str:
    """One usage line: -h, what is required (positionals, required options and groups), and '[options]'
    where the parser has more; `fastpipe run -h` lists them all."""
    groups = [g for g in p._mutually_exclusive_groups if g.required]
    grouped = {id(a) for g in groups for a in g._group_actions}
    keep = [a for a in p._actions
            if a.help is not argparse.SUPPRESS and ("-h" in a.option_strings or not a.option_strings
                                                    or a.required or id(a) in grouped)]
    more = any(a not in keep and a.help is not argparse.SUPPRESS and a.option_strings for a in p._actions)
    try:
        formatter = argparse.HelpFormatter(p.prog, width=100_000)
        formatter.add_usage(None, keep, groups, prefix="")
        line = " ".join(formatter.format_help().split())
    except Exception:  # noqa: BLE001 - argparse's formatter internals differ across Pythons: the full usage then
        return p.format_usage().rstrip("\n")
    if more:
        line = line.replace("[-h]", "[-h] [options]", 1)
    return f"usage: {line}"


def _unrecognized(ap: argparse.ArgumentParser, args, extras: list[str]) -> UsageError:
    """argparse reports a subcommand's unknown arguments from the top-level parser: name the subcommand, and
    suggest the closest of its options (and the top-level ones) for each unknown option."""
    p = ap.subparsers.get(getattr(args, "command", None), ap)
    options = p.option_strings() + ([] if p is ap else ap.option_strings())
    names = {o.lstrip("-"): o for o in reversed(options)}       # a subcommand's own option first
    flags = [a.split("=", 1)[0] for a in extras
             if a.startswith("-") and len(a) > 1 and not a.lstrip("-").replace(".", "").isdigit()]
    hints = []
    for flag in flags:
        close = difflib.get_close_matches(flag.lstrip("-"), list(names), n=1)    # names alike, not dashes
        if close:
            hints.append(f"{flag}: did you mean {names[close[0]]}?" if len(flags) > 1
                         else f"did you mean {names[close[0]]}?")
    msg = f"{p.command_context()}unrecognized arguments: {' '.join(extras)}"
    return UsageError(msg + (f" ({'; '.join(hints)})" if hints else ""), short_usage(p))


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog=PROG, description="Validate, inspect and run split-model pipelines (pipeline.json).")
    ap.add_argument("--version", action=_Version, help="print fastpipe's and torch's versions and exit")
    ap.add_argument("--verbose", "-v", action="store_true", help="show tracebacks and debug logs")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    ap.subparsers = sub.choices            # command name -> its parser (see _unrecognized)

    def common(p, many: bool = False):
        if many:
            p.add_argument("pipeline", nargs="+", metavar="PIPELINE",
                           help="pipeline.json files, or serving-set folders (every */pipeline.json in them)")
        else:
            p.add_argument("pipeline", help="path to pipeline.json")
        p.add_argument("--allow-outside-paths", action="store_true",
                       help="allow param/payload files by absolute path or outside the pipeline's folder")
        p.add_argument("--trust-export-archives", action="store_true",
                       help="allow torch.export archives (their loader can unpickle, i.e. run code)")
        p.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    v = sub.add_parser("validate", help="check a pipeline (structure, payloads, param-file headers); exit 0 or one error")
    common(v)
    s = sub.add_parser("show", help="summary: slots, supertasks by kind, constant bytes per slot")
    common(s)
    s.add_argument("--dot", metavar="FILE", help="also write a Graphviz drawing (one cluster per slot)")
    s.add_argument("--plan", action="store_true",
                   help="also load the pipeline and print the Program its processor runs (processor auto, no compile): "
                        "a step x slot table, peak bytes per slot, fusion decisions, and the checker's verdict")
    s.add_argument("--device-map", metavar="MAP", help="with --plan: slot placement, e.g. 0=cpu,1=cuda:0")
    s.add_argument("--fuse", choices=("auto", "off", "always"), default="auto",
                   help="with --plan: the fusion policy whose decisions it prints (default auto)")
    r = sub.add_parser("run", help="run a pipeline and print a latency summary")
    common(r)
    r.add_argument("--inputs", metavar="FILE", help="safetensors file keyed by pipeline input names (default: seeded random)")
    r.add_argument("--outputs", metavar="FILE", help="write outputs (safetensors, keyed by pipeline output names)")
    r.add_argument("--check", metavar="FILE", help="compare outputs with this safetensors file; exit 1 on mismatch")
    r.add_argument("--state-in", metavar="FILE",
                   help="inputs the graphs write in place (KV caches), keyed by model or pipeline input names; over "
                        "--inputs (chain runs: a prefill's --state-out is the next step's --state-in)")
    r.add_argument("--state-out", metavar="FILE",
                   help="write the inputs the graphs wrote in place, as the first run left them (safetensors, keyed "
                        "by model input names where a slot holds all of one); timed runs use copies")
    r.add_argument("--rtol", type=float, help="relative tolerance for --check (default: per dtype)")
    r.add_argument("--atol", type=float, help="absolute tolerance for --check (default: per dtype)")
    r.add_argument("--device-map", metavar="MAP", help="slot placement, e.g. 0=cpu,1=cuda:0")
    r.add_argument("--seed", type=int, default=0, help="seed for random inputs (default 0)")
    r.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    r.add_argument("--repeat", type=int, default=5, help="timed runs (default 5)")
    r.add_argument("--processor", choices=(AUTO,) + processor_names(), default="auto",
                   help="auto (default): dist under torchrun or with --nproc, else region when every slot is on one "
                        "device (one compiled graph per device), else cuda when every slot is on a GPU, else cpu "
                        "(a thread per slot)")
    r.add_argument("--upload", choices=("pinned", "pageable"), default="pinned",
                   help="how weights reach a GPU: pinned (default: through pinned staging buffers, reading the file "
                        "while copying) or pageable (.to(device) per tensor)")
    r.add_argument("--compile", choices=("background", "wait", "off"), default="background",
                   help="background (default): run at once, eagerly, while each graph worth compiling compiles in a "
                        "background thread; the compiled graph is swapped in once ready and faster, and the timed runs "
                        "start once every compile settled. wait: compile before the first run (benchmarks). off: never")
    r.add_argument("--no-compile", action="store_true", help="the same as --compile off")
    r.add_argument("--compile-errors", choices=("warn", "raise"), default="warn",
                   help="a graph that cannot be compiled: warn and run it eagerly (default), or fail")
    r.add_argument("--no-cuda-graph", action="store_true", help="cuda and region processors: no CUDA-graph capture")
    r.add_argument("--fuse", choices=("auto", "off", "always"), default="auto",
                   help="matmul->reduce_scatter and all_gather->matmul as fused Triton kernels: auto (default: on one "
                        "GPU, where measured faster), off, or always (every match on one device; refused where the "
                        "kernels cannot run); each decision is printed with its reason")
    r.add_argument("--no-merge-shards", action="store_true",
                   help="region processor: keep tensor-parallel shards of a matmul as separate GEMMs")
    r.add_argument("--chunks", type=int, default=1, help="micro-batches along dim 0 (inputs carry chunks x the batch)")
    r.add_argument("--trace", metavar="FILE",
                   help="write a Chrome/Perfetto trace of the last timed run (a lane per slot; per region for the "
                        "region processor)")
    # -- multi-process runs (fastpipe.cli.dist, fastpipe.runtime.processors.dist_setup, docs/distributed.md)
    r.add_argument("--nproc", type=int, metavar="N",
                   help="run N processes on this machine through torch's elastic launcher (like torchrun)")
    r.add_argument("--slot-ranks", metavar="MAP", help="slot -> rank, e.g. 0=0,1=0,2=1,3=1 (default: contiguous blocks)")
    r.add_argument("--dist-timeout", type=float, default=120.0, metavar="S",
                   help="seconds any collective may wait before the run fails (default 120)")
    t = sub.add_parser("tune", help="measure the fused kernels' launch configs, and whether fusing pays, for this "
                                    "pipeline's shapes on this GPU",
                       description="Run the pipeline once with every fusable group fused (seeded random inputs), "
                                   "time each distinct fused-kernel call under the candidate launch configs and the "
                                   "heuristic's (replayed CUDA graphs), then the fused kernel against the runtime's "
                                   "unfused path, and write the configs that beat the heuristic and the fused-vs-"
                                   "unfused points to the table pick_config and fuse='auto' read "
                                   "(FASTPIPE_TUNED_CONFIGS), merged with what it held. Several pipelines (a "
                                   "serving set's buckets) are recorded in turn and tuned into one table.")
    common(t, many=True)
    t.add_argument("--out", metavar="FILE",
                   help="the tuned-config table to write, merged with its entries if it exists (default: "
                        "$FASTPIPE_TUNED_CONFIGS); point FASTPIPE_TUNED_CONFIGS at it for pick_config to read it")
    t.add_argument("--device-map", metavar="MAP", help="slot placement, e.g. 0=cuda:0,1=cuda:0")
    t.add_argument("--seed", type=int, default=0, help="seed for the random inputs of the recording run (default 0)")
    t.add_argument("--compile-workers", type=int, metavar="N",
                   help="compile the candidate kernels first in N processes (default: on a GPU, the cores less two, "
                        "at most 14; 0: each compiles at its first call)")
    t.add_argument("--budget-s", type=float, metavar="S",
                   help="start no call's tuning past S seconds (the compile pool stops by S/2); the calls not "
                        "reached are named and the exit status is 1. The table is written after every call, so an "
                        "interrupted run keeps the calls it finished")
    t.add_argument("--min-gain", type=float, default=0.03,
                   help="keep a config only where it beat the heuristic's by more than this (default 0.03: 3%%)")
    b = sub.add_parser("build", help="split a local Hugging Face checkpoint folder into a tp x pp pipeline, or "
                                     "(--serve) into the serving set that `fastpipe generate` runs",
                       description="Without --serve: one pipeline (OUT/pipeline.json) of the given shapes. With --max-len "
                                   "and no --serve: one decode step on a static KV cache of M positions (input_ids, "
                                   "cache_position and the caches in, logits and the updated caches out; --seq-len "
                                   "defaults to 1). With --serve --max-len M: a serving set, a prefill pipeline per "
                                   "batch x prompt length and one static-cache decode step per batch "
                                   "(OUT/prefill_b{B}_s{S}/, OUT/decode_b{B}/), with the model's tokenizer and config "
                                   "files linked into OUT, for `fastpipe generate OUT`.")
    b.add_argument("model", help="folder with config.json and *.safetensors (no network is used)")
    b.add_argument("-o", "--output", required=True,
                   help="output folder: pipeline.json (or with --serve a subfolder per pipeline), with the checkpoint "
                        "files hard-linked in place")
    b.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    b.add_argument("--pp", type=int, default=1, help="pipeline stages, layers split evenly (default 1)")
    b.add_argument("--split-points", metavar="MODULES", help="comma-separated module names each stage after the first starts at")
    b.add_argument("--batch", type=int, default=None, help="batch size (default 1; not with --serve: see --batches)")
    b.add_argument("--seq-len", type=int, default=None,
                   help="tokens per row (default 128, or 1 with --max-len; not with --serve: see --prompt-lens)")
    b.add_argument("--past-len", type=int, default=None,
                   help="decoders: omit for no KV cache; 0 for a prefill that outputs the cache; P for a decode step over P cached tokens")
    b.add_argument("--sequence-parallel", action="store_true", help="reduce_scatter/all_gather on the sequence dim instead of all_reduce")
    b.add_argument("--last-logits", action="store_true",
                   help="decoders without --max-len, or with --cache-rows: take logits_index [B] (a position per "
                        "row) and return the logits there only, [B, 1, V] instead of [B, S, V] (what a serving "
                        "prefill needs; --serve builds its prefills so)")
    b.add_argument("--max-len", type=int, metavar="M",
                   help="decoders: a static KV cache of M positions (prompt + generated tokens). Alone: one "
                        "static-cache step (not with --past-len); with --serve: the serving set's max_len (required)")
    b.add_argument("--cache-rows", type=int, metavar="R",
                   help="with --max-len: a prefill written straight into rows of a static cache [R, Hkv, M, D]: "
                        "takes cache_row [B] (each prompt's row) and the caches, returns them updated (R >= "
                        "--batch; --serve builds its prefills so, R = the largest batch)")
    b.add_argument("--serve", action="store_true",
                   help="write a serving set for `fastpipe generate` (needs --max-len; takes --batches and "
                        "--prompt-lens instead of --batch, --seq-len and --past-len)")
    b.add_argument("--batches", metavar="LIST",
                   help="with --serve: batch buckets, e.g. 1,8 (default 1); each gets its prefills and a decode step")
    b.add_argument("--prompt-lens", metavar="LIST",
                   help="with --serve: prompt-length buckets <= max-len, e.g. 16,64 (default: 16, 32, 64, ... below "
                        "max-len, and max-len); a prompt is right-padded to the shortest that fits")
    b.add_argument("--style", choices=("fastpipe", "producer", "producer-2024.1"), default="fastpipe",
                   help="fastpipe: its own compact spelling (default); producer: what furiosa-llm (2024.2.0 and later) "
                        "writes and its Pipeline.load reads (every field, null where absent, payloads in <blob-id>.fx "
                        "files); producer-2024.1: the same with torch 2.1 payloads, for furiosa-llm 2024.1.x")
    b.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    g = sub.add_parser("generate", help="stream tokens for one prompt from a serving set (fastpipe build --serve)",
                       description="Load a serving set (eager at once; each bucket compiled in the background as it is "
                                   "used, unless --compile wait or off), generate "
                                   "for one prompt and stream the tokens to stdout: text when the folder has a "
                                   "tokenizer, else token ids separated by spaces. stderr gets the load time, a "
                                   "progress bar (when stderr is a terminal and stdout is not) and a closing line "
                                   "'N tokens in X s (Y tokens/s, first token after Z ms)'.")
    g.add_argument("serving_set", metavar="FOLDER", help="a folder written by `fastpipe build MODEL -o FOLDER --serve`")
    what = g.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", metavar="TEXT", help="prompt text (needs a tokenizer in the folder)")
    what.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, e.g. 5,7,9 (works without a tokenizer)")
    g.add_argument("--max-new-tokens", type=int, metavar="N",
                   help="tokens to generate at most (default 32, or fewer when the prompt leaves less room in "
                        "max_len); generation also stops at the model's EOS token unless --ignore-eos")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 (default): greedy; > 0: sample")
    g.add_argument("--top-k", type=int, metavar="K", help="with --temperature > 0: keep the K most likely tokens (0: off)")
    g.add_argument("--top-p", type=float, metavar="P", help="with --temperature > 0: nucleus sampling, 0 < P <= 1 (1: off)")
    g.add_argument("--seed", type=int, metavar="S", help="with --temperature > 0: seed of the sampler (same seed, same tokens)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS, up to --max-new-tokens")
    g.add_argument("--batch", type=int, metavar="B",
                   help="decode bucket to run on (default: the smallest built; the prompt takes one of its rows)")
    g.add_argument("--ids", action="store_true", help="print token ids even when the folder has a tokenizer")
    engine_flags(g)
    g.add_argument("--quiet", "-q", action="store_true", help="nothing on stderr but errors")
    serve.add_parser(sub, engine_flags)
    return ap


def engine_flags(p) -> None:
    """The flags that load a serving set's engine (generate, serve)."""
    p.add_argument("--processor", choices=(AUTO,) + processor_names(one_process=True), default="auto",
                   help="as for `fastpipe run` (default auto)")
    p.add_argument("--device-map", metavar="MAP", help="slot placement, e.g. 0=cpu,1=cuda:0")
    p.add_argument("--compile", choices=("background", "wait", "off"), default="background",
                   help="background (default): the first token comes at once, eagerly, while each bucket compiles in "
                        "the background as it is used, busiest first, and is swapped in once ready; wait: compile every "
                        "bucket before the first token; off: never compile")
    p.add_argument("--no-compile", action="store_true", help="the same as --compile off")
    p.add_argument("--verbose", "-v", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


COMMANDS = {"validate": show.cmd_validate, "show": show.cmd_show, "run": run.cmd_run, "build": build.cmd_build,
            "generate": generate.cmd_generate, "serve": serve.cmd_serve, "tune": tune.cmd_tune}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verbose = "--verbose" in argv or "-v" in argv
    try:
        ap = parser()
        args, extras = ap.parse_known_args(argv)
        if extras:
            raise _unrecognized(ap, args, extras)
        args.argv = list(argv)       # --nproc relaunches the same command line
        if getattr(args, "verbose", False):
            import logging

            logging.basicConfig(level=logging.DEBUG)
        return COMMANDS[args.command](args)
    except UsageError as e:    # the command line itself: the error, then the usage line (no traceback)
        print(f"fastpipe: error: {e}", file=sys.stderr)
        print(e.usage, file=sys.stderr)
        return e.exit_code
    except FastpipeError as e:
        if verbose:
            traceback.print_exc()
        print(f"fastpipe: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("fastpipe: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a bug of ours: still one line unless --verbose
        if verbose:
            traceback.print_exc()
        msg = " ".join(str(e).split())
        print(f"fastpipe: internal error: {type(e).__name__}: {msg} (rerun with --verbose for the traceback)", file=sys.stderr)
        return EXIT_FAILED


def entry() -> None:
    """The console script (`fastpipe`) and `python -m fastpipe`: main(), then exit with its status. A compile
    still running in the background (tiered compiles: its result was only ever an optimisation) is not
    waited for: inductor's worker pools would hold the exit until it ends. Outputs are written (atomically)
    by then; the compile cache writes its entries atomically too, so an abandoned one leaves nothing half-done."""
    import os

    code = main()
    compiler = sys.modules.get("fastpipe.runtime.compiling.background_compile")
    if compiler is not None and compiler.background().busy():
        compiler.background().shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    entry()
