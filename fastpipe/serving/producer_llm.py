"""Greedy generation over the producer's LLM pipeline pair (furiosa-llm's prefill and decode buckets).

    llm = ProducerLLM("prefill.json", "decode.json", device_map=None)    # fastpipe.load's keywords
    tokens = llm.generate([[43, 94, 97], [22, 12]], max_new_tokens=16)  # one list of new tokens per prompt

furiosa-llm's LLM pipelines (its PipelineBuilder, block size 1) keep the KV cache as paged blocks,
one model input per layer and key/value (`kv_caches_<layer>_<k|v>`, `[blocks, 1, kv_heads, head_dim]`),
written in place by the graphs (fastpipe.validate.written), with block 0 the padding block. A step's
other model inputs, for a bucket of batch B (the rule furiosa-models' paged attention reads them by):
- prefill, S positions: `input_ids` and `position_ids` `[B, S]` (rows right-padded with 0);
  `attention_metadata__full_cache_write_block_mapping_<k>` `[B, S]`: the block each position is
  written to (padding positions: block 0); `attention_masks_mask` `[B, S, S]`: position i sees j when
  j <= i and j < the row's length;
- decode, A attention slots: `input_ids`, `position_ids` `[B, 1]` (the row's last token and its
  position, the number of tokens cached); `..._write_block_mapping_<k>` `[B, 1]`: the block the new
  token goes to; `..._load_block_mapping_<k>` `[B, A-1]`: the blocks of the cached positions, padded
  with block 0; `attention_masks_mask` `[B, 1, A]`: the cached positions and the last slot (the new
  token itself).
The next token is the argmax of the logits at the row's last position. Blocks come from a
BlockAllocator (fastpipe.serving.blocks); the caches live in this object and are carried from step
to step in place. Rows a call does not use run as padding (block 0 only).
"""
from __future__ import annotations

import re
from typing import Sequence

import torch

from fastpipe import dtypes
from fastpipe.errors import InputError
from fastpipe.serving.blocks import BlockAllocator

_CACHE = re.compile(r"kv_caches_\d+_\d+")
_WRITE = "attention_metadata__full_cache_write_block_mapping_"
_LOAD = "attention_metadata__full_cache_load_block_mapping_"
_MASK = "attention_masks_mask"


