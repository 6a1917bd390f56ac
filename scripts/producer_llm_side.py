"""The producer's side of the LLM test data: runs INSIDE a furiosa-llm 2026.3.0 environment.

Started by scripts/producer_llm.py (which makes that environment and says how) with the Python
of a venv holding the torch, pydantic and transformers furiosa-llm 2026.3.0 pins, and
PYTHONPATH holding its furiosa-* dependencies (installed with --no-deps) and stand-ins for what a
CPU machine lacks. It never imports fastpipe.

    producer_llm_side.py generate --src SRC --out DIR [--cases f32 bf16]
        For each case: a tiny Llama checkpoint (transformers, seed 0) saved with
        save_pretrained; furiosa-llm's own ModelMetadata / ModelCreationInfo /
        get_param_file_with_cache; PipelineBuilder.build with PipelineParallelismMppp over
        cpu:0 and cpu:1, comp_supertask_kind FX, for a prefill and a decode bucket (example
        inputs from ModelMetadata.get_example_input, i.e. furiosa-models'
        make_example_inputs); saved with the artifact builder's own save step
        (ArtifactBuilder.__preprocess_for_pipeline_save: payloads to <blob-id>.fx, the
        parameter file copied beside them under a relative path). Then the model object the
        builder traced (ModelMetadata.pretrained_model() is lru-cached: the same instance)
        runs eagerly: one prefill and NEW_TOKENS greedy decode steps, caches carried from
        step to step, with the inputs formed by the rule in `prefill_inputs` /
        `decode_inputs`; every model-level input, the logits and the caches are recorded.
    producer_llm_side.py check --src SRC2 --case DIR --report OUT.json
        Read the saved pipelines with a furiosa-llm release's own Pipeline.load and get_gms
        (2026.2.1: 2026.3.0's loader fails on its own files under Python < 3.14), run the
        decoded graphs on the CPU, chained through the pipeline (send -> recv, slices taken
        by metadata.tensor_slices, constants from its loader), on the recorded inputs of
        every step with the caches carried, and compare with the eager model's logits and
        caches. Recorded as provenance; fastpipe does not depend on it.

SRC is an unzipped furiosa-llm wheel. Its furiosa_llm/__init__.py is not executed; the
package is registered with its real path so its submodules import as they are.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # furiosa-torch registers an NPU backend

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

# ----------------------------------------------------------------------------- what is made
GEOMETRY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=128, max_position_embeddings=64,
                tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
                initializer_range=0.3)     # (default 0.02: near-uniform logits, greedy ties)
SEED = 0
DEVICES = ("cpu:0", "cpu:1")        # one pipeline stage (one decoder layer) per device
NUM_BLOCKS = 48                     # paged KV cache blocks per layer and k/v (block 0: padding)
BLOCK_SIZE = 1                      # the only block size furiosa-llm 2026.3.0 builds
PADDING_BLOCK = 0                   # its DEFAULT_PAGED_ATTENTION_PADDING_BLOCK_IDX
PREFILL = (2, 8)                    # (batch, attention size = sequence length)
DECODE = (2, 32)                    # (batch, attention size = 31 past slots + 1 new token)
PROMPT_LENS = (5, 8)                # per row of the batch
NEW_TOKENS = 16                     # the prefill's token, then NEW_TOKENS decode steps
PAD_TOKEN = 0                       # input id at padded prefill positions
CASES = {"f32": "W32A32KV32", "bf16": "W16A16KV16"}
PARAM_DIR = "params"

NOTES: list[str] = []


# ----------------------------------------------------------------------------- producer modules
def register_package(src: str) -> None:
    """furiosa_llm registered with its real path, its __init__ not executed."""
    for name in [m for m in sys.modules if m == "furiosa_llm" or m.startswith("furiosa_llm.")]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        "furiosa_llm", os.path.join(src, "furiosa_llm", "__init__.py"),
        submodule_search_locations=[os.path.join(src, "furiosa_llm")])
    sys.modules["furiosa_llm"] = importlib.util.module_from_spec(spec)  # registered, not executed


def bind_compiled_graph(T) -> None:
    """types.py names CompiledGraph only under TYPE_CHECKING, yet Pipeline's annotations mention
    it: typing.get_type_hints, and so Pipeline.load, raise NameError. Bind it from the native
    package that defines it."""
    if "CompiledGraph" in str(T.Pipeline.__annotations__.get("blobs")) and not hasattr(T, "CompiledGraph"):
        T.CompiledGraph = importlib.import_module("furiosa.native_common.compiler").CompiledGraph
        NOTES.append("bound types.CompiledGraph from furiosa.native_common.compiler "
                     "(types.py imports it only under TYPE_CHECKING)")


def standins_imported() -> list[str]:
    return sorted(name for name, mod in list(sys.modules.items())
                  if f"{os.sep}standins{os.sep}" in str(getattr(mod, "__file__", "") or ""))


# ----------------------------------------------------------------------------- inputs rule
def block_tables(gen: torch.Generator) -> list[list[int]]:
    """Per row: the blocks holding its positions 0, 1, ... in order, drawn without replacement
    from a shuffled set of non-padding blocks (so they are neither contiguous nor sorted)."""
    free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    need = [n + NEW_TOKENS for n in PROMPT_LENS]
    out, at = [], 0
    for n in need:
        out.append(free[at:at + n])
        at += n
    return out


def prefill_inputs(prompts: list[list[int]], tables: list[list[int]]) -> dict[str, torch.Tensor]:
    """Model-level prefill inputs for a batch of prompts (right-padded to the bucket length S):
    - input_ids [B, S] i32: the prompt, PAD_TOKEN after it;
    - position_ids [B, S] i32: 0..L-1, 0 at padded positions;
    - write block mappings [B, S] i32 (k and v alike): position i of row b is written to block
      tables[b][i]; padded positions to the padding block;
    - mask [B, S, S] bool, True = may attend: query i sees key j iff j <= i and j < L (padded
      query rows see the prompt, so no row is empty)."""
    B, S = PREFILL
    ids = torch.full((B, S), PAD_TOKEN, dtype=torch.int32)
    pos = torch.zeros((B, S), dtype=torch.int32)
    write = torch.full((B, S), PADDING_BLOCK, dtype=torch.int32)
    mask = torch.zeros((B, S, S), dtype=torch.bool)
    for b, prompt in enumerate(prompts):
        n = len(prompt)
        ids[b, :n] = torch.tensor(prompt, dtype=torch.int32)
        pos[b, :n] = torch.arange(n, dtype=torch.int32)
        write[b, :n] = torch.tensor(tables[b][:n], dtype=torch.int32)
        for i in range(S):
            mask[b, i, :min(i, n - 1) + 1] = True
    return {"input_ids": ids, "position_ids": pos,
            "attention_metadata__full_cache_write_block_mapping_0": write,
            "attention_metadata__full_cache_write_block_mapping_1": write.clone(),
            "attention_masks_mask": mask}


def decode_inputs(tokens: list[int], past: list[int], tables: list[list[int]]) -> dict[str, torch.Tensor]:
    """Model-level decode inputs, one new token per row, row b having past[b] cached tokens:
    - input_ids [B, 1] i32: the token generated last; position_ids [B, 1] i32: past[b];
    - write block mappings [B, 1] i32: tables[b][past[b]];
    - load block mappings [B, A-1] i32: tables[b][0..past[b]-1], then the padding block
      (furiosa's sparse_select `dummy_index`);
    - mask [B, 1, A] bool: keys are the A-1 loaded slots followed by the new token (the model
      concatenates them in that order): True for slots j < past[b] and for the last one."""
    B, A = DECODE
    ids = torch.tensor(tokens, dtype=torch.int32).view(B, 1)
    pos = torch.tensor(past, dtype=torch.int32).view(B, 1)
    write = torch.tensor([tables[b][past[b]] for b in range(B)], dtype=torch.int32).view(B, 1)
    load = torch.full((B, A - 1), PADDING_BLOCK, dtype=torch.int32)
    mask = torch.zeros((B, 1, A), dtype=torch.bool)
    for b in range(B):
        load[b, :past[b]] = torch.tensor(tables[b][:past[b]], dtype=torch.int32)
        mask[b, 0, :past[b]] = True
        mask[b, 0, A - 1] = True
    return {"input_ids": ids, "position_ids": pos,
            "attention_metadata__full_cache_load_block_mapping_0": load,
            "attention_metadata__full_cache_load_block_mapping_1": load.clone(),
            "attention_metadata__full_cache_write_block_mapping_0": write,
            "attention_metadata__full_cache_write_block_mapping_1": write.clone(),
            "attention_masks_mask": mask}


# ----------------------------------------------------------------------------- flat names
def path_of(root, name: str) -> list:
    """The keys, indices and attribute names, from the model's keyword arguments down, of the
    leaf a flat input name stands for (the producer names flat inputs after their dynamo
    sources: attributes, keys and indices joined by '_')."""
    obj, rest, path = root, name, []
    while rest:
        if isinstance(obj, dict):
            keys = [str(k) for k in obj]
        elif isinstance(obj, (list, tuple)):
            keys = [str(i) for i in range(len(obj))]
        else:
            keys = list(vars(obj))
        match = next((k for k in sorted(keys, key=len, reverse=True)
                      if rest == k or rest.startswith(k + "_")), None)
        if match is None:
            raise KeyError(f"{name}: no part of {type(obj).__name__} matches {rest!r}")
        key = int(match) if isinstance(obj, (list, tuple)) else match
        path.append(key)
        obj = obj[key] if isinstance(obj, (dict, list, tuple)) else getattr(obj, key)
        rest = rest[len(match) + 1:]
    return path


def resolve(root, name: str):
    obj = root
    for key in path_of(root, name):
        obj = obj[key] if isinstance(obj, (dict, list, tuple)) else getattr(obj, key)
    return obj


def assign(root, name: str, value) -> None:
    """Replace the leaf `name` stands for (tuples on the way are rebuilt)."""
    def put(obj, path):
        if not path:
            return value
        key, rest = path[0], path[1:]
        if isinstance(obj, tuple):
            return tuple(put(o, rest) if i == key else o for i, o in enumerate(obj))
        if isinstance(obj, (dict, list)):
            obj[key] = put(obj[key], rest)
        else:
            setattr(obj, key, put(getattr(obj, key), rest))
        return obj
    put(root, path_of(root, name))


def is_cache(name: str) -> bool:
    return name.startswith("kv_caches_")


# ----------------------------------------------------------------------------- one case
class Builder:
    def __init__(self, src: str):
        register_package(src)
        imp = importlib.import_module
        self.ModelMetadata = imp("furiosa_llm.metadata").ModelMetadata
        ot = imp("furiosa_llm.optimum.types")
        self.LLMConfig, self.QuantizationConfig = ot.LLMConfig, ot.QuantizationConfig
        self.ModelCreationInfo = imp("furiosa_llm.parallelize.model_creation_info").ModelCreationInfo
        self.PipelineBuilder = imp("furiosa_llm.parallelize.pipeline.builder.api").PipelineBuilder
        mppp = imp("furiosa_llm.parallelize.mppp.api")
        self.PipelineParallelismMppp = mppp.PipelineParallelismMppp
        self.Device = imp("furiosa_llm.parallelize.mppp.config").Device
        self.CompilerConfigContext = imp("furiosa_llm.parallelize.compiler_config").CompilerConfigContext
        self.T = imp("furiosa_llm.parallelize.pipeline.types")
        self.get_param_file_with_cache = imp("furiosa_llm.parallelize.trace").get_param_file_with_cache
        self.AttentionBucket = imp("furiosa_llm.metadata.config_types").AttentionBucket
        # the artifact builder's own save step (its module imports ray at the top: stood in for)
        self.ArtifactBuilder = imp("furiosa_llm.artifact.builder").ArtifactBuilder
        bind_compiled_graph(self.T)

    def checkpoint(self, folder: Path, dtype: torch.dtype) -> Path:
        import transformers
        config = transformers.LlamaConfig(**GEOMETRY)
        torch.manual_seed(SEED)
        model = transformers.LlamaForCausalLM(config).to(dtype).eval()
        model.save_pretrained(folder)
        return folder

    def run_case(self, case: str, out: Path) -> dict:
        dtype = torch.float32 if case == "f32" else torch.bfloat16
        tmp = Path(tempfile.mkdtemp(prefix=f"fp-llm-{case}-"))
        try:
            ckpt = self.checkpoint(tmp / "checkpoint", dtype)
            qconf = self.QuantizationConfig.from_str(CASES[case])
            md = self.ModelMetadata("generate", hf_configs=self.transformers_config(ckpt),
                                    llm_config=self.LLMConfig(quantization_config=qconf), model_id_or_path=str(ckpt))
            mci = self.ModelCreationInfo(md, False)     # random_weight_model=False: the checkpoint's weights
            params = self.get_param_file_with_cache(mci, tmp / "params")
            devices = [self.Device(d) for d in DEVICES]
            buckets = {"prefill": self.AttentionBucket.prefill(*PREFILL), "decode": self.AttentionBucket.decode(*DECODE)}
            pipelines, examples = {}, {}
            (tmp / "build").mkdir()
            for phase, bucket in buckets.items():
                args, kwargs = md.get_example_input(bucket, paged_attention_num_blocks=NUM_BLOCKS,
                                                    paged_attention_block_size=BLOCK_SIZE)
                p = self.PipelineBuilder(mci, md.config, tmp / "build").build(
                    f"llama-tiny-{case}-{phase}-b{bucket.batch_size}-a{bucket.attention_size}", devices, args, kwargs,
                    self.PipelineParallelismMppp(), params,
                    self.CompilerConfigContext(md, bucket=bucket), self.T.SuperTaskKind.FX,
                    padding_block_idx=PADDING_BLOCK, cache_dir=None)
                pipelines[phase], examples[phase] = p, kwargs
            if out.exists():
                shutil.rmtree(out)
            out.mkdir(parents=True)
            absolute = sorted({pf.path for p in pipelines.values() for pf in p.param_files.values()})
            save = getattr(self.ArtifactBuilder, "_ArtifactBuilder__preprocess_for_pipeline_save")
            docs = save(list(pipelines.values()), str(out), False)   # bundle_binaries=False: <blob-id>.fx files
            saved_as = sorted({pf["path"] for doc in docs for pf in doc["param_files"].values()})
            # its save copies the checkpoint's shard folder, named after the build's temporary
            # paths and a hash of them, beside the pipelines: renamed to PARAM_DIR (paths stay relative)
            for old in {Path(p).parent for p in saved_as}:
                assert len(old.parts) == 1, saved_as
                (out / old).rename(out / PARAM_DIR)
            for phase, doc in zip(pipelines, docs):
                for pf in doc["param_files"].values():
                    pf["path"] = str(Path(PARAM_DIR) / Path(pf["path"]).name)
                (out / f"{phase}.json").write_text(json.dumps(doc, indent=2) + "\n")
            record = self.reference(md, examples, out)
            record["hf_check"] = hf_check(ckpt, dtype, out)
            record["param_files_as_built"] = absolute
            record["param_files_as_saved"] = saved_as
            record["model_class"] = f"{type(md.pretrained_model()).__module__}.{type(md.pretrained_model()).__name__}"
            return record
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def transformers_config(ckpt: Path):
        import transformers
        return transformers.AutoConfig.from_pretrained(ckpt)

    def reference(self, md, examples: dict, out: Path) -> dict:
        """The eager run of the model the builder traced (see the module docstring)."""
        model = md.pretrained_model()      # lru-cached: the instance PipelineBuilder traced
        gen = torch.Generator().manual_seed(SEED)
        vocab = GEOMETRY["vocab_size"]
        prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
        tables = block_tables(gen)
        meta = {phase: json.loads((out / f"{phase}.json").read_text())["metadata"]["tensors"]["inputs"]
                for phase in examples}
        cache_names = [n for n in meta["prefill"] if is_cache(n)]
        assert cache_names == [n for n in meta["decode"] if is_cache(n)]
        first = resolve(examples["prefill"], cache_names[0])
        caches = {n: torch.randn(tuple(resolve(examples["prefill"], n).shape), generator=gen).to(first.dtype)
                  for n in cache_names}          # seeded, not zero: untouched blocks must stay as they are
        saved = {f"initial.{n}": c.clone() for n, c in caches.items()}

        def run(phase: str, step: int, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            kwargs = examples[phase]
            names = list(meta[phase])
            assert sorted(names) == sorted(list(inputs) + cache_names), (names, list(inputs))
            # the example's own containers (as make_example_inputs made them), their tensors
            # replaced: the caches by the carried ones (the model writes them in place), every
            # other input by this step's value, same shape and dtype
            for name in names:
                leaf = resolve(kwargs, name)
                value = caches[name] if is_cache(name) else inputs[name]
                want = meta[phase][name]
                assert list(leaf.shape) == want["shape"] == list(value.shape), (name, leaf.shape, want)
                assert leaf.dtype == value.dtype, (name, leaf.dtype, value.dtype)
                assign(kwargs, name, value)
                if not is_cache(name):
                    saved[f"step{step}.{name}"] = value.clone()
            for name in names:
                assert resolve(kwargs, name) is (caches[name] if is_cache(name) else inputs[name]), name
            with torch.no_grad():
                result = model(**kwargs)
            logits = result if isinstance(result, torch.Tensor) else (
                result["logits"] if isinstance(result, dict) else getattr(result, "logits", None))
            if logits is None:
                logits = result[0]
            assert list(logits.shape) == json.loads((out / f"{phase}.json").read_text())[
                "metadata"]["tensors"]["outputs"]["logits"]["shape"]
            saved[f"step{step}.logits"] = logits.detach().clone()
            return logits

        logits = run("prefill", 0, prefill_inputs(prompts, tables))
        tokens = [[int(logits[b, n - 1].float().argmax())] for b, n in enumerate(PROMPT_LENS)]
        saved.update({f"after_prefill.{n}": c.clone() for n, c in caches.items()})
        for step in range(1, NEW_TOKENS + 1):
            past = [n + step - 1 for n in PROMPT_LENS]
            logits = run("decode", step, decode_inputs([t[-1] for t in tokens], past, tables))
            for b in range(len(tokens)):
                tokens[b].append(int(logits[b, 0].float().argmax()))
        saved.update({f"final.{n}": c.clone() for n, c in caches.items()})
        save_file({k: v.contiguous() for k, v in saved.items()}, str(out / "steps.safetensors"))
        doc = {"prompts": prompts, "prompt_lens": list(PROMPT_LENS), "generated": [t[:NEW_TOKENS + 1] for t in tokens],
               "generated_note": "token 0 of each row comes from the prefill (argmax at its last prompt position), "
                                 "token k from decode step k (argmax of its only position); decode step k feeds "
                                 "token k-1",
               "block_tables": tables, "padding_block": PADDING_BLOCK, "block_size": BLOCK_SIZE,
               "num_blocks": NUM_BLOCKS, "pad_token": PAD_TOKEN, "steps": NEW_TOKENS + 1,
               "buckets": {"prefill": {"batch": PREFILL[0], "attention_size": PREFILL[1], "pipeline": "prefill.json",
                                       "steps": [0]},
                           "decode": {"batch": DECODE[0], "attention_size": DECODE[1], "pipeline": "decode.json",
                                      "steps": list(range(1, NEW_TOKENS + 1))}}}
        (out / "tokens.json").write_text(json.dumps(doc, indent=1) + "\n")
        return {"tokens": doc["generated"]}


def hf_check(ckpt: Path, dtype: torch.dtype, out: Path) -> dict:
    """An independent check of the input rule: transformers' own LlamaForCausalLM on the same
    checkpoint, each row's whole sequence (prompt and generated tokens) at once, no cache; its
    logits at the positions each step computed, against the eager furiosa-models run's."""
    import transformers
    steps = load_file(str(out / "steps.safetensors"))
    doc = json.loads((out / "tokens.json").read_text())
    hf = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
    worst, agree = 0.0, True
    for b, (prompt, gen) in enumerate(zip(doc["prompts"], doc["generated"])):
        seq = torch.tensor([prompt + gen[:-1]])
        with torch.no_grad():
            ref = hf(seq).logits[0].float()
        n = len(prompt)
        ours = [steps["step0.logits"][b, :n].float()] + [steps[f"step{k}.logits"][b, 0:1].float()
                                                          for k in range(1, doc["steps"])]
        ours = torch.cat(ours)
        worst = max(worst, ((ours - ref).abs().max() / ref.abs().max()).item())
        agree &= torch.equal(ours.argmax(-1)[n - 1:], ref.argmax(-1)[n - 1:])
    return {"max_rel_logits_error": worst, "greedy_tokens_agree": bool(agree)}


def margins(out: Path) -> float:
    """The smallest gap between the two largest logits of any greedy choice (how far a runtime's
    rounding may stray before its tokens differ)."""
    steps = load_file(str(out / "steps.safetensors"))
    doc = json.loads((out / "tokens.json").read_text())
    gaps = []
    for k in range(doc["steps"]):
        logits = steps[f"step{k}.logits"].float()
        for b, n in enumerate(doc["prompt_lens"]):
            row = logits[b, n - 1] if k == 0 else logits[b, 0]
            top = row.topk(2).values
            gaps.append((top[0] - top[1]).item())
    return min(gaps)


def generate(args) -> int:
    b = Builder(args.src)
    out = Path(args.out)
    report = {"torch": torch.__version__, "python": sys.version.split()[0], "cases": {}}
    for case in args.cases:
        report["cases"][case] = b.run_case(case, out / case)
        report["cases"][case]["min_top2_gap"] = margins(out / case)
        print(f"{case}: {report['cases'][case]['tokens']}", flush=True)
    report["notes"] = NOTES + [f"imported a stand-in for {n}" for n in standins_imported()]
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))
    return 0


