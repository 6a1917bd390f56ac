"""Instruments of `fastpipe tune`: the unfused baseline a fused kernel must beat (unfused_path.py) and a
kernel call timed as the runtime replays it (kernel_timing.py)."""
