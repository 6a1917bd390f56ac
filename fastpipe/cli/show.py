"""`fastpipe validate` and `fastpipe show` (summary, Graphviz drawing, and --plan: the Program that runs)."""
from __future__ import annotations

import sys

from fastpipe.cli.common import check_writable, device_map_of, load_options


def cmd_validate(args) -> int:
    from fastpipe.format import read_pipeline
    from fastpipe.validate import validate

    p = read_pipeline(args.pipeline)
    validate(p, load_options(args))
    print(f"{args.pipeline}: valid ({len(p.devices)} slots, {len(p.supertasks)} supertasks, {len(p.tensors)} tensors)")
    return 0


def cmd_show(args) -> int:
    from fastpipe.atomic import write_text
    from fastpipe.format import read_pipeline
    from fastpipe.summary import dot_text, summary_text
    from fastpipe.validate import validate_structure

    p = read_pipeline(args.pipeline)
    validate_structure(p)
    sys.stdout.write(summary_text(p))
    if args.plan:
        print_plan(p, args)
    if args.dot:
        check_writable(args.dot, "--dot")
        write_text(args.dot, dot_text(p))
        print(f"wrote {args.dot}")
    return 0


def print_plan(p, args) -> None:
    """Load the pipeline as `fastpipe run` would (processor auto, eager) and print the bound, checked
    Program its processor runs, with the fusion pass's decisions."""
    from fastpipe.lower import format_table
    from fastpipe.lower.regions import region_lines
    from fastpipe.options import RunOptions
    from fastpipe.session import Session

    sess = Session(p, device_map=device_map_of(args), load_options=load_options(args),
                   run_options=RunOptions(processor="auto", compile="off", fuse=args.fuse))   # the plan: nothing compiles
    try:
        table = format_table(sess.program, pipeline=p)
        sys.stdout.write(table if table.endswith("\n") else table + "\n")
        for d in sess.fusion:
            print("fusion: " + d.line())
        for line in region_lines(sess.program):
            print(line)
        print("plan: checked: every wait is satisfied and every comm group is issued in one order by all its members "
              f"(run by the {sess.describe()})")
    finally:
        sess.close()
