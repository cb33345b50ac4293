"""`stagetrace demo --pipeline llm`: a streamed LLM service (server-sent events from a small transformer,
a BPE tokenizer trained at start), traced. The fast tests check its parts against plain references (the
incremental detokenizer against decoding the whole sequence, the batched sliding-window decode against a
naive forward, the load generator's reading of chunked streams); the slow one serves it for real and reads
what stagetrace made of its streams."""

from __future__ import annotations

import json
import math
import random
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("tokenizers")

from stagetrace.demo import llm
from stagetrace.demo.load import _Response

# Text whose characters take one to four bytes: a byte-level tokenizer splits some of them between tokens.
_MIXED = "Grüße, naïve café! Ünïcödé ßtraße — 中文字符 和 日本語 かな, emoji 🙂🚀 and plain ASCII words."


@pytest.fixture(scope="module")
def every_byte_tokenizer():
    """Trained on mixed text with all 256 bytes in its alphabet: random token sequences then decode to
    incomplete characters too."""
    corpus = [llm.make_text(seed, 60) + " " + _MIXED for seed in range(40)]
    return llm.train_tokenizer(corpus, 600, every_byte=True)


@pytest.fixture(scope="module")
def demo_tokenizer():
    return llm.demo_tokenizer()


def run(detokenizer, tokenizer, prompt_ids, ids):
    d = detokenizer(tokenizer, prompt_ids)
    pieces = [d.add(t) for t in ids]
    return pieces, d.flush()


def check_detokenizers(tokenizer, prompt, ids):
    prompt_ids = tokenizer.encode(prompt).ids
    whole, whole_tail = run(llm.WholeSequenceDetokenizer, tokenizer, prompt_ids, ids)
    incremental, incremental_tail = run(llm.IncrementalDetokenizer, tokenizer, prompt_ids, ids)
    expected = tokenizer.decode(ids)
    assert "".join(incremental) + incremental_tail == expected  # the same text as decoding it all at the end
    assert "".join(whole) + whole_tail == expected
    assert (incremental, incremental_tail) == (whole, whole_tail)  # and sent in the same pieces, token by token


@given(data=st.data())
def test_incremental_detokenizing_gives_the_whole_sequences_text_with_incomplete_characters(every_byte_tokenizer, data):
    vocab = every_byte_tokenizer.get_vocab_size()
    ids = data.draw(st.lists(st.integers(1, vocab - 1), max_size=60))  # 0 is the special token
    prompt = data.draw(st.sampled_from(["", "Hello", _MIXED, llm.make_text(3, 20)]))
    check_detokenizers(every_byte_tokenizer, prompt, ids)


def test_incremental_detokenizing_on_the_demos_tokenizer(demo_tokenizer):
    rng = random.Random(5)
    vocab = demo_tokenizer.get_vocab_size()
    for n in (0, 1, 2, 7, 50, 300):
        check_detokenizers(demo_tokenizer, llm.make_text(2, 40), [rng.randrange(1, vocab) for _ in range(n)])


def test_a_character_split_between_tokens_is_sent_once_complete(every_byte_tokenizer):
    from tokenizers.pre_tokenizers import ByteLevel

    ((as_bytes, _),) = ByteLevel(add_prefix_space=False).pre_tokenize_str("🙂")  # one token a byte
    ids = [every_byte_tokenizer.token_to_id(t) for t in ["a", *as_bytes, "b"]]
    assert len(ids) == 6 and None not in ids
    for detokenizer in (llm.IncrementalDetokenizer, llm.WholeSequenceDetokenizer):
        d = detokenizer(every_byte_tokenizer, every_byte_tokenizer.encode("Hi ").ids)
        assert [d.add(t) for t in ids] == ["a", "", "", "", "🙂", "b"]


