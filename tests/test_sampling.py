"""fastpipe.serving.sampling against transformers' warpers, argmax and the softmax it should draw from."""
import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from fastpipe.errors import InputError, RunError
from fastpipe.serving.sampling import MIN_TEMPERATURE, SamplingParams, draw, sample, sample_rows, warp


def hf_warp(logits, temperature, top_k, top_p):
    """transformers' warpers in generate's order, added only where generate adds them."""
    scores = logits.float().reshape(-1, logits.size(-1))
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k != 0:
        scores = TopKLogitsWarper(top_k, min_tokens_to_keep=1)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p, min_tokens_to_keep=1)(None, scores)
    return scores.reshape(logits.shape)


COMBOS = [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 5, 1.0), (1.0, 100, 1.0), (0.5, 0, 0.9), (1.0, 0, 0.3),
    (0.8, 10, 0.8), (1.2, 100, 0.95), (2.0, 1, 0.5), (1.0, 3, 0.01), (0.3, 0, 0.999), (1.0, 0, 1e-9),
]


def assert_same_warp(ours, ref, ties_in=None):
    """The same tokens kept (exactly) and the same kept scores (closely). With ties, transformers' unstable sort
    picks which of the tokens tied across the top-p cut stay: there the same number of each value stays, and
    the lowest indices among equal logits ``ties_in`` (sampling's rule)."""
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert (ours.amax(-1) == 0).all()  # shifted: each row's largest score is 0
    ref = ref - ref.amax(-1, keepdim=True)  # transformers' scores, shifted the same way
    kept, ref_kept = ~torch.isinf(ours), ~torch.isinf(ref)
    assert ref_kept.any(-1).all()  # min_tokens_to_keep=1
    if ties_in is None:
        assert torch.equal(kept, ref_kept)
        torch.testing.assert_close(ours[kept], ref[ref_kept], rtol=1e-6, atol=1e-6)
        return
    rows = (t.reshape(-1, t.size(-1)) for t in (ours, ref, kept, ref_kept, ties_in))
    for row, ref_row, k, rk, logit in zip(*rows):
        torch.testing.assert_close(row[k].sort().values, ref_row[rk].sort().values, rtol=1e-6, atol=1e-6)
        for value in logit.unique():
            same = (logit == value).nonzero().flatten()  # tied tokens, ascending index
            n = int(rk[same].sum())
            assert k[same].tolist() == [True] * n + [False] * (len(same) - n)


@pytest.mark.parametrize("temperature,top_k,top_p", COMBOS)
@pytest.mark.parametrize("ties", [False, True])
def test_warp_matches_transformers(temperature, top_k, top_p, ties):
    g = torch.Generator().manual_seed(hash((temperature, top_k, top_p, ties)) % 2**31)
    if ties:  # few distinct values: ties straddle the top-k and top-p boundaries
        logits = torch.randint(0, 4, (6, 40), generator=g).float() * 0.5
    else:
        logits = torch.randn(6, 40, generator=g) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    ref = hf_warp(logits, temperature, top_k, top_p)  # [6, 40]
    assert_same_warp(warp(logits, params), ref, logits if ties else None)
    for r in range(logits.size(0)):  # one row [V] is warped as in the batch
        assert torch.equal(warp(logits[r], params), warp(logits, params)[r])
    if top_k >= logits.size(-1) and top_p == 1.0:
        assert not torch.isinf(ref).any()


def test_warp_filters_and_keeps_ties():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    kept = ~torch.isinf(warp(logits, SamplingParams(temperature=1.0, top_k=2)))
    assert kept.tolist() == [[True, False, True, True, False]]  # ties with the k-th stay, as in transformers
    # probabilities ~[.52, .07, .19, .19, .03]: 0.5 keeps the top one; 0.6 needs a 2.0 too (the lower index);
    # 0.8 keeps both 2.0s; 0.95 needs the 1.0 too
    for top_p, want in [(0.5, [1, 0, 0, 0, 0]), (0.6, [1, 0, 1, 0, 0]), (0.8, [1, 0, 1, 1, 0]), (0.95, [1, 1, 1, 1, 0])]:
        kept = ~torch.isinf(warp(logits, SamplingParams(temperature=1.0, top_p=top_p)))
        assert kept.int().tolist() == [want], top_p
        assert kept.sum() == (~torch.isinf(hf_warp(logits, 1.0, 0, top_p))).sum()
    tiny = warp(torch.randn(8, 1000), SamplingParams(temperature=1.0, top_p=1e-9))  # 1 - top_p rounds to 1
    assert (~torch.isinf(tiny)).sum(-1).tolist() == [1] * 8  # min_tokens_to_keep=1
    logits16 = torch.randn(3, 30).half()
    assert_same_warp(warp(logits16, SamplingParams(temperature=0.9, top_k=7, top_p=0.8)), hf_warp(logits16.float(), 0.9, 7, 0.8))
    assert not torch.equal(warp(logits, SamplingParams(temperature=1.0)), warp(logits, SamplingParams(temperature=0.5)))


