"""Automatic stages (opt-in): only installed libraries are patched, nesting collapses to the outermost
call, and uninstrument restores every original."""

from __future__ import annotations

import asyncio
import importlib.machinery
import io
import sys
import types

import httpx
import pytest
import torch
from fastapi import FastAPI
from PIL import Image

import stagetrace
from fakes import FakeCudaBackend, FakeGpu, FakeTensor, fake_model
from stagetrace import conventions as c
from stagetrace.gpu import attach_gpu
from stagetrace.integrations import auto_stages
from stagetrace.settings import KEEP_REPEATS


@pytest.fixture
def auto(harness):
    names = auto_stages.instrument()
    yield harness, names
    auto_stages.uninstrument()


def jpeg_bytes(size=(640, 480)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (120, 30, 200)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def test_pil_decode_and_resize_become_stages(auto):
    harness, _ = auto
    raw = jpeg_bytes()
    with stagetrace.pipeline("preprocess"):
        img = Image.open(io.BytesIO(raw)).convert("RGB")
        img.resize((224, 224))
    names = [s.name for s in harness.spans() if c.STAGE in s.attributes]
    assert names.count("decode") == 1 and names.count("resize") == 1


def test_the_outermost_module_forward_is_one_stage_of_its_devices_kind(auto):
    """A CPU model's forward is a cpu stage (the CPU rules judge it, the report does not colour it GPU);
    the submodules' calls are inside it."""
    harness, _ = auto
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with stagetrace.pipeline("infer"), torch.no_grad():
        model(torch.ones(1, 8))
    forwards = [s for s in harness.spans() if s.name == "forward"]
    assert len(forwards) == 1
    assert forwards[0].attributes[c.STAGE_KIND] == "cpu"
    assert c.GPU_DURATION_MS not in forwards[0].attributes


class _Meta(torch.nn.Module):
    """A module that holds no tensor on the CPU: its parameter lives on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(2, device="meta"))

    def forward(self, x):
        return x


class _Resize(torch.nn.Module):
    """As torchvision's transforms are: a module with no parameters, called on a PIL image."""

    def forward(self, image):
        return image.resize((8, 8))


def test_where_a_forward_runs_is_read_from_the_module_or_its_input():
    read = auto_stages.module_device_type
    assert read(torch.nn.Linear(2, 2), (), {}) == "cpu"
    assert read(_Meta(), (), {}) == "meta"  # not the CPU: a device's stage (CUDA events where CUDA)
    assert read(torch.nn.ReLU(), (torch.ones(2, device="meta"),), {}) == "meta"  # no parameters: its input's
    assert read(torch.nn.ReLU(), (), {"input": torch.ones(2)}) == "cpu"
    assert read(_Resize(), (Image.new("RGB", (4, 4)),), {}) is None


@pytest.fixture
def fake_cuda(make_harness):
    """Automatic stages over a harness whose GPU timing runs on a fake CUDA device (tests/fakes.py): CUDA
    events can be recorded whatever device is asked, so the test sees which device, if any, a stage asked."""
    harness = make_harness(gpu=False)
    gpu = FakeGpu(virtual_clock=True)
    support = attach_gpu(harness.handle.runtime, backend=FakeCudaBackend(gpu), nvml=None, nvml_enabled=False)
    auto_stages.instrument()
    yield harness, gpu, support
    auto_stages.uninstrument()


class _On(torch.nn.Module):
    """A module whose parameters live on ``device`` (any torch.device, built without that device present);
    its forward launches ``ms`` of kernels on the fake GPU's current stream, as a CUDA forward returns at once."""

    def __init__(self, gpu: FakeGpu, device: torch.device, ms: float = 30.0) -> None:
        super().__init__()
        self.gpu, self.where, self.ms = gpu, device, ms

    def parameters(self, recurse: bool = True):
        yield types.SimpleNamespace(device=self.where)

    def forward(self, x):
        return fake_model(x, ms=self.ms)


@pytest.mark.parametrize("device", ["mps", "xpu:0", "meta"])
def test_a_module_on_another_device_is_a_host_timed_gpu_kind_stage(fake_cuda, device):
    """Not the CPU's work, so a ``gpu`` stage; but no CUDA event can time it (it used to record them on the
    current CUDA device, another device's stream): its time is the host's."""
    harness, gpu, support = fake_cuda
    with stagetrace.pipeline("infer"):
        _On(gpu, torch.device(device))(FakeTensor(gpu, 4096))
        _Meta()(torch.ones(1))  # a real module on a non-CPU device
    forwards = [s for s in harness.spans() if s.name == "forward"]
    assert len(forwards) == 2
    assert all(f.attributes[c.STAGE_KIND] == "gpu" and c.GPU_DURATION_MS not in f.attributes for f in forwards)
    assert support.timer.devices_seen == set() and gpu.events_created == 0  # no CUDA event asked for


def test_a_cuda_modules_forward_is_timed_with_cuda_events_on_its_own_device(fake_cuda):
    """The events go on the module's device (here cuda:1), not the current default device (cuda:0)."""
    harness, gpu, support = fake_cuda
    with stagetrace.pipeline("infer"):
        _On(gpu, torch.device("cuda", 1), ms=30)(FakeTensor(gpu, 4096, "cuda:1"))
        gpu.current_stream().wait_host()  # as a copy of the result to the host would: the kernels have run
    (forward,) = harness.by_name("forward")
    assert forward.attributes[c.STAGE_KIND] == "gpu"
    assert 29 <= forward.attributes[c.GPU_DURATION_MS] <= 35
    assert support.timer.devices_seen == {1}


def cuda(test):
    """The ``cuda`` marker, and a visible skip without a device (``pytest -m cuda`` selects these)."""
    needs = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
    return pytest.mark.cuda(needs(test))


@cuda
def test_a_cuda_models_automatic_forward_has_its_cuda_event_gpu_time(auto):
    harness, _ = auto
    device = torch.device("cuda", torch.cuda.device_count() - 1)  # the last: another than the default where several
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048)).to(device)
    x = torch.randn(1024, 2048, device=device)
    torch.cuda.synchronize(device)
    with stagetrace.pipeline("infer"), torch.no_grad():
        for _ in range(KEEP_REPEATS):  # each a span of its own (past it, repeats fold into a composite)
            x = model(x)
    forwards = [s for s in harness.spans() if s.name == "forward"]
    assert len(forwards) == KEEP_REPEATS
    assert all(f.attributes[c.STAGE_KIND] == "gpu" and f.attributes[c.GPU_DURATION_MS] > 0 for f in forwards)
    assert harness.handle.runtime.gpu.timer.devices_seen == {device.index}


