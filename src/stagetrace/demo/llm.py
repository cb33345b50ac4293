"""The demo's streamed LLM service: server-sent events from a small decoder-only transformer.

One engine thread serves every request, as an LLM server's engine loop does (continuous batching): a
request is tokenized (``tokenize``, a byte-level BPE tokenizer trained at start), joins the engine at the
next round with a free slot (``prefill``: its prompt through the model after the service's system prompt,
whose keys and values are computed once), and from then on, each round, one ``decode_step`` runs the new
token of every sequence in flight through the model against its KV cache (one batch), a ``detokenize``
turns each one's new token into text (one batch), and each stream is sent one event,
``data: {"token": ID, "text": "..."}``: one chunk of the response a token.

The baseline detokenizes the way it is often first written: decode the whole sequence (system prompt,
prompt and tokens so far) at every token and send what is new. Each detokenize then costs more than the
last, and with a batch of streams, more than the model's whole step. The optimized service decodes
incrementally (a window of a few tokens and the offsets of what was already sent: the method of vLLM and
TGI) and sends exactly the same text. Tokenizer and model are made at start from a fixed seed; nothing is
downloaded.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import importlib
import json
import queue
import random
import statistics
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the endpoints' string annotations here

import stagetrace

MODEL_NAME = "tinygpt-demo"
PROVIDER = "stagetrace-demo"
VOCAB_SIZE = 4096
SYSTEM_PROMPT_WORDS = 5000  # the service's system prompt (a document): about 6,400 tokens
PROMPT_WORDS = 40  # a request's own prompt (a question about it)
MAX_TOKENS = 160  # tokens generated a request by default
MAX_TOKENS_LIMIT = 1024
CONTEXT = 8192  # the model's positions: system prompt, prompt and generated tokens together
SLOTS = 8  # sequences the engine serves at a time (a continuous batch)
SEED = 0
SPECIAL_TOKENS = ("<|endoftext|>",)
INCOMPLETE = "\ufffd"  # what a decoder gives for the bytes of a character not complete yet


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ImportError(
            "the llm demo pipeline needs the `tokenizers` library: pip install 'stagetrace[demo]' "
            "(or pip install tokenizers)"
        ) from None
    return tokenizers


# --- text and tokenizer ---------------------------------------------------------------------------------------

# fmt: off
_SYLLABLES = ("ka", "ri", "to", "mo", "len", "sha", "vi", "qu", "dar", "nel", "po", "zi", "ter", "ax", "um",
              "ble", "cor", "fin", "gra", "hul", "me", "sa", "tri", "on", "el", "bra", "ust", "ing", "ve", "lo")
# fmt: on
_PUNCTUATION = ("",) * 12 + (",", ",", ".", ".", ".", ";", "!", "?")


def _words(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4)))) for _ in range(n)]


def make_text(seed: int, words: int, lexicon_seed: int = SEED) -> str:
    """Sentences of made-up words, the frequent ones far more frequent (as in a natural language): the
    tokenizer's training corpus, and prompts. The lexicon is the same for every ``seed``."""
    lexicon = _words(random.Random(lexicon_seed), 3000)
    weights = [1 / (rank + 1) for rank in range(len(lexicon))]
    rng = random.Random(seed)
    chosen = rng.choices(lexicon, weights, k=words)
    out: list[str] = []
    start = True
    for word in chosen:
        mark = rng.choice(_PUNCTUATION)
        out.append((word.capitalize() if start else word) + mark)
        start = mark in ".!?"
    return " ".join(out)


def train_tokenizer(corpus: Sequence[str], vocab_size: int = VOCAB_SIZE, *, every_byte: bool = False) -> Any:
    """A byte-level BPE tokenizer (GPT-2's scheme) trained on ``corpus``; ``every_byte`` puts all 256
    bytes in its alphabet (then any token sequence decodes, complete characters or not)."""
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet() if every_byte else [],
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def demo_tokenizer() -> Any:
    """The demo's tokenizer: trained on 60,000 words of generated text (well under a second)."""
    corpus = make_text(SEED, 60_000).split(". ")
    return train_tokenizer(corpus)


# --- detokenizers -----------------------------------------------------------------------------------------------


