"""A small decoder-only transformer for the demo's LLM pipeline (``demo.llm``): GPT-2's shape (learned
positions, pre-norm blocks, GELU MLP) with two memory savers of today's models: multi-query attention (one
key/value head shared by the query heads, as PaLM and Falcon; Llama's grouped-query attention is the same
idea) and sliding-window attention (each position sees the ``window`` positions up to itself, as Mistral),
so a decode step costs the same at position 300 and at position 3,000. Random weights from a fixed seed,
nothing downloaded.

Generation uses a KV cache with a row per sequence in flight (a slot): ``prefill`` runs one sequence's
prompt, ``decode`` runs one new token of every sequence in a batch, each against its own keys and values.
A prompt prefix shared by every request (a system prompt) is prefilled once and copied into each new
sequence's slot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F


class KVCache:
    """Keys and values per layer: ``slots`` x ``capacity`` x head size (one key/value head)."""

    def __init__(self, layers: int, head_dim: int, slots: int, capacity: int, device: Any) -> None:
        self.k = [torch.zeros(slots, capacity, head_dim, device=device) for _ in range(layers)]
        self.v = [torch.zeros(slots, capacity, head_dim, device=device) for _ in range(layers)]
        self.lengths = [0] * slots  # positions filled, per slot
        self.capacity = capacity


class TinyGPT(torch.nn.Module):
    def __init__(
        self, vocab: int, *, dim: int = 128, heads: int = 4, layers: int = 2, context: int = 4096, window: int = 256
    ) -> None:
        super().__init__()
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.context, self.window = context, window
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(context, dim)
        self.blocks = torch.nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def new_cache(self, slots: int, capacity: int | None = None) -> KVCache:
        capacity = self.context if capacity is None else capacity
        if capacity > self.context:
            raise ValueError(f"a cache of {capacity} positions is longer than the model's context ({self.context})")
        return KVCache(len(self.blocks), self.head_dim, slots, capacity, self.tok.weight.device)

    def prefill(self, ids: Sequence[int], cache: KVCache, slot: int, prefix: KVCache | None = None) -> Any:
        """Run ``ids`` in ``slot`` after what ``prefix``'s first slot holds (copied in), or from the start,
        a window at a time; the logits of the token after them (1 x vocab)."""
        start = 0 if prefix is None else prefix.lengths[0]
        if start + len(ids) > cache.capacity:
            raise ValueError(f"{start + len(ids)} positions do not fit in the cache ({cache.capacity})")
        if prefix is not None:
            for mine, theirs in zip((*cache.k, *cache.v), (*prefix.k, *prefix.v)):
                mine[slot, :start] = theirs[0, :start]
        device = self.tok.weight.device
        x = None
        for at in range(0, len(ids), self.window):
            chunk = torch.tensor(ids[at : at + self.window], device=device)
            first = start + at  # the chunk's first position
            x = self._embed(chunk, torch.arange(first, first + len(chunk), device=device))
            low = max(0, first - self.window + 1)  # the first key any of its positions sees
            queries = torch.arange(first, first + len(chunk), device=device)[:, None]
            keys = torch.arange(low, first + len(chunk), device=device)[None, :]
            mask = (keys <= queries) & (keys > queries - self.window)
            for block, k, v in zip(self._layers(), cache.k, cache.v):
                x = block.prefill(x, k[slot], v[slot], first, low, mask)
        cache.lengths[slot] = start + len(ids)
        assert x is not None, "nothing to prefill"
        return self._logits(x[-1:])

    def decode(self, tokens: Sequence[int], slots: Sequence[int], cache: KVCache) -> Any:
        """One step of several sequences: ``tokens[i]`` appended to slot ``slots[i]``; the logits of each
        one's next token (len(slots) x vocab)."""
        device = self.tok.weight.device
        positions = [cache.lengths[s] for s in slots]
        if max(positions) >= cache.capacity:
            raise ValueError("a sequence fills its KV cache")
        # Attention reads one view of the cache: the slots from the lowest in use to the highest, the
        # positions any of them sees. A slot in that range that is not in this step sees one key (and is not
        # read back).
        low, high = min(slots), max(slots) + 1
        first, last = max(0, min(positions) - self.window + 1), max(positions) + 1
        rows = torch.tensor([s - low for s in slots], device=device)
        pos = torch.tensor(positions, device=device)
        keys = torch.arange(first, last, device=device)[None, :]
        seen = torch.zeros(high - low, last - first, dtype=torch.bool, device=device)
        seen[:, 0] = True
        seen[rows] = (keys <= pos[:, None]) & (keys > pos[:, None] - self.window)
        x = self._embed(torch.tensor(tokens, device=device), pos)
        for block, k, v in zip(self._layers(), cache.k, cache.v):
            x = block.decode(x, k[low:high], v[low:high], rows, pos, seen, first)
        for s in slots:
            cache.lengths[s] += 1
        return self._logits(x)

    def _layers(self) -> list[_Block]:
        return [block for block in self.blocks if isinstance(block, _Block)]

    def _embed(self, ids: Any, positions: Any) -> Any:
        return F.embedding(ids, self.tok.weight) + F.embedding(positions, self.pos.weight)

    def _logits(self, x: Any) -> Any:
        return F.linear(F.layer_norm(x, (self.dim,), self.ln.weight, self.ln.bias), self.head.weight)


