"""``echo``: returns its input unchanged. The cheapest model, for testing the plumbing."""

from __future__ import annotations

from consumers.handlers.base import ModelHandler
from schemas.models import ECHO, EchoInput, EchoOutput


class EchoHandler(ModelHandler[EchoInput, EchoOutput]):
    """Returns each input object as its output."""

    spec = ECHO

    def predict(self, batch: list[EchoInput]) -> list[EchoOutput | Exception]:
        return [EchoOutput(root=item.root) for item in batch]

    def sample_input(self) -> EchoInput:
        return EchoInput(root={"warmup": True})