class WholeSequenceDetokenizer:
    """The baseline: at every token, decode the whole sequence (prompt and tokens so far), cut off the
    prompt's text, and return what was not returned yet. Right, and each call costs more than the last."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.prompt_chars = len(tokenizer.decode(self.ids))
        self.sent = 0  # characters of the generated text returned so far

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)[self.prompt_chars :]
        if text.endswith(INCOMPLETE):  # the bytes of a character not complete yet: wait for the rest
            return ""
        return self._new(text)

    def flush(self) -> str:
        return self._new(self.tokenizer.decode(self.ids)[self.prompt_chars :])

    def _new(self, text: str) -> str:
        piece = text[self.sent :]
        self.sent = len(text)
        return piece


class IncrementalDetokenizer:
    """The fix: decode only a window of the last few tokens. ``prefix`` is the tokens whose text was
    already returned (kept as context: a token's text can depend on the one before it), the tokens after
    it are new; once the window's text ends in a complete character, the new text is returned and the
    window moves on. The same text as decoding the whole sequence, at a cost that does not grow."""

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.window = list(prompt_ids[-self.CONTEXT_TOKENS :])
        self.prefix = len(self.window)  # window[:prefix]: already returned (or the prompt)

    def add(self, token_id: int) -> str:
        self.window.append(token_id)
        before = self.tokenizer.decode(self.window[: self.prefix])
        text = self.tokenizer.decode(self.window)
        if len(text) <= len(before) or text.endswith(INCOMPLETE):
            return ""
        self.window = self.window[self.prefix :]
        self.prefix = len(self.window)
        return text[len(before) :]

    def flush(self) -> str:
        before = self.tokenizer.decode(self.window[: self.prefix])
        text = self.tokenizer.decode(self.window)
        self.window = self.window[self.prefix :]
        self.prefix = len(self.window)
        return text[len(before) :]


Detokenizer = Callable[[Any, Sequence[int]], "WholeSequenceDetokenizer | IncrementalDetokenizer"]


# --- the service ------------------------------------------------------------------------------------------------


def _request(raw: bytes) -> tuple[str, int, int]:
    """prompt, max_tokens, seed from a JSON body ``{"prompt": str, "max_tokens": int, "seed": int}``."""
    body = json.loads(raw)
    if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
        raise ValueError('the body must be a JSON object with a "prompt" string')
    max_tokens, seed = body.get("max_tokens", MAX_TOKENS), body.get("seed", SEED)
    if type(max_tokens) is not int or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise ValueError(f"max_tokens must be an integer from 1 to {MAX_TOKENS_LIMIT}")
    if type(seed) is not int:
        raise ValueError("seed must be an integer")
    return body["prompt"], max_tokens, seed


class _Stream:
    """One request's generation: what the engine needs of it, and the queue its events reach it by."""

    def __init__(
        self, ids: list[int], max_tokens: int, seed: int, detokenizer: Detokenizer, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.admission = stagetrace.enqueue("prefill.queue")  # its wait for a free slot
        self.context = contextvars.copy_context()  # the request's: the engine enqueues it in its trace
        self.ids = ids  # system prompt and prompt
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.make_detokenizer = detokenizer
        self.detokenizer: WholeSequenceDetokenizer | IncrementalDetokenizer | None = None
        self.loop = loop
        self.events: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.slot = -1
        self.token = -1  # the latest token, not yet detokenized and sent
        self.sent = 0  # tokens sent
        self.gone = False  # the client went away (or the stream ended)

    def put(self, event: bytes | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the server's loop is closed: nobody to send to
            self.gone = True

    async def body(self) -> AsyncIterator[bytes]:
        try:
            while (event := await self.events.get()) is not None:
                yield event
            stagetrace.generation(MODEL_NAME, provider=PROVIDER, output_tokens=self.sent)
        finally:
            self.gone = True


class Engine:
    """Continuous batching on one thread, as an LLM server's engine loop. Each round admits the requests
    waiting while a slot is free (``prefill``), runs one ``decode_step`` for every sequence in flight (one
    batch), ``detokenize``s each one's new token (one batch) and hands each stream its event. Each is
    traced as a batch (``stagetrace.enqueue`` in the request's context, ``stagetrace.batch`` around the
    work): every request's trace has the batches it was in, so between two of its tokens it shows the
    model's step and the detokenization its stream waited for, each a composite past the first few."""

    def __init__(self, model: Any, tokenizer: Any, system_ids: list[int], slots: int, device: Any) -> None:
        import torch

        self.torch, self.model, self.tokenizer, self.device, self.slots = torch, model, tokenizer, device, slots
        self.system_ids = system_ids
        self.prefix = model.new_cache(1, len(system_ids))
        self.cache = model.new_cache(slots)
        with torch.inference_mode():
            model.prefill(system_ids, self.prefix, 0)  # once: every request's sequence starts with it
            self.round_ms = self._warm_up(tokenizer.encode(make_text(2, PROMPT_WORDS)).ids)
        self.cache.lengths = [0] * slots
        self.banned = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
        self.free = list(range(slots))  # a heap: the lowest slots first, so the ones in use stay together
        self.waiting: queue.SimpleQueue[_Stream] = queue.SimpleQueue()
        self.active: list[_Stream] = []
        threading.Thread(target=self._run, name="llm-engine", daemon=True).start()

    def _warm_up(self, prompt: list[int]) -> float:
        """As servers do before they take requests (the first calls of each path are slow), and a measure of
        this machine: a round of the engine at its fullest, a prompt's prefill and a step of every slot, in ms
        (the median of nine, after one; the model's own time, none of the CPU side's per-token work)."""
        model, slots = self.model, self.slots
        for slot in range(slots):
            model.prefill(prompt, self.cache, slot, self.prefix)
        rounds = []
        for _ in range(10):
            start = time.perf_counter()
            model.prefill(prompt, self.cache, 0, self.prefix)
            model.decode([0] * slots, list(range(slots)), self.cache)
            rounds.append((time.perf_counter() - start) * 1e3)
        return statistics.median(rounds[1:])

    def gap_threshold_ms(self) -> float:
        """The gaps' p99 past which the demo's streams are slow: four of the engine's fullest rounds, and 1 ms.
        A stream's slowest gaps are rounds that admitted other requests and waited on the event loop and the
        CPUs (measured on a 2-vCPU VM, with the fix, the slowest stream's gap p99 was 2.3 to 4.1 rounds); the
        baseline's detokenizing of the whole sequence at every token makes them 5 to 10."""
        return round(4.0 * self.round_ms + 1.0, 1)

    def room(self, max_tokens: int) -> int:
        """How many prompt tokens fit beside the system prompt and ``max_tokens`` generated."""
        return self.cache.capacity - len(self.system_ids) - max_tokens

    def submit(self, stream: _Stream) -> None:
        self.waiting.put(stream)

    def _run(self) -> None:
        while True:
            try:
                self._admit()
                if self.active:
                    self._round()
            except Exception:
                traceback.print_exc()
                for stream in list(self.active):  # they end (short): the engine goes on with the next
                    self._finish(stream)

    def _admit(self) -> None:
        while self.free:
            try:
                stream = self.waiting.get(block=not self.active)
            except queue.Empty:
                return
            if not stream.gone:
                stream.slot = heapq.heappop(self.free)
                self._prefill(stream)
                self.active.append(stream)

    def _prefill(self, stream: _Stream) -> None:
        torch = self.torch
        with torch.inference_mode(), stagetrace.batch("prefill", [stream.admission], 1, kind="gpu"):
            logits = self.model.prefill(stream.ids[len(self.system_ids) :], self.cache, stream.slot, self.prefix)
            (stream.token,) = self._sample(logits, [stream])

    def _sample(self, logits: Any, streams: list[_Stream]) -> list[int]:
        """One token per row, drawn from its softmax with its stream's own random numbers."""
        torch = self.torch
        logits[:, self.banned] = float("-inf")  # exactly max_tokens a request (as benchmarks' ignore_eos)
        cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1)
        draws = torch.tensor([[s.rng.random()] for s in streams], device=cdf.device)
        return [int(t) for t in torch.searchsorted(cdf, draws).clamp_(max=cdf.shape[1] - 1).flatten().tolist()]

    def _round(self) -> None:
        torch = self.torch
        stepping = [s for s in self.active if s.sent]  # the rest have their first token from prefill
        if stepping:
            tickets = [s.context.run(stagetrace.enqueue, "decode_step.queue") for s in stepping]
            with torch.inference_mode(), stagetrace.batch("decode_step", tickets, self.slots, kind="gpu"):
                logits = self.model.decode([s.token for s in stepping], [s.slot for s in stepping], self.cache)
                for stream, token in zip(stepping, self._sample(logits, stepping)):
                    stream.token = token
        tickets = [s.context.run(stagetrace.enqueue, "detokenize.queue") for s in self.active]
        with stagetrace.batch("detokenize", tickets, self.slots):
            texts = [self._detokenize(s) for s in self.active]
        for stream, text in zip(list(self.active), texts):
            stream.put(f"data: {json.dumps({'token': stream.token, 'text': text})}\n\n".encode())
            stream.sent += 1
            if stream.sent == stream.max_tokens or stream.gone:
                self._finish(stream)

    def _detokenize(self, stream: _Stream) -> str:
        if stream.detokenizer is None:
            stream.detokenizer = stream.make_detokenizer(self.tokenizer, stream.ids)
        text = stream.detokenizer.add(stream.token)
        return text + stream.detokenizer.flush() if stream.sent + 1 == stream.max_tokens else text

    def _finish(self, stream: _Stream) -> None:
        self.active.remove(stream)
        heapq.heappush(self.free, stream.slot)
        stream.put(None)


def add_routes(app: Any, device: Any, *, slots: int = SLOTS, system_prompt: str | None = None) -> Engine:
    """``POST /generate`` (the baseline) and ``POST /generate-optimized``: a JSON body in, server-sent events
    out, from one engine serving up to ``slots`` sequences at a time. Every request's sequence is the
    service's system prompt, the request's prompt, and what the model generates."""
    import torch
    from fastapi.responses import JSONResponse, StreamingResponse

    from stagetrace.demo.tinygpt import build_model

    try:  # what Starlette's first streamed response imports, on the event loop: now, as part of the warm-up
        importlib.import_module("anyio._backends._asyncio")
    except ImportError:
        pass
    tokenizer = demo_tokenizer()
    model = build_model(tokenizer.get_vocab_size(), device, context=CONTEXT, seed=SEED)
    system = make_system_prompt() if system_prompt is None else system_prompt
    # The engine's steps are small: one intra-op thread, not parallel regions that wait on a busy core.
    torch.set_num_threads(1)
    engine = Engine(model, tokenizer, tokenizer.encode(system).ids, slots, device)
    # Both routes' streams are slow when their gaps are: the demo's SLO, measured on this machine.
    gap_ms = engine.gap_threshold_ms()
    app.state.gap_thresholds_ms = {"/generate": gap_ms, "/generate-optimized": gap_ms}

    async def serve(request: Request, detokenizer: Detokenizer) -> Any:
        try:
            prompt, max_tokens, seed = _request(await request.body())
            if engine.room(max_tokens) < 1:
                raise ValueError("max_tokens leaves no room for the prompt in the model's context")
        except ValueError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        stagetrace.generation(MODEL_NAME, provider=PROVIDER, operation="text_completion")
        with stagetrace.stage("tokenize"):
            ids = engine.system_ids + tokenizer.encode(prompt).ids[-engine.room(max_tokens) :]
        stream = _Stream(ids, max_tokens, seed, detokenizer, asyncio.get_running_loop())
        engine.submit(stream)
        return StreamingResponse(stream.body(), media_type="text/event-stream")

    @app.post("/generate")
    async def generate_baseline(request: Request) -> Any:
        return await serve(request, WholeSequenceDetokenizer)

    @app.post("/generate-optimized")
    async def generate_optimized(request: Request) -> Any:
        return await serve(request, IncrementalDetokenizer)

    return engine


def make_system_prompt(words: int = SYSTEM_PROMPT_WORDS) -> str:
    """The service's system prompt: a long document the requests ask about (made-up words)."""
    return make_text(1, words)


def make_payload(max_tokens: int = MAX_TOKENS, words: int = PROMPT_WORDS) -> bytes:
    """A request: a question of ``words`` words about the document, and how many tokens to generate."""
    return json.dumps({"prompt": make_text(2, words), "max_tokens": max_tokens}).encode()