class _Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, dim + 2 * self.head_dim)  # the query heads, one key and one value head
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc = torch.nn.Linear(dim, 4 * dim)
        self.out = torch.nn.Linear(4 * dim, dim)

    def _qkv(self, x: Any) -> tuple[Any, Any, Any]:
        h = F.layer_norm(x, (self.dim,), self.ln1.weight, self.ln1.bias)
        q, k, v = F.linear(h, self.qkv.weight, self.qkv.bias).split((self.dim, self.head_dim, self.head_dim), dim=1)
        return q, k, v

    def _rest(self, x: Any, att: Any) -> Any:
        x = x + F.linear(att, self.proj.weight, self.proj.bias)
        h = F.layer_norm(x, (self.dim,), self.ln2.weight, self.ln2.bias)
        return x + F.linear(F.gelu(F.linear(h, self.fc.weight, self.fc.bias)), self.out.weight, self.out.bias)

    def prefill(self, x: Any, k_cache: Any, v_cache: Any, first: int, low: int, mask: Any) -> Any:
        """``x``: T x dim, one sequence at positions first..; keys from ``low``, as ``mask`` allows."""
        t = x.shape[0]
        q, k, v = self._qkv(x)
        k_cache[first : first + t] = k
        v_cache[first : first + t] = v
        qh = q.view(1, t, self.heads, self.head_dim).transpose(1, 2)  # 1 x heads x T x hd
        keys, values = k_cache[None, None, low : first + t], v_cache[None, None, low : first + t]
        att = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, enable_gqa=True)
        return self._rest(x, att[0].transpose(0, 1).reshape(t, self.dim))

    def decode(self, x: Any, k_cache: Any, v_cache: Any, rows: Any, pos: Any, seen: Any, first: int) -> Any:
        """``x``: n x dim, one new token per sequence, at cache rows ``rows`` and positions ``pos``; each
        attends to its own row's keys from position ``first`` on, as ``seen`` (rows x positions) allows."""
        n = x.shape[0]
        q, k, v = self._qkv(x)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
        last = first + seen.shape[1]
        keys, values = k_cache[:, first:last], v_cache[:, first:last]  # rows x L x hd, a view
        queries = x.new_zeros(seen.shape[0], self.heads, self.head_dim)
        queries[rows] = q.view(n, self.heads, self.head_dim)
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
        att = torch.bmm(torch.softmax(scores, dim=-1), values)[rows]  # n x heads x hd
        return self._rest(x, att.reshape(n, self.dim))


def build_model(vocab: int, device: Any, *, context: int = 4096, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(vocab, context=context).to(device).eval()
