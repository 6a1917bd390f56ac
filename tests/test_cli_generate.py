"""`fastpipe build --serve` and `fastpipe generate`: a tiny random llama built into a serving set through the
CLI, generated from (eager) and compared with transformers' own greedy generate; text through a tokenizer
made offline; seeded sampling; one-line errors (exit 2, no traceback); the printers and the progress bar."""
import contextlib
import io
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint  # noqa: E402
from fastpipe.cli import main  # noqa: E402
from fastpipe.cli.generate import IdPrinter, Progress, TextPrinter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EOS = 2
# seed 4 of this config: PROMPT_A runs 12 tokens without meeting EOS; PROMPT_B meets EOS at its 2nd token
PROMPT_A = [5, 7, 9, 11, 2]
PROMPT_B = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
SETS = {"prefill_b1_s8", "prefill_b1_s16", "prefill_b2_s8", "prefill_b2_s16", "decode_b1", "decode_b2"}
STATS = re.compile(r"^(\d+) tokens in \d+\.\d+ s \(\d+\.\d tokens/s, first token after \d+ ms\); (.+)$")


def _config():
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=128, vocab_size=100, max_position_embeddings=64,
                                    bos_token_id=1, eos_token_id=EOS)


def _tokenizer():
    """A word-level tokenizer over the model's 100 ids: "w5" <-> 5, specials <unk> <s> </s> = 0 1 2."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": EOS, **{f"w{i}": i for i in range(3, 100)}}
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _cli_quiet(*args) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main([str(a) for a in args])
    return code, out.getvalue()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama") / "m"
    return folder, save_random_checkpoint(_config(), folder, seed=4).eval()


@pytest.fixture(scope="module")
def serving_set(model_dir, tmp_path_factory):
    """The CLI's serving set: batches 1, 2 x prompt lengths 8, 16, max_len 48, tp 2 (and what build printed)."""
    out = tmp_path_factory.mktemp("serve") / "out"
    code, printed = _cli_quiet("build", model_dir[0], "-o", out, "--serve", "--max-len", "48", "--batches", "1,2",
                               "--prompt-lens", "8,16", "--tp", "2")
    assert code == 0, printed
    return out, printed


@pytest.fixture(scope="module")
def text_set(model_dir, tmp_path_factory):
    """The same checkpoint with a tokenizer beside it, built into a batch-1 serving set (tokenizer linked in)."""
    src, _ = model_dir
    folder = tmp_path_factory.mktemp("tok") / "m"
    folder.mkdir()
    for f in src.iterdir():
        os.link(f, folder / f.name)
    _tokenizer().save_pretrained(str(folder))
    out = folder.parent / "out"
    code, printed = _cli_quiet("build", folder, "-o", out, "--serve", "--max-len", "48", "--prompt-lens", "8,16")
    assert code == 0, printed
    return out


def hf_greedy(model, prompt, max_new_tokens=12, eos=EOS):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, expected):
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("fastpipe: error: ") and "Traceback" not in err, err
    assert expected in err, err
    assert not any(t.name == "fastpipe-engine" for t in threading.enumerate())   # the engine was closed


# ---------------------------------------------------------------------------------------------------- build
def test_build_serve_writes_the_set(serving_set):
    out, printed = serving_set
    assert {p.parent.name for p in out.glob("*/pipeline.json")} == SETS
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    assert not (out / "tokenizer.json").exists()
    lines = printed.splitlines()
    assert {Path(line.removeprefix("wrote ")).parent.name for line in lines[:-1]} == SETS
    assert lines[-1].startswith(f"wrote 6 pipelines under {out} (prefill: batches [1, 2] x prompt lengths [8, 16]; "
                                "decode: batches [1, 2]; max_len 48) in ")


def test_build_max_len_without_serve_is_one_static_cache_step(model_dir, tmp_path, capsys):
    from fastpipe.format import read_pipeline

    code, out, _ = cli(capsys, "build", model_dir[0], "-o", tmp_path / "o", "--max-len", "24")
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'o' / 'pipeline.json'}: 1 slots")
    ins = read_pipeline(tmp_path / "o" / "pipeline.json").metadata.tensors_inputs
    assert ins["input_ids"].shape == (1, 1) and ins["cache_position"].shape == (1,)   # --seq-len defaults to 1
    assert ins["past_key_values_0_0"].shape[2] == 24