def test_the_baselines_detokenize_grows_with_the_sequence_and_the_fixes_does_not(demo_tokenizer):
    """The cost the demo shows is real: decoding the whole sequence at every token costs more the longer it
    is; decoding a window does not."""
    rng = random.Random(1)
    ids = [rng.randrange(1, demo_tokenizer.get_vocab_size()) for _ in range(20)]

    def cost(detokenizer, prompt_words):
        prompt_ids = demo_tokenizer.encode(llm.make_text(1, prompt_words)).ids
        best = math.inf
        for _ in range(5):
            d = detokenizer(demo_tokenizer, prompt_ids)
            t0 = time.perf_counter()
            for t in ids:
                d.add(t)
            best = min(best, time.perf_counter() - t0)
        return best

    assert cost(llm.WholeSequenceDetokenizer, 4000) > 10 * cost(llm.WholeSequenceDetokenizer, 100)
    assert cost(llm.WholeSequenceDetokenizer, 4000) > 10 * cost(llm.IncrementalDetokenizer, 4000)


# --- the model ---------------------------------------------------------------------------------------------------


def test_batched_sliding_window_decode_equals_a_naive_forward():
    """Prefill after a shared prefix, then batched steps of sequences at different positions and slots,
    give each sequence the logits a naive full forward (every position, the window mask) gives."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from stagetrace.demo.tinygpt import TinyGPT

    torch.manual_seed(1)
    m = TinyGPT(512, dim=64, heads=4, context=512, window=48).eval()

    def reference(ids):
        n = len(ids)
        x = m.tok.weight[torch.tensor(ids)] + m.pos.weight[:n]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (j <= i) & (j > i - m.window)
        for b in m.blocks:
            h = F.layer_norm(x, (m.dim,), b.ln1.weight, b.ln1.bias)
            q, k, v = F.linear(h, b.qkv.weight, b.qkv.bias).split((m.dim, m.head_dim, m.head_dim), 1)
            scores = torch.einsum("thd,jd->thj", q.view(n, m.heads, m.head_dim), k) / math.sqrt(m.head_dim)
            scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
            x = b._rest(x, torch.einsum("thj,jd->thd", scores.softmax(-1), v).reshape(n, m.dim))
        return m._logits(x)

    ids = torch.randint(0, 512, (3, 260)).tolist()
    seqs = [ids[0][:100] + ids[i][100:] for i in range(3)]  # a shared prefix of 100 tokens
    with torch.inference_mode():
        refs = [reference(s) for s in seqs]
        prefix = m.new_cache(1, 100)
        m.prefill(seqs[0][:100], prefix, 0)
        cache = m.new_cache(6, 300)
        slots, starts = [5, 1, 2], [110, 140, 170]  # each its own slot and prompt length
        worst = 0.0
        for i, (slot, start) in enumerate(zip(slots, starts)):
            logits = m.prefill(seqs[i][100:start], cache, slot, prefix)
            worst = max(worst, (logits[0] - refs[i][start - 1]).abs().max().item())
        for step in range(80):
            logits = m.decode([seqs[i][starts[i] + step] for i in range(3)], slots, cache)
            for i in range(3):
                worst = max(worst, (logits[i] - refs[i][starts[i] + step]).abs().max().item())
    assert worst < 1e-4


# --- the load generator's reading of a stream --------------------------------------------------------------------


def chunked(events: list[bytes], content_type: str = "text/event-stream") -> bytes:
    head = f"HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n".encode()
    body = b"".join(f"{len(e):x}\r\n".encode() + e + b"\r\n" for e in events)
    return head + body + b"0\r\n\r\n"


def test_a_chunked_stream_is_read_to_its_end_however_it_arrives():
    events = [f'data: {{"token": {i}, "text": "w{i} "}}\n\n'.encode() for i in range(12)]
    raw = chunked(events)
    rng = random.Random(0)
    for split in [1, 2, 3, 7, len(raw)] + [rng.randrange(1, 40) for _ in range(30)]:
        r = _Response()
        done, first_at = False, None
        for at, start in enumerate(range(0, len(raw), split), 1):
            assert not done, "read past the end"
            done = r.feed(raw[start : start + split], at)
            if r.events and first_at is None:
                first_at = at
        assert done and r.status == 200 and r.events == 12
        assert r.first_event_ns == first_at  # when the first event was complete
    # An event split across two chunks counts once, when complete; a body that is no event stream counts none.
    r = _Response()
    assert r.feed(chunked([b"data: a\n", b"\ndata: b\n\n"]), 1) and r.events == 2
    r = _Response()
    assert r.feed(chunked([b"{}\n\n"], "application/json"), 1) and r.events == 0 and r.first_event_ns is None
    r = _Response()
    assert r.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", 1) and r.events == 0


# --- the service, served for real --------------------------------------------------------------------------------

TOKENS = 64
STREAMS = 8


def read_stream(base: str, path: str, body: bytes) -> list[dict]:
    import httpx

    with httpx.stream("POST", base + path, content=body, headers={"content-type": "application/json"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    return [json.loads(line[len("data: ") :]) for line in text.split("\n\n") if line]


@pytest.mark.slow
def test_the_llm_service_streams_are_traced_and_the_fix_moves_the_gap_bottleneck(make_harness):
    """Real server (uvicorn, 127.0.0.1), real clients in another process (the demo's load generator), a
    long system prompt (so that the baseline's whole-sequence detokenize clearly outweighs the model's
    step): every stream's root says what its client lived, its thousand batch memberships fold, and the
    baseline's gap bottleneck is detokenize where the fixed one's is the model's step."""
    import httpx
    import torch
    from fastapi import FastAPI

    import stagetrace
    from servers import serve
    from stagetrace import conventions as c
    from stagetrace.demo import runner

    threads = torch.get_num_threads()
    h = make_harness()
    app = FastAPI()
    llm.add_routes(app, "cpu", slots=STREAMS, system_prompt=llm.make_system_prompt(5000))  # ~6,300 tokens
    stagetrace.instrument_fastapi(app)
    payload = llm.make_payload(max_tokens=TOKENS)
    try:
        with serve(app) as base:
            bad = httpx.post(base + "/generate", content=b'{"prompt": 3}', headers={"content-type": "application/json"})
            assert bad.status_code == 400
            texts = {path: read_stream(base, path, payload) for path in ("/generate", "/generate-optimized")}
            lived = {
                path: runner._drive(
                    base, path, STREAMS, STREAMS, payload, runner._Progress(STREAMS, "", False), "application/json"
                )
                for path in ("/generate", "/generate-optimized")
            }
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(streamed(h.verdicts)) < 2 * (STREAMS + 1):
                h.handle.force_flush(1)
                time.sleep(0.05)
    finally:
        torch.set_num_threads(threads)

    # The same text before and after the fix, a token an event.
    baseline, optimized = texts["/generate"], texts["/generate-optimized"]
    assert len(baseline) == TOKENS and [e["token"] for e in baseline] == [e["token"] for e in optimized]
    assert "".join(e["text"] for e in baseline) == "".join(e["text"] for e in optimized) != ""
    for path, got in lived.items():
        assert len(got.total) == STREAMS and len(got.first_event) == STREAMS, path
        assert all(0 < first < total for first, total in zip(got.first_event, got.total))

    verdicts = {path: [v for v in streamed(h.verdicts) if v.route == path] for path in lived}
    assert {path: len(vs) for path, vs in verdicts.items()} == {path: STREAMS + 1 for path in lived}
    spans = h.spans()
    by_trace: dict[int, list] = {}
    for s in spans:
        by_trace.setdefault(s.context.trace_id, []).append(s)
    roots = [s for s in spans if s.name in ("POST /generate", "POST /generate-optimized")]
    assert len(roots) == 2 * (STREAMS + 1) + 1  # and the 400
    for root in (r for r in roots if r.attributes.get(c.STREAM_CHUNKS) is not None):
        a = root.attributes
        assert a[c.STREAM_CHUNKS] == TOKENS and a[c.STREAM_FIRST_CHUNK_MS] > 0
        assert a[c.GEN_AI_REQUEST_MODEL] == llm.MODEL_NAME and a[c.GEN_AI_PROVIDER] == llm.PROVIDER
        assert a[c.GEN_AI_OPERATION] == "text_completion" and a[c.GEN_AI_OUTPUT_TOKENS] == TOKENS
        assert a[c.GEN_AI_LATENCY_TTFT] == pytest.approx(a[c.STREAM_FIRST_CHUNK_MS] / 1e3, abs=1e-5)
        assert a[c.GEN_AI_LATENCY_DECODE] > 0
        trace = by_trace[root.context.trace_id]
        assert len(trace) < 40  # not a span a token: 64 decode steps and 64 detokenizes, folded
        for name, occurrences in (("decode_step", TOKENS - 1), ("detokenize", TOKENS)):  # the first: prefill's
            stage = [s for s in trace if s.name == name]
            (composite,) = [s for s in stage if c.COMPRESSED_COUNT in s.attributes]
            kept = [s for s in stage if s is not composite and not s.attributes.get(c.COMPRESSED_SLOWEST)]
            assert composite.attributes[c.COMPRESSED_COUNT] + len(kept) == occurrences, name
            assert len(stage) <= len(kept) + 2, name
    assert sum(r.attributes.get(c.STREAM_CHUNKS) is not None for r in roots) == 2 * (STREAMS + 1)

    def gap_bottlenecks(path):
        return [v.stream.gap_bottleneck for v in verdicts[path] if v.stream is not None]

    # The streams that ran together (the first ran alone, its detokenize a batch of one) ...
    assert gap_bottlenecks("/generate").count("detokenize") >= STREAMS, gap_bottlenecks("/generate")
    assert sum("STREAM_CPU_BOUND" in v.diagnosis_codes for v in verdicts["/generate"]) >= STREAMS
    # ... and none once the detokenizer is incremental.
    assert "detokenize" not in gap_bottlenecks("/generate-optimized")
    assert not any("STREAM_CPU_BOUND" in v.diagnosis_codes for v in verdicts["/generate-optimized"])


def streamed(verdicts):
    return [v for v in verdicts if v.stream is not None]


@pytest.mark.slow
def test_a_client_that_leaves_mid_stream_frees_its_slot_and_leaks_no_trace(make_harness):
    """The client reads three events and closes: its root says so, the engine drops the stream at its next
    round (the request's trace is already closed by then), and serves the next request."""
    import socket

    import torch
    from fastapi import FastAPI

    import stagetrace
    from servers import serve
    from stagetrace import _state
    from stagetrace import conventions as c

    threads = torch.get_num_threads()
    h = make_harness()
    app = FastAPI()
    engine = llm.add_routes(app, "cpu", slots=2, system_prompt=llm.make_system_prompt(300))
    stagetrace.instrument_fastapi(app)
    try:
        with serve(app) as base:
            port = int(base.rsplit(":", 1)[1])
            body = llm.make_payload(max_tokens=1000)
            with socket.create_connection(("127.0.0.1", port)) as sock:
                head = f"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n\r\n"
                sock.sendall(head.encode() + body)
                got = b""
                while got.count(b"data:") < 3:
                    got += sock.recv(4096)
            deadline = time.monotonic() + 30
            while (engine.active or len(h.verdicts) < 1) and time.monotonic() < deadline:
                h.handle.force_flush(1)
                time.sleep(0.05)
            assert not engine.active and sorted(engine.free) == [0, 1]  # dropped, its slot free again
            events = read_stream(base, "/generate-optimized", llm.make_payload(max_tokens=10))
            assert len(events) == 10
            h.wait_verdicts(2, timeout=30)
    finally:
        torch.set_num_threads(threads)
    (left,) = [r for r in h.roots() if r.name == "POST /generate"]
    assert left.attributes[c.ERROR_TYPE] == c.CLIENT_DISCONNECTED
    assert 3 <= left.attributes[c.STREAM_CHUNKS] < 1000
    assert len(_state.runtime.registry) == 0  # no trace left in flight