# ----------------------------------------------------------------------------- producer's loader
def check(args) -> int:
    register_package(args.src)
    T = importlib.import_module("furiosa_llm.parallelize.pipeline.types")
    bind_compiled_graph(T)
    case = Path(args.case)
    steps = load_file(str(case / "steps.safetensors"))
    tokens = json.loads((case / "tokens.json").read_text())
    result = {"notes": [], "phases": {}}
    caches = {k.split(".", 1)[1]: v.clone() for k, v in steps.items() if k.startswith("initial.")}
    cwd = os.getcwd()
    try:
        runners = {}
        for phase in ("prefill", "decode"):
            try:
                pipeline = T.Pipeline.load(str(case / f"{phase}.json"))
            except Exception as exc:
                result["phases"][phase] = {"load": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
                continue
            for bid in list(pipeline.blobs):
                if pipeline.blobs[bid] in (None, "None"):
                    pipeline.blobs[bid] = (case / f"{bid}.fx").read_text()
            os.chdir(case)   # its loader opens param files relative to the working directory
            gms = pipeline.get_gms(get_input_constants=True, skip_preprocess=True)
            os.chdir(cwd)
            runners[phase] = (pipeline, gms)
            result["phases"][phase] = {"load": "ok", "graphs": len(gms)}
        if set(runners) != {"prefill", "decode"}:
            raise RuntimeError(f"not loaded: {result['phases']}")
        worst = {}
        for step in range(tokens["steps"]):
            phase = "prefill" if step == 0 else "decode"
            pipeline, gms = runners[phase]
            inputs = {k.split(".", 1)[1]: v for k, v in steps.items() if k.startswith(f"step{step}.") and not k.endswith(".logits")}
            inputs.update(caches)
            logits = run_pipeline(T, pipeline, gms, inputs)
            ref = steps[f"step{step}.logits"]
            err = ((logits.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            worst[phase] = max(worst.get(phase, 0.0), err)
            if step == 0:
                result["after_prefill_max_rel_cache_error"] = caches_agree(caches, steps, "after_prefill", tokens)
        result["final_max_rel_cache_error"] = caches_agree(caches, steps, "final", tokens)
        result["max_rel_logits_error"] = worst
        result["ok"] = True
    except Exception as exc:
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}".splitlines()[0][:400], trace=traceback.format_exc(limit=-4))
    finally:
        os.chdir(cwd)
    result["notes"] += NOTES + [f"imported a stand-in for {n}" for n in standins_imported()]
    Path(args.report).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "trace"}), flush=True)
    return 0 if result.get("ok") else 1


