"""The model handler interface: what a user implements to serve a model with Fleet.

A handler is a class that declares a ``spec`` (name, input and output schemas, preferred batch limits) and turns a
micro-batch of validated inputs into one output per input::

    from fleet.schemas.models import ModelSpec
    from fleet.consumers.handlers.base import ModelHandler

    class Upper(ModelHandler[UpperIn, UpperOut]):
        spec = ModelSpec("upper", UpperIn, UpperOut, max_batch=16)

        def predict(self, batch: list[UpperIn]) -> list[UpperOut | Exception]:
            return [UpperOut(text=item.text.upper()) for item in batch]

and is served with ``fleet worker --models mypackage.handlers:Upper``.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from fleet.encoding import convert_output
from fleet.errors import ConfigError, InvalidInput, ModelError
from fleet.schemas.models import ModelSpec

log = logging.getLogger(__name__)

InT = TypeVar("InT", bound=BaseModel)
OutT = TypeVar("OutT", bound=BaseModel)


class ModelHandler(ABC, Generic[InT, OutT]):
    """Base class of every model a worker can serve.

    Class attributes:
        spec: the model's ``ModelSpec``; its ``input_model`` and ``output_model`` must be the ``InT`` and ``OutT``
            the class is parametrised with. ``spec.name`` becomes a subject token and a Redis key, so it is
            restricted to ``[a-z0-9][a-z0-9_-]{0,62}``.

    Life cycle, as the worker drives it:

    1. ``Handler(device=..., slowness=..., **options)``: cheap, no weights are loaded. Raises ``ConfigError`` for
       an option the handler does not know.
    2. ``load()`` once, in a worker thread (never on the event loop): read weights, move them to ``self.device``.
    3. ``warmup()`` once, in a worker thread: run a small representative batch so the first real batch is fast.
    4. ``run(batch)`` per micro-batch, in a worker thread (on the event loop for a spec with ``inline=True``, a
       handler that takes microseconds and never blocks); it calls ``predict`` and checks what came back.
    5. ``close()`` at shutdown: release the device memory.

    Threading: ``load``, ``warmup``, ``predict`` and ``close`` are synchronous and are called from one worker
    thread at a time, never on the event loop; they may block (device compute, ``time.sleep``) for as long as a
    batch takes. The one exception is replicas (``fleet worker --replicas N``): a handler whose class sets
    ``replica_safe = True`` has ``predict`` called from N threads at once, on one copy of its weights; each of
    those threads calls ``start_replica`` once before its first batch. A handler that keeps mutable state per call
    (a tokenizer's settings, a scratch buffer) makes it per thread there; the worker refuses replicas of a handler
    that does not declare itself safe.
    """

    spec: ClassVar[ModelSpec]
    replica_safe: ClassVar[bool] = False
    """``predict`` may run in several threads at once on this one instance (``fleet.consumers.replicas``)."""

    def __init__(self, *, device: str = "cpu", slowness: float = 1.0, **options: Any) -> None:
        """Args:
        device: the resolved torch device (``cpu``, ``cuda``, ``cuda:N``; see ``fleet.consumers.device``).
            Handlers that do not use torch ignore it.
        slowness: per-worker service-time factor (> 0); only synthetic models such as ``sleep`` use it.
        options: handler-specific settings. A subclass takes its own as keyword arguments and passes the rest
            up; whatever reaches this constructor is unknown and raises ``ConfigError``.
        """
        if options:
            raise ConfigError(
                f"model {self.spec.name!r} ({type(self).__qualname__}) does not take the option(s) "
                f"{', '.join(sorted(options))}"
            )
        if not slowness > 0:
            raise ConfigError(f"slowness must be > 0, got {slowness}")
        self.device = device
        self.slowness = float(slowness)

    @property
    def name(self) -> str:
        return self.spec.name

    def start_replica(self, threads: int) -> None:
        """Called once in each replica's thread, before its first batch, when a worker runs several replicas.

        Args:
            threads: the intra-op threads this replica may use (the worker's cores shared among its replicas);
                torch's thread count and CUDA's current stream are per thread, so a torch handler sets them here.
                The default does nothing.
        """

    def load(self) -> None:
        """Load weights onto ``self.device``. Called once before any ``predict``, off the event loop.

        Raises:
            ConfigError: weights or a required package are missing, or the device cannot be used.
        """

    @abstractmethod
    def predict(self, batch: list[InT]) -> list[OutT | Exception]:
        """Compute one output per input, in the order of ``batch``.

        Args:
            batch: 1 to ``spec.max_batch`` inputs, each already validated against ``spec.input_model``.

        Returns:
            A list as long as ``batch``: ``outputs[i]`` belongs to ``batch[i]``. An item that cannot be computed
            for a reason of its own (an input this model rejects) gets an ``Exception`` instance in its place,
            preferably ``fleet.errors.ModelError(message, retriable=False)``; that job alone ends ``failed`` with
            the exception's message, and the other items succeed. ``fleet.errors.InvalidInput(message)`` says the
            input itself is refused (a value the schema allows that this model does not serve): the job ends
            ``failed`` with error type ``invalid_input``, which ``POST /v1/infer`` answers 422 (the OpenAI routes
            400), and is not retried.

        Raises:
            Exception: anything raised fails the whole batch. The worker then splits the batch to isolate the
                item that causes it and retries the rest, so raising must not leave the handler broken.
        """

    def cost(self, item: InT) -> int:
        """The cost of one input, for models whose batches are bounded by cost (``spec.max_batch_cost``).

        Called on the event loop for every fetched message, before the batch forms, so it must be cheap (no
        model call, no tokenizer run that ``predict`` repeats). The default is 1: the budget counts items.
        ``embed`` estimates tokens.
        """
        return 1

    def sample_input(self) -> InT | None:
        """A representative input for ``warmup``; ``None`` (the default) skips the warm-up."""
        return None

    def warmup(self) -> None:
        """Run one small batch so that lazy initialisation (kernels, allocator, caches) happens before real work.

        The default runs ``[self.sample_input()]`` if there is a sample.

        Raises:
            ModelError: the sample did not produce an output.
        """
        sample = self.sample_input()
        if sample is None:
            return
        outputs = self.run([sample])
        if isinstance(outputs[0], Exception):
            raise ModelError(f"warm-up of model {self.name!r} failed: {outputs[0]}", retriable=False)
        log.debug("model %s warmed up", self.name)

    def close(self) -> None:
        """Release what ``load`` acquired. Called once at shutdown; the default does nothing."""

    def output_json(self, output: OutT, encoding: str = "float") -> Any:
        """One output as JSON-ready data in the request's ``encoding_format``; the worker calls it per job.

        The default dumps the output (``model_dump(mode="json")``) and, for ``"base64"``, encodes the fields named
        in ``spec.vector_fields`` (``fleet.encoding``). Override it where a faster path exists.

        Raises:
            Exception: the output does not serialise; that job ends ``failed`` (``invalid_output``).
        """
        data = output.model_dump(mode="json")
        if encoding != "float" and self.spec.vector_fields:
            data = convert_output(data, self.spec.vector_fields, encoding)
        return data

    @classmethod
    def parse_input(cls, raw: Any) -> InT:
        """Validate one raw input (a decoded JSON object) against ``spec.input_model``.

        Raises:
            InvalidInput: the input does not match the schema; ``errors`` holds pydantic's error list.
        """
        try:
            return cls.spec.input_model.model_validate(raw)  # type: ignore[return-value]
        except ValidationError as exc:
            errors = [dict(e) for e in exc.errors(include_url=False, include_context=False, include_input=False)]
            raise InvalidInput(f"input does not match model {cls.spec.name!r}: {_summary(exc)}", errors) from None

    def run(self, batch: Sequence[InT]) -> list[OutT | Exception]:
        """Call ``predict`` and check its answer; this is what the worker calls.

        Raises:
            ModelError: ``predict`` returned the wrong number of outputs or an object that is neither an instance
                of ``spec.output_model`` nor an ``Exception`` (a bug in the handler, so not retriable).
            Exception: whatever ``predict`` raised, unchanged.
        """
        items = list(batch)
        outputs = self.predict(items)
        if not isinstance(outputs, list) or len(outputs) != len(items):
            got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
            raise ModelError(
                f"model {self.name!r} returned {got} outputs for a batch of {len(items)}; predict must return "
                "a list with one output per input",
                retriable=False,
            )
        expected = self.spec.output_model
        for i, out in enumerate(outputs):
            if not isinstance(out, (expected, Exception)):
                raise ModelError(
                    f"model {self.name!r} returned {type(out).__name__} for item {i}; expected "
                    f"{expected.__name__} or an Exception",
                    retriable=False,
                )
        return outputs


def _summary(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:3]:
        where = ".".join(str(p) for p in err["loc"]) or "input"
        parts.append(f"{where}: {err['msg']}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