def test_build_cache_rows_is_a_prefill_into_a_static_cache(model_dir, tmp_path, capsys):
    from fastpipe.format import read_pipeline

    code, out, _ = cli(capsys, "build", model_dir[0], "-o", tmp_path / "o", "--max-len", "24", "--seq-len", "8",
                       "--batch", "2", "--cache-rows", "3", "--last-logits")
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'o' / 'pipeline.json'}: 1 slots")
    meta = read_pipeline(tmp_path / "o" / "pipeline.json").metadata
    ins = meta.tensors_inputs
    assert ins["input_ids"].shape == (2, 8) and ins["cache_row"].shape == (2,) and ins["logits_index"].shape == (2,)
    assert ins["past_key_values_0_0"].shape[:3] == (3, 2, 24) and "cache_position" not in ins
    assert meta.tensors_outputs["logits"].shape[:2] == (2, 1)


@pytest.mark.parametrize("args, expected", [
    (["--serve"], "--serve: expected --max-len M"),
    (["--cache-rows", "2"], "--cache-rows: expected with --max-len"),
    (["--max-len", "48", "--batch", "4", "--cache-rows", "2"], "--cache-rows: expected >= --batch (4: a cache row per"),
    (["--serve", "--max-len", "48", "--cache-rows", "2"], "--cache-rows: expected none with --serve"),
    (["--serve", "--max-len", "48", "--seq-len", "4", "--batch", "2"],
     "--seq-len/--batch: expected none with --serve"),
    (["--serve", "--max-len", "48", "--past-len", "0"], "--past-len: expected none with --serve"),
    (["--batches", "1,2"], "--batches: expected with --serve (they shape a serving set), found without"),
    (["--max-len", "48", "--past-len", "4"], "--past-len/--max-len: expected one of them, found both"),
    (["--max-len", "48", "--last-logits"], "--last-logits/--max-len: expected one of them, found both"),
    (["--serve", "--max-len", "48", "--prompt-lens", "8,64"],
     "--prompt-lens: expected comma-separated integers >= 1 and <= 48, found '8,64'"),
    (["--serve", "--max-len", "48", "--batches", "1,x"], "--batches: expected comma-separated integers >= 1"),
    (["--serve", "--max-len", "480"], "--max-len: expected at most the model's 64 positions (config.json), found 480"),
])
def test_build_flag_errors(model_dir, tmp_path, capsys, args, expected):
    code, _, err = cli(capsys, "build", model_dir[0], "-o", tmp_path / "o", *args)
    assert_one_line_error(code, err, expected)
    assert not (tmp_path / "o").exists()                   # refused before anything is written


def test_build_serve_refuses_a_folder_with_other_pipelines(model_dir, tmp_path, capsys):
    (tmp_path / "o" / "decode_b8").mkdir(parents=True)
    (tmp_path / "o" / "decode_b8" / "pipeline.json").write_text("{}")
    code, _, err = cli(capsys, "build", model_dir[0], "-o", tmp_path / "o", "--serve", "--max-len", "48")
    assert_one_line_error(code, err, "-o/--output: expected an empty folder or one this set overwrites, found other "
                                     "pipelines in")
    assert "decode_b8" in err


# ---------------------------------------------------------------------------------------------------- generate
@pytest.mark.parametrize("prompt, extra, eos, n, stop", [
    (PROMPT_A, [], EOS, 12, "reached --max-new-tokens"),
    (PROMPT_B, ["--batch", "2"], EOS, 2, "stopped at EOS"),                  # the 2-row decode bucket
    (PROMPT_B, ["--ignore-eos"], None, 12, "reached --max-new-tokens"),
], ids=["greedy", "eos-batch2", "ignore-eos"])
def test_generate_ids_equal_hf_greedy(serving_set, model_dir, capsys, prompt, extra, eos, n, stop):
    want = hf_greedy(model_dir[1], prompt, eos=eos)
    code, out, err = cli(capsys, "generate", serving_set[0], "--prompt-ids", ",".join(map(str, prompt)),
                         "--max-new-tokens", "12", "--no-compile", *extra)
    assert code == 0, err
    assert out == " ".join(map(str, want)) + "\n" and len(want) == n
    loaded, stats = err.splitlines()
    assert loaded.startswith(f"loaded 6 pipelines from {serving_set[0]} in ") and "max_len 48" in loaded
    assert f"decode batch {2 if '--batch' in extra else 1}" in loaded
    m = STATS.match(stats)
    assert m and int(m.group(1)) == n and m.group(2) == stop, stats


