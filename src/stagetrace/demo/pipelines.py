"""The demo's inference service: the classic pipeline, written the way it usually is first, and fixed.

image: JPEG bytes -> PIL decode -> resize -> tensor -> h2d -> small CNN -> d2h -> postprocess to JSON
text:  text -> slow regex tokenizer -> tensor -> h2d -> embedding classifier -> d2h -> JSON (the tokenizer on
       threads, sharing a GIL; fixed: the same tokenizer in a process pool, a GIL a worker)
llm:   prompt -> BPE tokenize -> prefill -> per token: decode_step, detokenize, one SSE event, from an engine that
       batches every stream in flight (``demo.llm``)

The naive endpoints are ``async def`` and do their CPU work (decode, resize, tokenize) on the event loop and
copy from pageable memory. The optimized ones decode at reduced size (JPEG DCT scaling) on a pool of
cores - 1 threads (PIL releases the GIL), so the next request's decode overlaps this one's inference, run
the model on one dedicated thread (as a GPU stream serialises kernels; several threads each using torch's
intra-op threads would oversubscribe the CPU), keep the loop free, and copy from a pinned staging buffer
when there is a GPU. The optimized image pipeline also batches: requests meet in a dynamic batcher (max 8,
1 ms max wait, ``demo.batcher``) whose one execution copies, infers and copies back for all of them.
Model weights are initialised locally from a fixed seed: nothing is downloaded.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request  # module level: FastAPI resolves the string annotations here

import stagetrace
from stagetrace.demo.batcher import DynamicBatcher

IMAGE_SIZE = (1280, 960)
INPUT_SIZE = 224
BATCH_MAX_SIZE = 8
LABELS = [f"class_{i}" for i in range(10)]


def make_jpeg(seed: int = 0, size: tuple[int, int] = IMAGE_SIZE) -> bytes:
    """A photo-like test image (gradients and noise, so JPEG has something to do)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    x = np.linspace(0, 1, w)[None, :, None]
    y = np.linspace(0, 1, h)[:, None, None]
    base = np.concatenate([x * 255 * np.ones((h, 1, 1)), y * 255 * np.ones((1, w, 1)), (x * y) * 255], axis=2)
    img = np.clip(base + rng.normal(0, 25, (h, w, 3)), 0, 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def make_text(seed: int = 0, words: int = 2500) -> str:
    import random

    rng = random.Random(seed)
    vocab = [
        "model",
        "latency",
        "GPU",
        "tokenizer",
        "request",
        "batch",
        "p99",
        "queue",
        "tensor",
        "pinned",
        "memory",
        "decode",
        "resize",
        "CUDA",
        "stream",
        "kernel",
        "don't",
        "it's",
        "3.14",
        "e-mail",
    ]
    return " ".join(rng.choice(vocab) + rng.choice(["", ",", ".", "!", ""]) for _ in range(words))


def build_models(device: Any) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    cnn = (
        torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(32, 32, 3, stride=2, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(32, len(LABELS)),
        )
        .to(device)
        .eval()
    )

    class TextClassifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.EmbeddingBag(30_000, 64)
            self.head = torch.nn.Linear(64, len(LABELS))

        def forward(self, ids: Any) -> Any:
            return self.head(self.embed(ids.view(1, -1)))

    return cnn, TextClassifier().to(device).eval()


# A tokenizer written the slow way: one regex pass per token class, then a normalising regex per token.
_SLOW_PATTERNS = [re.compile(p) for p in (r"(?:\w+(?:'\w+)*)", r"\d+(?:\.\d+)?", r"[^\w\s]", r"\s+")]


def slow_tokenize(text: str) -> list[int]:
    tokens: list[str] = []
    pos = 0
    while pos < len(text):
        for pat in _SLOW_PATTERNS:
            m = pat.match(text, pos)
            if m:
                tok = m.group(0)
                if not tok.isspace():
                    tokens.append(re.sub(r"[^a-z0-9']", "", tok.lower()) or tok)
                pos = m.end()
                break
        else:
            pos += 1
    return [hash(t) % 30_000 for t in tokens]


TOKENIZER_THREADS = 4  # the naive text pipeline's tokenizer pool: threads of one process, one GIL


@stagetrace.stage("tokenize")
def tokenize_in_worker(text: str) -> list[int]:
    """The slow tokenizer as a process pool's worker runs it (module level: the pool pickles it by name)."""
    return slow_tokenize(text)


def _warm_process_pool(size: int | None = None) -> ProcessPoolExecutor:
    """``size`` workers (None: a worker a CPU), each started and warm before the first request (a call's first
    task would otherwise pay its worker's start: WORKER_COLD_START)."""
    if size is None:
        size = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    pool = ProcessPoolExecutor(max_workers=size)
    for done in [pool.submit(time.sleep, 0.2) for _ in range(size)]:  # each holds a worker: all of them start
        done.result()
    return pool


def _postprocess(logits: Any) -> dict[str, Any]:
    import torch

    probs = torch.softmax(logits[0], dim=0)
    top = torch.topk(probs, 3)
    return {"top": [{"label": LABELS[i], "p": round(float(p), 4)} for p, i in zip(top.values, top.indices)]}


def build_app(device: Any, pipeline: str = "image", *, pool_workers: int | None = None) -> Any:
    """The service; the LLM pipeline's routes (its tokenizer trained, its model made) only when asked.
    ``pool_workers``: the text pipeline's tokenizer pool (None: a worker a CPU; fewer than the requests in
    flight queue for a worker, and ``POOL_SATURATED`` says so)."""
    import numpy as np
    import torch
    from PIL import Image

    cnn, text_model = build_models(device)
    on_gpu = getattr(device, "type", str(device)) == "cuda"
    workers = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="preprocess")
    model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference")
    tokenizer_threads = ThreadPoolExecutor(max_workers=TOKENIZER_THREADS, thread_name_prefix="tokenize")
    tokenizer_processes = _warm_process_pool(pool_workers) if pipeline == "text" else None
    staging = torch.empty((BATCH_MAX_SIZE, 3, INPUT_SIZE, INPUT_SIZE)).pin_memory() if on_gpu else None
    app = FastAPI(title="stagetrace demo")

    def to_tensor(img: Any) -> Any:
        arr = np.asarray(img, dtype=np.float32) / 255.0
        return torch.from_numpy(arr).permute(2, 0, 1).unsqueeze(0).contiguous()

    def infer(model: Any, x: Any) -> dict[str, Any]:
        xd = stagetrace.h2d(x, device)
        with torch.no_grad(), stagetrace.gpu_stage("infer"):
            logits = model(xd)
        out = stagetrace.d2h(logits)
        with stagetrace.stage("postprocess"):
            return _postprocess(out)

    @app.post("/predict")
    async def predict(request: Request) -> dict[str, Any]:
        raw = await request.body()
        with stagetrace.stage("decode"):  # on the event loop: every other request waits
            img = Image.open(io.BytesIO(raw)).convert("RGB")
        with stagetrace.stage("resize"):
            img = img.resize((INPUT_SIZE, INPUT_SIZE), Image.Resampling.BILINEAR)
        with stagetrace.stage("to_tensor"):
            x = to_tensor(img)  # pageable memory
        return infer(cnn, x)

    @stagetrace.stage("preprocess")
    def preprocess(raw: bytes) -> Any:
        jpeg = Image.open(io.BytesIO(raw))
        jpeg.draft("RGB", (INPUT_SIZE, INPUT_SIZE))  # JPEG DCT scaling: decode at reduced size
        with stagetrace.stage("decode"):
            img = jpeg.convert("RGB")
        with stagetrace.stage("resize"):
            img = img.resize((INPUT_SIZE, INPUT_SIZE), Image.Resampling.BILINEAR)
        with stagetrace.stage("to_tensor"):
            return to_tensor(img)

    def infer_batch(xs: list[Any]) -> list[Any]:
        """One execution for the whole batch: stack, copy (from the pinned staging buffer on a GPU), infer,
        copy back, and one row of logits per request."""
        x = torch.cat(xs)
        if staging is not None:
            x = staging[: len(xs)].copy_(x)  # pinned: the copy to the GPU can be truly asynchronous
        xd = stagetrace.h2d(x, device)
        with torch.no_grad(), stagetrace.gpu_stage("infer"):
            logits = cnn(xd)
        return list(stagetrace.d2h(logits).split(1))

    batcher = DynamicBatcher(infer_batch, name="infer.batch", max_size=BATCH_MAX_SIZE, max_wait_s=0.001)

    @app.post("/predict-optimized")
    async def predict_optimized(request: Request) -> dict[str, Any]:
        raw = await request.body()
        loop = asyncio.get_running_loop()
        x = await loop.run_in_executor(workers, preprocess, raw)
        logits = await batcher.submit(x)
        with stagetrace.stage("postprocess"):
            return _postprocess(logits)

    @app.post("/classify")
    async def classify(request: Request) -> dict[str, Any]:
        text = (await request.body()).decode()

        @stagetrace.stage("tokenize")  # pure Python on a pool of threads: they take turns holding the GIL
        def tokenize() -> Any:
            return torch.tensor(slow_tokenize(text), dtype=torch.long)

        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(tokenizer_threads, tokenize)
        return await loop.run_in_executor(model_thread, infer, text_model, ids)

    @app.post("/classify-optimized")
    async def classify_optimized(request: Request) -> dict[str, Any]:
        text = (await request.body()).decode()
        loop = asyncio.get_running_loop()
        # The same tokenizer in a process pool: its own GIL a worker (an offload stage with queue, send, run
        # and return; its own `tokenize` stage under the run). Only the token ids come back.
        tokens = await loop.run_in_executor(tokenizer_processes, tokenize_in_worker, text)
        with stagetrace.stage("to_tensor"):
            ids = torch.tensor(tokens, dtype=torch.long)
        return await loop.run_in_executor(model_thread, infer, text_model, ids)

    if pipeline == "llm":
        from stagetrace.demo import llm

        llm.add_routes(app, device)
    return app


ROUTES = {
    ("image", False): "/predict",
    ("image", True): "/predict-optimized",
    ("text", False): "/classify",
    ("text", True): "/classify-optimized",
    ("llm", False): "/generate",
    ("llm", True): "/generate-optimized",
}
# Requests a run sends unless told: 10 to 20 seconds of each pipeline on a 2-core machine.
DEFAULT_REQUESTS = {"image": 200, "text": 200, "llm": 40}


def make_payload(pipeline: str) -> tuple[bytes, str]:
    """What each request of the pipeline sends, and its content type."""
    if pipeline == "image":
        return make_jpeg(), "application/octet-stream"
    if pipeline == "llm":
        from stagetrace.demo import llm

        return llm.make_payload(), "application/json"
    return make_text().encode(), "application/octet-stream"
