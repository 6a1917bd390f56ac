"""Binding a lowered Program to this process: devices, constants, callables (bind.py), and what a run
checks and prepares around it: inputs (inputs.py), state pairs (state.py), micro-batches, index bounds,
the layout GEMMs take (gemm_layout.py), graphs placed on their device, weights released with the session."""