def test_generate_starts_eagerly_and_the_engine_swaps_the_compiled_decode_step_in(serving_set, model_dir, capsys):
    """The default (--compile background): the first token comes without a compile in the foreground, the
    stderr says how the buckets compile and where the decode step stood; an engine kept running gets the
    decode step compiled in the background, measured and swapped in, with the same tokens throughout."""
    want = hf_greedy(model_dir[1], PROMPT_A)
    code, out, err = cli(capsys, "generate", serving_set[0], "--prompt-ids", ",".join(map(str, PROMPT_A)),
                         "--max-new-tokens", "12")
    assert code == 0 and out == " ".join(map(str, want)) + "\n", err
    loaded, stats, decode = err.splitlines()
    assert "(eager at once; each bucket compiled in the background as it is used)" in loaded
    assert STATS.match(stats) and decode.startswith("decode step: "), err

    from fastpipe.serving.engine import Engine

    eng = Engine(serving_set[0], batch=1)
    try:
        assert eng.warmup_seconds < 5                   # nothing compiled up front
        assert eng.submit(PROMPT_A, max_new_tokens=12).result(timeout=300) == want
        (cg,) = eng.decode.compiled_graphs().values()
        assert cg._queued or cg._ready, cg.state()      # called 11 times: queued at the second call
        assert eng.decode.wait_compiled(600), cg.state()
        from fastpipe.runtime.compiling.background_compile import background

        for _ in range(4):          # measured against eager while nothing else compiles (the prefills queue too)
            assert background().wait_idle(600)
            assert eng.submit(PROMPT_A, max_new_tokens=12).result(timeout=300) == want
            if eng.decode.compile_settled():
                break
        assert cg.compiled and cg.timing is not None and eng.decode.compile_settled(), cg.state()
        assert "faster on real calls" in eng.decode.describe()
    finally:
        eng.close()


def test_generate_text_through_the_tokenizer(text_set, model_dir, capsys):
    tok = transformers.AutoTokenizer.from_pretrained(str(text_set), local_files_only=True)
    prompt = "w5 w7 w9 w11 </s>"
    ids = tok.encode(prompt)
    assert ids == PROMPT_A
    want = tok.decode(hf_greedy(model_dir[1], ids), skip_special_tokens=True)
    code, out, err = cli(capsys, "generate", text_set, "--prompt", prompt, "--max-new-tokens", "12", "--no-compile",
                         "--quiet")
    assert code == 0 and err == ""
    assert out == want + "\n" and want.startswith("w")
    code, out, _ = cli(capsys, "generate", text_set, "--prompt", prompt, "--max-new-tokens", "12", "--no-compile",
                       "--quiet", "--ids")
    assert code == 0 and out == " ".join(map(str, hf_greedy(model_dir[1], ids))) + "\n"


def test_seeded_sampling_repeats(serving_set, capsys):
    def sampled(seed):
        code, out, err = cli(capsys, "generate", serving_set[0], "--prompt-ids", "5,7,9", "--max-new-tokens", "12",
                             "--no-compile", "--temperature", "0.9", "--top-k", "50", "--top-p", "0.95",
                             "--seed", seed, "--ignore-eos", "-q")
        assert code == 0 and err == "", err
        return [int(x) for x in out.split()]

    first = sampled(11)
    assert len(first) == 12 and all(0 <= t < 100 for t in first)
    assert sampled(11) == first


