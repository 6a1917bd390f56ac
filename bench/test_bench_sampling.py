"""Sampling one decode step's tokens at a real vocabulary (Llama 3's 128256), per batch and mix of rows:
fastpipe.serving.sampling.sample_rows (each row fails alone: a finite check on every row, one transfer
to the host, draws without torch.multinomial's host synchronisations) against the plain way (argmax for
greedy rows, warp + torch.multinomial per sampled row, then the ids to the host). The same tokens in both.

    python -m pytest bench/test_bench_sampling.py --benchmark-only [--benchmark-json out.json]

On a GPU the logits are made there (the engine samples where the decode step's logits are)."""
import pytest
import torch

from fastpipe.serving.sampling import SamplingParams, sample_rows, warp

VOCAB = 128256
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MIXES = {
    "greedy": lambda r: SamplingParams(),
    "half sampled": lambda r: (SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=r) if r % 2
                               else SamplingParams()),
}


def plain(logits, params, gens) -> list[int]:
    """The plain way: argmax for every row, then warp + multinomial for each sampled one."""
    out = logits.argmax(-1)                                                 # [R]
    for r, p in enumerate(params):
        if not p.greedy:
            out[r] = torch.multinomial(warp(logits[r], p).softmax(-1), 1, generator=gens[r])[0]
    return out.tolist()


@pytest.mark.parametrize("batch", [8, 32])
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("how", ["sample_rows", "plain"])
def test_sample_a_step(benchmark, record, how, mix, batch):
    benchmark.group = f"sample one step, batch {batch}, {mix}, vocab {VOCAB}"
    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)).to(DEVICE, torch.bfloat16)
    params = [MIXES[mix](r) for r in range(batch)]

    def step():
        gens = [p.generator(DEVICE) for p in params]         # fresh seeded generators: the same draws each round
        if how == "plain":
            return plain(logits, params, gens)
        tokens, errors = sample_rows(logits, params, gens)
        assert not errors
        return tokens
    got = benchmark(step)
    record(batch=batch, vocab=VOCAB, mix=mix, device=DEVICE)
    assert got == plain(logits, params, [p.generator(DEVICE) for p in params])
