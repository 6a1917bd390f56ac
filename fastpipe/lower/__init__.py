"""Layer 4 (docs/architecture.md): lowering a validated pipeline to a Program, and checking and printing Programs.

    program = lower(checked)                  # per-slot ordered steps + cross-slot waits + frees
    check_program(program, checked)           # raises ProgramError (with .marks) if it could hang
    simulate(program) -> [(slot, index)]      # the order steps complete in a simulated run
    print(format_table(program, pipeline=p))  # the step x slot table (action language: table.py)
    program = with_regions(program, device_of)  # the region pass: runs of steps one device runs as one graph
"""
from fastpipe.lower.check import ProgramError, check_program, simulate
from fastpipe.lower.lower import lower, tensor_bytes
from fastpipe.lower.program import Program, Step
from fastpipe.lower.regions import Region, check_regions, with_regions
from fastpipe.lower.table import Action, format_table, parse_action, parse_table

__all__ = ["Program", "Step", "lower", "check_program", "simulate", "format_table", "ProgramError",
           "Action", "parse_action", "parse_table", "tensor_bytes", "Region", "with_regions", "check_regions"]