def test_python_m_fastpipe_generate_end_to_end(serving_set, model_dir):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = lambda *a: subprocess.run([sys.executable, "-m", "fastpipe", "generate", *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True, env=env, timeout=300)
    r = run(serving_set[0], "--prompt-ids", ",".join(map(str, PROMPT_A)), "--max-new-tokens", "12", "--no-compile")
    assert r.returncode == 0, r.stderr
    assert r.stdout == " ".join(map(str, hf_greedy(model_dir[1], PROMPT_A))) + "\n"
    assert STATS.match(r.stderr.splitlines()[-1]) and "\r" not in r.stderr      # no progress bar off a terminal
    r = run(serving_set[0], "--prompt-ids", "5,100", "--no-compile")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "fastpipe: error: prompt: expected token ids in [0, 100), found 100\n"


@pytest.mark.parametrize("args, expected", [
    (["--prompt", "w5 w7"], "--prompt: expected a folder with a tokenizer"),
    (["--prompt-ids", ",".join(["5"] * 17)], "prompt: expected at most 16 tokens (the largest prefill bucket), found 17"),
    (["--prompt-ids", "5,7,9,11,2", "--max-new-tokens", "44"],
     "max_new_tokens: expected at most 43 (max_len 48 - the prompt's 5 tokens), found 44"),
    (["--prompt-ids", "5,7,100"], "prompt: expected token ids in [0, 100), found 100"),
    (["--prompt-ids", "5,-1"], "prompt: expected token ids in [0, 100), found -1"),
    (["--prompt-ids", "5,x"], "--prompt-ids: expected comma-separated integer token ids, found 'x'"),
    (["--prompt-ids", "5", "--batch", "3"], "--batch: expected one of the decode buckets [1, 2], found 3"),
    (["--prompt-ids", "5", "--top-p", "0.5"], "--top-p: expected --temperature > 0 with it"),
    (["--prompt-ids", "5", "--temperature", "0.5", "--top-k", "-1"], "--top-k: expected an integer >= 0"),
    (["--prompt-ids", "5", "--max-new-tokens", "0"], "--max-new-tokens: expected an integer >= 1, found 0"),
    (["--prompt-ids", "5", "--temperature", "1e-40"], "--temperature: expected 0 (greedy) or a finite number >= 1e-05, found 1e-40"),
    ([], "one of the arguments --prompt --prompt-ids is required"),
], ids=["no-tokenizer", "prompt-too-long", "past-max-len", "id-past-vocab", "negative-id", "bad-ids", "batch",
        "top-p-greedy", "top-k", "max-new-0", "temperature-below-floor", "no-prompt"])
def test_generate_errors(serving_set, capsys, args, expected):
    code, out, err = cli(capsys, "generate", serving_set[0], "--no-compile", *args)
    assert out == ""
    if not args:        # argparse's own error: its usage line follows (tests/test_cli_first_hour.py)
        err, usage = err.split("\n", 1)[0] + "\n", err.split("\n", 1)[1]
        assert usage.startswith("usage: fastpipe generate [-h]") and usage.count("\n") == 1, usage
    assert_one_line_error(code, err, expected)


def test_generate_folder_errors(serving_set, tmp_path, capsys):
    code, _, err = cli(capsys, "generate", tmp_path, "--prompt-ids", "5", "--no-compile")
    assert_one_line_error(code, err, f"serving set: expected */pipeline.json under \"{tmp_path}\", found none")
    code, _, err = cli(capsys, "generate", tmp_path / "nope", "--prompt-ids", "5", "--no-compile")
    assert_one_line_error(code, err, "serving set: expected a folder written by `fastpipe build --serve`")
    single = serving_set[0] / "decode_b1"           # one pipeline's folder, not a serving set
    code, _, err = cli(capsys, "generate", single, "--prompt-ids", "5", "--no-compile")
    assert_one_line_error(code, err, "found a single pipeline.json (build with `fastpipe build MODEL -o OUT --serve")


# ---------------------------------------------------------------------------------------------------- printers
def test_printers_and_progress():
    s = io.StringIO()
    p = IdPrinter(s)
    for t in (4, 5, 6):
        p.add(t)
    p.finish()
    assert s.getvalue() == "4 5 6\n"

    class Bytes:          # a byte-level tokenizer: a 2-byte character is incomplete after its first token
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    s = io.StringIO()
    p = TextPrinter(Bytes(), s)
    for t, seen in zip("aé!".encode(), ["a", "a", "aé", "aé!"]):
        p.add(t)
        assert s.getvalue() == seen                          # the half character is held back
    p.finish()
    assert s.getvalue() == "aé!\n"

    s = io.StringIO()
    bar = Progress(s, enabled=True)
    bar.start(4, 0.0)
    for n in range(1, 5):
        bar.update(n)
    assert s.getvalue().startswith("\r[") and "4/4 tokens" in s.getvalue() and "tok/s" in s.getvalue()
    bar.clear()
    assert s.getvalue().endswith("\r")
    s = io.StringIO()
    off = Progress(s, enabled=False)
    off.start(4, 0.0)
    off.update(4)
    off.clear()
    assert s.getvalue() == ""
