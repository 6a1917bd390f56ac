"""Layer 5: running a Program (docs/architecture.md). The folders follow the flow:

    binding/      program = bind(lower(checked), checked, Binder(...))   # devices, constants, callables;
                  inputs checked, state pairs, micro-batches, index bounds, release of weights
    passes/       fuse.apply(...) and the region graph passes: rewrite the bound Program before the checker
    compiling/    torch.compile once per graph (tiered: background thread, estimate, persistent cache)
    processors/   the registry (name -> Processor) and the processors that run the bound Program
    cuda/         CUDA machinery: stream issue, graph capture, whole-run replay
    tuning/       instruments of `fastpipe tune` (the unfused baseline, replayed kernel timing)

execute.py runs one step or one comm group for every processor; trace.py writes Chrome traces.
"""
