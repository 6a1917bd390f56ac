"""A longer fuzzing campaign over the example pipelines (the engine of tests/test_fuzz.py).

    python scripts/fuzz_campaign.py --cases 2000 --seed 1            # in-process load + run
    python scripts/fuzz_campaign.py --cases 300 --cli-every 3        # every 3rd case through the CLI
    python scripts/fuzz_campaign.py --minutes 5 --failures-dir fails/

Each case picks an example from graphs/, 1 to --max-mutations mutations (a neutral-only case
every --neutral-every cases) and runs it in a fresh temporary folder. It prints the figures:
cases run, outcomes by error class, mutation kinds, and every failure (a non-FastpipeError, a
hang, wrong outputs for a neutral mutation, a stray write, a message that is not one line),
each with the seed that reproduces it:

    python scripts/fuzz_campaign.py --replay SEED [--cli]

Exit status 1 if any failure was found.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))



def case_for(seed: int, args) -> tuple:
    from tests import test_fuzz as fz

    rng = random.Random(seed)
    example = rng.choice(fz.EXAMPLES)
    pool = fz.NEUTRAL if args.neutral_every and seed % args.neutral_every == 0 else sorted(fz.MUTATIONS)
    kinds = [rng.choice(pool) for _ in range(rng.randint(1, args.max_mutations))]
    cli = bool(args.cli_every) and seed % args.cli_every == args.cli_every - 1
    return fz.make_case(example, kinds, rng), kinds, cli


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--minutes", type=float, default=None, help="stop after this long (whichever comes first)")
    ap.add_argument("--seed", type=int, default=0, help="first seed; case i uses seed + i")
    ap.add_argument("--max-mutations", type=int, default=3)
    ap.add_argument("--neutral-every", type=int, default=5, help="every Nth case uses neutral mutations only (0: never)")
    ap.add_argument("--cli-every", type=int, default=10, help="every Nth case runs through the CLI (0: never)")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds before a case counts as a hang")
    ap.add_argument("--processor", default="reference", choices=("reference", "cpu"),
                    help="processor the cases run on (default reference, as in CI; cpu: a thread per slot)")
    ap.add_argument("--replay", type=int, default=None, help="run this one seed, verbosely")
    ap.add_argument("--cli", action="store_true", help="with --replay: through the CLI")
    ap.add_argument("--failures-dir", type=Path, default=None, help="keep each failing case's folder here")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    args = ap.parse_args(argv)

    from tests import test_fuzz as fz

    fz.TIMEOUT_S = args.timeout
    fz.PROCESSOR = args.processor
    import logging

    logging.disable(logging.WARNING)

    if args.replay is not None:
        c, kinds, cli = case_for(args.replay, args)
        with tempfile.TemporaryDirectory(prefix="fastpipe_fuzz_") as d:
            o = fz.run_case(c, Path(d), cli=args.cli or cli)
        print(fz.describe(c))
        print(f"{o.status}: {o.detail}\n{o.message}")
        return 1 if o.status == "FAIL" else 0

    outcomes: collections.Counter = collections.Counter()
    by_class: collections.Counter = collections.Counter()
    kinds_seen: collections.Counter = collections.Counter()
    neutral_ran = neutral_total = cli_cases = 0
    known: collections.Counter = collections.Counter()
    known_seeds: dict[str, int] = {}
    failures = []
    t0 = time.time()
    n = 0
    with tempfile.TemporaryDirectory(prefix="fastpipe_fuzz_") as d:
        base = Path(d)
        for i in range(args.cases):
            if args.minutes is not None and time.time() - t0 > args.minutes * 60:
                break
            seed = args.seed + i
            c, kinds, cli = case_for(seed, args)
            kinds_seen.update(kinds)
            o = fz.run_case(c, base, cli=cli)
            n += 1
            cli_cases += cli
            outcomes[o.status] += 1
            if o.status == "refused":
                by_class[o.detail] += 1
            if c.neutral:
                neutral_total += 1
                neutral_ran += o.status == "ran"
            if o.status == "KNOWN":
                known[o.message] += 1
                known_seeds.setdefault(o.message, seed)
            if o.status == "FAIL":
                failures.append({"seed": seed, "cli": cli, "case": fz.describe(c), "detail": o.detail,
                                 "message": o.message.strip().splitlines()[-1][:300] if o.message.strip() else ""})
                print(f"FAIL seed={seed}{' (cli)' if cli else ''}: {fz.describe(c)}\n  {o.detail}: {failures[-1]['message']}",
                      flush=True)
                if args.failures_dir is not None:
                    import shutil

                    shutil.copytree(base / "case", args.failures_dir / f"seed{seed}", symlinks=True, dirs_exist_ok=True)
            if (i + 1) % 250 == 0:
                print(f"... {i + 1} cases, {time.time() - t0:.0f} s, {len(failures)} failures", flush=True)
    dt = time.time() - t0
    figures = {
        "processor": args.processor, "cases": n, "seconds": round(dt, 1), "seed": args.seed, "cli_cases": cli_cases,
        "outcomes": dict(outcomes), "refused_by_class": dict(by_class.most_common()),
        "neutral_cases": neutral_total, "neutral_ran_and_matched": neutral_ran,
        "mutation_kinds": dict(sorted(kinds_seen.items())), "failures": failures,
        "known_bugs_hit": {why: {"cases": k, "first_seed": known_seeds[why]} for why, k in known.items()},
    }
    print(f"\nprocessor: {args.processor}; cases run: {n} in {dt:.0f} s ({n / max(dt, 1e-9):.1f}/s), seeds {args.seed}..{args.seed + n - 1}, "
          f"{cli_cases} through the CLI")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in outcomes.most_common()))
    print("refused, by error class / exit status: " + ", ".join(f"{k} {v}" for k, v in by_class.most_common()))
    print(f"neutral-only cases: {neutral_total}, ran and matched the reference: {neutral_ran}")
    print("mutation kinds: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds_seen.items())))
    for why, k in known.items():
        print(f"known bug hit by {k} cases (first seed {known_seeds[why]}): {why}")
    print(f"failures found: {len(failures)} (besides {sum(known.values())} cases hitting known bugs)")
    for f in failures:
        print(f"  seed {f['seed']}{' (cli)' if f['cli'] else ''}: {f['detail']}: {f['case']}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