class ProducerLLM:
    def __init__(self, prefill, decode, **load_options):
        from fastpipe.session import load

        self.prefill = load(prefill, **load_options)
        self.decode = load(decode, **load_options)
        pre = self.prefill.pipeline.metadata.tensors_inputs
        dec = self.decode.pipeline.metadata.tensors_inputs
        for where, names, need in (("prefill", pre, ("input_ids", "position_ids", _MASK)),
                                   ("decode", dec, ("input_ids", "position_ids", _MASK))):
            missing = [n for n in need if n not in names]
            if missing:
                raise InputError(f"{where}: metadata.tensors.inputs: expected the producer's LLM inputs "
                                 f"({', '.join(need)}), found no {', '.join(missing)}")
        self.batch, self.prompt_len = pre["input_ids"].shape
        self.attention = dec[_MASK].shape[-1]
        self.cache_names = sorted(n for n in dec if _CACHE.fullmatch(n))
        if not self.cache_names or sorted(n for n in pre if _CACHE.fullmatch(n)) != self.cache_names:
            raise InputError("metadata.tensors.inputs: expected the same kv_caches_<layer>_<k> inputs in prefill and "
                             "decode")
        shape = dec[self.cache_names[0]].shape
        if len(shape) != 4 or shape[1] != 1:
            raise InputError(f"metadata.tensors.inputs.{self.cache_names[0]}.shape: expected [blocks, 1, kv_heads, "
                             f"head_dim] (block size 1), found {list(shape)}")
        self.caches = {n: torch.zeros(dec[n].shape, dtype=dtypes.to_torch(dec[n].dtype)) for n in self.cache_names}
        self.blocks = BlockAllocator(shape[0], padding=0)
        self._write = {"prefill": sorted(n for n in pre if n.startswith(_WRITE)),
                       "decode": sorted(n for n in dec if n.startswith(_WRITE))}
        self._load = sorted(n for n in dec if n.startswith(_LOAD))
        self.last_tables: list[list[int]] = []      # the block tables of the last generate(), per prompt

    # ------------------------------------------------------------------ one step's inputs
    def prefill_inputs(self, prompts: Sequence[Sequence[int]], tables: Sequence[Sequence[int]]) -> dict:
        """The prefill bucket's model inputs (not the caches) for prompts whose positions go to `tables`."""
        B, S = self.batch, self.prompt_len
        ids = torch.zeros(B, S, dtype=torch.int32)
        pos = torch.zeros(B, S, dtype=torch.int32)
        write = torch.zeros(B, S, dtype=torch.int32)
        mask = torch.zeros(B, S, S, dtype=torch.bool)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        for b in range(B):
            n = len(prompts[b]) if b < len(prompts) else 1      # an unused row: one padding token
            if b < len(prompts):
                ids[b, :n] = torch.tensor(prompts[b], dtype=torch.int32)
                write[b, :n] = torch.tensor(tables[b][:n], dtype=torch.int32)
                pos[b, :n] = torch.arange(n, dtype=torch.int32)
            mask[b] = causal
            mask[b, :, n:] = False
        return {"input_ids": ids, "position_ids": pos, _MASK: mask, **{k: write for k in self._write["prefill"]}}

    def decode_inputs(self, last: Sequence[int], lengths: Sequence[int], tables: Sequence[Sequence[int]]) -> dict:
        """The decode bucket's model inputs: each row's last token, how many positions it has cached
        (`lengths`: the new token goes to position lengths[b], block tables[b][lengths[b]])."""
        B, A = self.batch, self.attention
        ids = torch.zeros(B, 1, dtype=torch.int32)
        pos = torch.zeros(B, 1, dtype=torch.int32)
        write = torch.zeros(B, 1, dtype=torch.int32)
        load = torch.zeros(B, A - 1, dtype=torch.int32)
        mask = torch.zeros(B, 1, A, dtype=torch.bool)
        mask[:, 0, A - 1] = True
        for b in range(min(B, len(last))):
            n = lengths[b]
            ids[b, 0], pos[b, 0], write[b, 0] = last[b], n, tables[b][n]
            load[b, :n] = torch.tensor(tables[b][:n], dtype=torch.int32)
            mask[b, 0, :n] = True
        return {"input_ids": ids, "position_ids": pos, _MASK: mask, **{k: write for k in self._write["decode"]},
                **{k: load for k in self._load}}

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy: a prefill, then max_new_tokens - 1 decode steps; the new tokens of each prompt."""
        if not 1 <= len(prompts) <= self.batch:
            raise InputError(f"prompts: expected 1 to {self.batch} prompts (the buckets' batch), found {len(prompts)}")
        for i, p in enumerate(prompts):
            if not 1 <= len(p) <= self.prompt_len:
                raise InputError(f"prompts[{i}]: expected 1 to {self.prompt_len} tokens (the prefill bucket), "
                                 f"found {len(p)}")
            if len(p) + max_new_tokens - 1 > self.attention - 1:
                raise InputError(f"max_new_tokens: expected at most {self.attention - len(p)} for prompts[{i}] (the "
                                 f"decode bucket attends to {self.attention - 1} cached positions), found {max_new_tokens}")
        tables: list[list[int]] = []
        try:
            for p in prompts:
                tables.append(self.blocks.allocate(len(p)))
            logits = self.prefill.run_model(**self.prefill_inputs(prompts, tables), **self.caches)["logits"]
            last = [int(logits[b, len(p) - 1].argmax()) for b, p in enumerate(prompts)]
            out = [[t] for t in last]
            lengths = [len(p) for p in prompts]
            for _ in range(max_new_tokens - 1):
                for b in range(len(prompts)):
                    tables[b] += self.blocks.allocate(1)
                logits = self.decode.run_model(**self.decode_inputs(last, lengths, tables), **self.caches)["logits"]
                last = [int(logits[b, 0].argmax()) for b in range(len(prompts))]
                for b, t in enumerate(last):
                    out[b].append(t)
                    lengths[b] += 1
            self.last_tables = [list(t) for t in tables]
            return out
        finally:
            for t in tables:
                self.blocks.free(t)

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