def test_transforms_inside_an_automatic_stage_are_not_forward_stages(harness, monkeypatch):
    """torchvision's ``Compose`` is the ``transforms`` stage; its ``Resize`` is an ``nn.Module``, which must
    not become a ``forward`` inside it (it was: ``transforms > forward > resize``); nor is a parameterless
    module given an image a forward on its own."""
    fake = types.ModuleType("torchvision")
    fake.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
    transforms = types.ModuleType("torchvision.transforms")

    class Compose:
        def __init__(self, steps):
            self.steps = steps

        def __call__(self, image):
            for step in self.steps:
                image = step(image)
            return image

    transforms.Compose = Compose
    fake.transforms = transforms
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    monkeypatch.setitem(sys.modules, "torchvision.transforms", transforms)
    auto_stages.instrument()
    try:
        with stagetrace.pipeline("preprocess"):
            Compose([_Resize()])(Image.new("RGB", (64, 64)))
            _Resize()(Image.new("RGB", (64, 64)))
        stages = [s for s in harness.spans() if c.STAGE in s.attributes]
        assert sorted(s.name for s in stages) == ["resize", "resize", "transforms"]
        (inner,) = [
            s
            for s in stages
            if s.name == "resize" and s.parent.span_id != harness.by_name("preprocess")[0].context.span_id
        ]
        assert inner.parent.span_id == next(s for s in stages if s.name == "transforms").context.span_id
    finally:
        auto_stages.uninstrument()


def test_dtype_casts_are_not_copies():
    assert auto_stages.copy_kind("cpu", torch.float16) is None
    assert auto_stages.copy_kind("cpu", "cpu") is None
    assert auto_stages.copy_kind("cpu", "cuda:0") == "h2d"
    assert auto_stages.copy_kind("cuda", torch.device("cpu")) == "d2h"
    assert auto_stages.copy_kind("cuda", "cuda:1") is None


def test_tensor_to_on_the_same_device_is_untouched(auto):
    harness, _ = auto
    with stagetrace.pipeline("p"):
        torch.ones(4).to(torch.float64).to("cpu")
    assert not [s for s in harness.spans() if s.name in ("h2d", "d2h")]