def test_greedy_is_argmax_with_ties_to_the_lowest_index():
    logits = torch.randn(5, 50)
    logits[2, [7, 30]] = 100.0  # a tie: index 7 wins, as torch.argmax
    params = [SamplingParams()] * 5
    tokens = sample(logits, params, [p.generator() for p in params])
    assert tokens.dtype == torch.long and tokens.tolist() == logits.argmax(-1).tolist()
    assert tokens[2] == 7
    assert SamplingParams().greedy and SamplingParams().generator() is None
    g = warp(logits, SamplingParams())  # greedy: only the argmax survives
    assert (~torch.isinf(g)).sum(-1).tolist() == [1] * 5 and g.argmax(-1).tolist() == tokens.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_batch_in_any_float_dtype(dtype):
    logits = (torch.randn(6, 64, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)  # [6, 64]
    logits[2, [5, 40]] = 20.0  # a tie in a greedy row: index 5
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(),
              SamplingParams(temperature=0.7, top_k=8, seed=2), SamplingParams(temperature=1.3, top_p=0.9, seed=3),
              SamplingParams()]
    tokens = sample(logits, params, [p.generator() for p in params])
    assert tokens.dtype == torch.long and tokens.shape == (6,)
    want = logits.float().argmax(-1)
    assert want[2] == 5
    for r, p in enumerate(params):
        if p.greedy:
            assert tokens[r] == want[r]
        else:  # the float32 path, drawn alone: the same token
            probs = hf_warp(logits[r].float(), p.temperature, p.top_k, p.top_p).softmax(-1)
            assert tokens[r] == torch.multinomial(probs, 1, generator=p.generator())[0]
            assert not torch.isinf(hf_warp(logits[r].float(), p.temperature, p.top_k, p.top_p)[tokens[r]])


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    steps, vocab = 40, 100
    params = [SamplingParams(temperature=1.0, seed=11), SamplingParams(),
              SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=12), SamplingParams(temperature=1.5, seed=13)]
    logits = torch.randn(steps, len(params), vocab, generator=torch.Generator().manual_seed(0))  # [S, R, V]
    gens = [p.generator() for p in params]
    batched = torch.stack([sample(logits[s], params, gens) for s in range(steps)])  # [S, R]
    for r, p in enumerate(params):
        alone = [p.generator()]
        seq = torch.stack([sample(logits[s, r:r + 1], [p], alone)[0] for s in range(steps)])  # [S]
        assert torch.equal(seq, batched[:, r]), r
    # other rows and other orders change nothing for row 0
    others = [SamplingParams(temperature=1.0, seed=99), params[0], SamplingParams(temperature=2.0, top_k=3, seed=5)]
    gens = [p.generator() for p in others]
    shuffled = torch.stack([sample(torch.stack([logits[s, 3], logits[s, 0], logits[s, 2]]), others, gens)[1]
                            for s in range(steps)])
    assert torch.equal(shuffled, batched[:, 0])
    # a different seed gives a different sequence, and so do two unseeded generators
    other = SamplingParams(temperature=1.0, seed=12)
    gen = other.generator()
    assert not torch.equal(torch.stack([sample(logits[s, :1], [other], [gen])[0] for s in range(steps)]), batched[:, 0])
    free = SamplingParams(temperature=1.0)
    g1, g2 = free.generator(), free.generator()
    draw = lambda g: [sample(logits[s, :1], [free], [g])[0].item() for s in range(steps)]  # noqa: E731
    assert draw(g1) != draw(g2)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 6, 1.0), (1.4, 0, 0.85), (0.8, 7, 0.9)])
def test_empirical_distribution_matches_the_warped_softmax(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.4, 0.3, 0.0, -0.5, -1.0, -2.0])  # [10]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=1234)
    want = hf_warp(logits, temperature, top_k, top_p).softmax(-1)  # [10], the reference distribution
    n, gen = 20000, params.generator()
    tokens = torch.cat([sample(logits.expand(500, -1), [params] * 500, [gen] * 500) for _ in range(n // 500)])
    freq = torch.bincount(tokens, minlength=logits.numel()).double() / n
    assert freq[want == 0].sum() == 0  # never a filtered token
    sigma = (want.double() * (1 - want.double()) / n).sqrt()
    assert ((freq - want.double()).abs() <= 5 * sigma + 1e-9).all(), (freq, want)
    kept = want > 0
    chi2 = (n * (freq[kept] - want[kept]) ** 2 / want[kept]).sum().item()
    dof = int(kept.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * max(dof, 1)), chi2


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("temperature", True), ("top_k", -1), ("top_k", 2.0), ("top_k", True), ("top_p", 0.0), ("top_p", 1.5),
    ("top_p", -0.1), ("top_p", float("nan")), ("top_p", False), ("seed", -1), ("seed", 2**64), ("seed", 1.5),
    ("seed", True),
])
def test_check_rejects_each_bad_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(InputError, match=rf"^requests\[2\]\.sampling\.{field}: expected .*, found ") as err:
        params.check("requests[2].sampling")
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match=rf"params\[1\]\.{field}"):
        sample(torch.zeros(2, 4), [SamplingParams(), params], [None, torch.Generator()])


