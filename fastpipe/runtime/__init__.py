"""Layer 5: running a Program (docs/architecture.md).

    program = bind(lower(checked), checked, Binder(...))     # bind.py: devices, constants, callables
    program = fuse.apply(program, fuse.analyze(...), ...)    # fuse.py: a pass, before the checker
    ReferenceProcessor(program) | ThreadedProcessor(program) | CudaProcessor(program, ...)
    | DistProcessor(program, checked, plan, ...)             # each runs the bound Program, nothing else

execute.py runs one step or one comm group for all of them; compile.py compiles graphs once per
process; dist_setup.py places slots on ranks and makes process groups.
"""