@pytest.mark.parametrize("telemetry", ["contrib", "native"])
def test_fastapi_response_serialisation_is_one_stage(auto, telemetry):
    harness, _ = auto
    app = FastAPI()

    @app.get("/items")
    async def items() -> list[dict]:
        return [{"id": i} for i in range(100)]

    stagetrace.instrument_fastapi(app, telemetry=telemetry)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            assert (await client.get("/items")).status_code == 200

    asyncio.run(go())
    # FastAPI's own telemetry times serialisation itself: then that span is the stage, not a second one
    name = "fastapi.serialization" if telemetry == "native" else "serialize"
    (serialize,) = [s for s in harness.spans() if s.name in ("serialize", "fastapi.serialization")]
    root = next(s for s in harness.spans() if s.parent is None)
    assert serialize.name == name and serialize.parent.span_id == root.context.span_id
    assert name in harness.verdicts[0].breakdown


def test_a_tokenizer_call_is_a_stage_when_transformers_is_installed(harness, monkeypatch):
    fake = types.ModuleType("transformers")
    fake.__spec__ = importlib.machinery.ModuleSpec("transformers", None)

    class PreTrainedTokenizerBase:
        def __call__(self, text):
            return {"input_ids": [ord(ch) for ch in text]}

    fake.PreTrainedTokenizerBase = PreTrainedTokenizerBase
    monkeypatch.setitem(sys.modules, "transformers", fake)
    original = PreTrainedTokenizerBase.__call__
    auto_stages.instrument()
    try:
        with stagetrace.pipeline("text"):
            assert PreTrainedTokenizerBase()("hi") == {"input_ids": [104, 105]}
        assert [s.name for s in harness.spans() if c.STAGE in s.attributes] == ["tokenize"]
    finally:
        auto_stages.uninstrument()
    assert PreTrainedTokenizerBase.__call__ is original


def test_uninstrument_restores_originals(harness):
    import fastapi.routing
    from PIL import ImageFile

    before = (ImageFile.ImageFile.load, torch.Tensor.to, torch.nn.Module.__call__, fastapi.routing.serialize_response)
    patched = auto_stages.instrument()
    assert "ImageFile.load" in patched and "Module.__call__" in patched
    auto_stages.uninstrument()
    after = (ImageFile.ImageFile.load, torch.Tensor.to, torch.nn.Module.__call__, fastapi.routing.serialize_response)
    assert after == before


# Every call shape of Tensor.to (and the one nn.Module.to uses): positional and keyword device, dtype,
# non_blocking, copy, memory_format, another tensor as the target.
TO_CALL_SHAPES = [
    (("cuda:0",), {}),
    (("cuda:0", torch.float16), {}),
    (("cuda:0", torch.float16, True), {}),
    (("cuda:0", torch.float16, True, True), {}),
    (("cuda:0",), {"non_blocking": True}),
    (("cuda:0",), {"dtype": torch.float64, "non_blocking": True, "copy": True}),
    (("cuda:0",), {"memory_format": torch.channels_last}),
    ((), {"device": "cuda:0", "dtype": torch.float16, "non_blocking": True}),
    ((torch.device("cuda", 0), torch.bfloat16, False), {}),  # what nn.Module.to passes: t.to(device, dtype, nb)
]


class _Source:
    """A host tensor as the patch sees it: on the CPU, with bytes and pinned-ness."""

    device = torch.device("cpu")

    def numel(self) -> int:
        return 256

    def element_size(self) -> int:
        return 4

    def is_pinned(self) -> bool:
        return True


@pytest.mark.parametrize(("args", "kwargs"), TO_CALL_SHAPES)
def test_a_patched_host_to_device_copy_passes_every_argument_through_unchanged(auto, args, kwargs):
    harness, _ = auto
    calls, result = [], object()

    def original(self, *a, **k):
        calls.append((self, a, k))
        return result

    patched = auto_stages._tensor_to(original)
    source = _Source()
    with stagetrace.pipeline("p"):
        out = patched(source, *args, **kwargs)
    assert out is result  # exactly what the original returned
    assert calls == [(source, args, kwargs)]  # called once, with the caller's arguments as given
    (h2d,) = harness.by_name("h2d")
    assert h2d.attributes[c.STAGE_KIND] == "h2d" and h2d.attributes[c.H2D_BYTES] == 1024


def test_module_to_with_a_dtype_keeps_it_under_automatic_stages(auto):
    model = torch.nn.Linear(4, 2)
    reference = torch.nn.Linear(4, 2).to("cpu", torch.float16)
    with stagetrace.pipeline("p"):
        model.to("cpu", torch.float16)
        x = torch.ones(3, 4).to(torch.float64)  # a cast, not a copy between host and device
    assert model.weight.dtype == reference.weight.dtype == torch.float16
    assert x.dtype == torch.float64