def test_check_accepts_valid_and_sample_refuses_bad_calls():
    for p in [SamplingParams(), SamplingParams(temperature=1, top_k=3, top_p=0.5, seed=0),
              SamplingParams(temperature=0.01, top_p=1, seed=2**64 - 1)]:
        p.check()
    with pytest.raises(InputError, match=r"sampling\.top_p: expected 0 < top_p <= 1, found 1\.5"):
        SamplingParams(top_p=1.5).check()
    sampled = SamplingParams(temperature=1.0, seed=0)
    with pytest.raises(InputError, match=r"generators\[0\]"):
        sample(torch.zeros(1, 4), [sampled], [None])
    with pytest.raises(InputError, match=r"one per row"):
        sample(torch.zeros(2, 4), [sampled], [sampled.generator()])
    with pytest.raises(InputError, match=r"generators\[0\]: expected a generator on the logits' device \(meta\)"):
        sample(torch.zeros(1, 4, device="meta"), [sampled], [sampled.generator("cpu")])
    with pytest.raises(InputError, match=r"logits"):
        sample(torch.zeros(4), [sampled], [sampled.generator()])


@pytest.mark.parametrize("temperature", [1e-40, 1e-6, 5e-324])
def test_a_temperature_below_the_floor_is_refused(temperature):
    with pytest.raises(InputError, match=rf"sampling\.temperature: expected 0 \(greedy\) or a finite number >= "
                                         rf"{MIN_TEMPERATURE:g}, found {temperature!r}"):
        SamplingParams(temperature=temperature).check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_temperature_overflows_the_scores(dtype):
    """At the floor temperature, logits as large as the dtype holds still give a distribution (the raw
    logits / temperature would be inf, and softmax nan); the huge gaps make every draw the argmax."""
    big = torch.finfo(dtype).max
    logits = torch.tensor([[0.5 * big, -big, 0.0, 0.25 * big], [1.0, 3.0, 2.0, -1.0]], dtype=dtype)  # [2, 4]
    for temperature in (MIN_TEMPERATURE, 1e30):
        params = [SamplingParams(temperature=temperature, seed=s) for s in (1, 2)]
        scores = warp(logits, params[0])
        assert not scores.isnan().any() and (scores.amax(-1) == 0).all()
        assert (scores.softmax(-1).sum(-1) - 1).abs().max() < 1e-5
        tokens = sample(logits, params, [p.generator() for p in params])
        if temperature == MIN_TEMPERATURE:
            assert tokens.tolist() == [0, 1]
        with pytest.raises(RuntimeError):  # what the unshifted scores would have given torch.multinomial
            torch.multinomial((logits[0].float() / 1e-40).softmax(-1), 1)


def test_draw_is_multinomials_draw():
    probs = torch.rand(50, generator=torch.Generator().manual_seed(0)) ** 4  # [50], unnormalised
    for seed in range(40):
        ours = draw(probs, torch.Generator().manual_seed(seed))
        assert ours.item() == torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)).item()


def test_sample_rows_fails_a_row_alone():
    """A row whose logits hold nan (a greedy one too) or +inf, or are all -inf, or whose parameters are bad,
    fails with one line of its own; the other rows get the tokens sample() gives them alone."""
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))  # [5, 32]
    logits[1, 7] = float("nan")
    logits[3, 2] = float("inf")
    logits[4, 9] = float("-inf")  # a masked token is fine
    logits[0, 11] = float("-inf")
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(), SamplingParams(temperature=1.2, seed=2),
              SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=1e-40)]
    gens = [p.generator() if p.temperature >= MIN_TEMPERATURE else None for p in params]
    gens[4] = torch.Generator()
    tokens, errors = sample_rows(logits, params, gens)
    assert sorted(errors) == [1, 3, 4] and [tokens[r] is None for r in range(5)] == [False, True, False, True, True]
    assert "finite logits, found nan or +inf" in str(errors[1]) and isinstance(errors[1], RunError)
    assert "finite logits" in str(errors[3])
    assert isinstance(errors[4], InputError) and "params[4].temperature" in str(errors[4])
    assert all("\n" not in str(e) for e in errors.values())
    for r in (0, 2):
        alone = sample(logits[r:r + 1], [params[r]], [params[r].generator()])[0].item()
        assert tokens[r] == alone
    masked = torch.full((2, 8), float("-inf"))  # [2, 8]: nothing to draw in row 1
    masked[0, 3] = 1.0
    tokens, errors = sample_rows(masked, [SamplingParams(), SamplingParams()], [None, None])
    assert tokens == [3, None] and "finite logits" in str(errors[1])
    with pytest.raises(InputError, match="one per row"):  # a wrong call is the caller's, not a row's
        sample_rows(logits, params[:2], gens[:2])
