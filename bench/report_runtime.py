"""Runtime benchmark: a decode-step-sized pipeline (a Llama-family model, tp=2, a few blocks, one new
token over a KV cache), side by side with its baselines, in one run.

    python bench/report_runtime.py                 # CPU: compiled vs eager (cpu processor)
    python bench/report_runtime.py --batches 1,4,8 # on a GPU also: CUDA-graph replay vs eager streams
                                                   #   vs the unsplit HF model under torch.compile

Targets (issue 4, GPU): replay >= 3x faster than eager streams, and within 1.2x of the unsplit
compiled model. Each number is a median over --repeat runs after warm-up; ratios are to a
baseline measured in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def median_ms(fn, repeat: int, sync) -> float:
    for _ in range(3):
        fn()
    sync()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    import transformers

    import fastpipe
    from bench.machine import machine_info
    from fastpipe.builder.hf.build import build_hf
    from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                                   num_key_value_heads=4, intermediate_size=4 * args.hidden, vocab_size=32000)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_checkpoint(cfg, Path(tmp) / "m", seed=0).eval()
        for b in (int(x) for x in args.batches.split(",")):
            built = build_hf(Path(tmp) / "m", tp=2, batch=b, seq_len=1, past_len=args.past)
            path = built.save(Path(tmp) / f"b{b}")
            g = torch.Generator().manual_seed(b)
            dev = "cuda" if cuda else "cpu"
            eager = fastpipe.load(path, processor="cpu", compile=False)
            ins = {n: (torch.randint(0, 32000, eager.pipeline.tensors[n].shape, generator=g) if n == "input_ids"
                       else torch.randn(eager.pipeline.tensors[n].shape, generator=g)) for n in eager.input_names}
            base = median_ms(lambda: eager.run(ins), args.repeat, sync)
            comp = fastpipe.load(path, processor="cpu", compile=True)
            comp.compile()
            t = median_ms(lambda: comp.run(ins), args.repeat, sync)
            rows.append((f"batch {b}", "cpu processor, eager", f"{base:.3f}", "1.00x"))
            rows.append((f"batch {b}", "cpu processor, compiled", f"{t:.3f}", f"{base / t:.2f}x"))
            if cuda:
                dm = {s: "cuda:0" for s in eager.pipeline.devices}
                gins = {k: v.to(dev) for k, v in ins.items()}
                streams = fastpipe.load(path, device_map=dm, processor="cuda", compile=True, cuda_graph=False)
                streams.compile()
                t_streams = median_ms(lambda: streams.run(gins), args.repeat, sync)
                replay = fastpipe.load(path, device_map=dm, processor="cuda", compile=True, cuda_graph=True)
                replay.compile()
                t_replay = median_ms(lambda: replay.run(gins), args.repeat, sync)
                m = model.to(dev)
                cm = torch.compile(m, fullgraph=False)
                ids = gins["input_ids"]
                cache = transformers.DynamicCache()
                for l in range(args.layers):
                    cache.update(gins[f"past_key_values_{l}_0_rank0"].repeat(1, 2, 1, 1)[:, :4],
                                 gins[f"past_key_values_{l}_1_rank0"].repeat(1, 2, 1, 1)[:, :4], l)

                def unsplit():
                    c = transformers.DynamicCache()
                    for l in range(args.layers):
                        c.update(cache.layers[l].keys, cache.layers[l].values, l)
                    with torch.no_grad():
                        cm(input_ids=ids, past_key_values=c, use_cache=True)

                t_unsplit = median_ms(unsplit, args.repeat, sync)
                rows.append((f"batch {b}", "cuda, eager streams", f"{t_streams:.3f}", "1.00x"))
                rows.append((f"batch {b}", "cuda, graph replay", f"{t_replay:.3f}", f"{t_streams / t_replay:.2f}x vs streams"))
                rows.append((f"batch {b}", "unsplit HF model, torch.compile", f"{t_unsplit:.3f}",
                             f"replay/unsplit {t_replay / t_unsplit:.2f}x"))
    info = machine_info()
    print("machine: " + ", ".join(f"{k} {v}" for k, v in info.items()))
    print(f"model: Llama-family, {args.layers} layers, hidden {args.hidden}, 8 q / 4 kv heads, tp=2, "
          f"decode step (1 token over {args.past} cached)")
    header = ("shape", "variant", "median ms", "ratio")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
    for r in [header, tuple("-" * w for w in widths)] + rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