def caches_agree(caches: dict, steps: dict, when: str, tokens: dict) -> float:
    """The largest difference, relative to the cache's scale, over every non-padding block against
    the eager model's caches (the padding block receives every padded position's write, so its
    content depends on the order of duplicate index_put writes)."""
    pad = tokens["padding_block"]
    keep = [i for i in range(tokens["num_blocks"]) if i != pad]
    worst = 0.0
    for n, c in caches.items():
        ref = steps[f"{when}.{n}"][keep].float()
        worst = max(worst, ((c[keep].float() - ref).abs().max() / ref.abs().max()).item())
    return worst


def run_pipeline(T, pipeline, gms, original: dict[str, torch.Tensor]) -> torch.Tensor:
    """The decoded graphs run in supertask-id order (the order get_gms returns them in), with
    each pipeline input cut from its original by metadata.tensor_slices and each send's tensor
    handed to the recv of its group. The caches are passed as the tensors in `original`, so
    the graphs' in-place writes land in them."""
    env: dict[str, torch.Tensor] = {}
    for name, sl in pipeline.metadata.tensor_slices.inputs.items():
        t = original[sl.origin]
        idx = tuple(slice(a, b) for a, b in sl.placements)
        full = all(a == 0 and b == n for (a, b), n in zip(sl.placements, t.shape))
        env[name] = t if full else t[idx]     # whole tensors stay the same object (in-place writes)
    sent: dict[str, torch.Tensor] = {}
    fx = iter(gms)
    for sid, st in sorted(pipeline.supertasks.items(), key=lambda kv: int(kv[0])):
        kind = str(getattr(st.kind, "value", st.kind)).lower()
        if kind == "fx":
            gm, consts = next(fx)
            args = [c if c is not None else env[n] for n, c in zip(st.inputs, consts)]
            with torch.no_grad():
                out = gm(*args)
            out = out if isinstance(out, (tuple, list)) else (out,)
            env.update(zip(st.outputs, out))
        elif kind == "send":
            sent[st.group] = env[st.inputs[0]]
        elif kind == "recv":
            env[st.outputs[0]] = sent[st.group].clone()
    (name, sl), = pipeline.metadata.tensor_slices.outputs.items()
    return env[name]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--src", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--cases", nargs="+", default=list(CASES))
    g.add_argument("--report")
    c = sub.add_parser("check")
    c.add_argument("--src", required=True)
    c.add_argument("--case", required=True)
    c.add_argument("--report", required=True)
    args = ap.parse_args()
    return generate(args) if args.cmd == "generate" else check(args)


if __name__ == "__main__":
    sys.exit(main())
