"""``echo``: returns its input unchanged. The cheapest model, for testing the plumbing."""

from __future__ import annotations

from typing import Any

from fleet.consumers.handlers.base import ModelHandler
from fleet.schemas.construct import built
from fleet.schemas.models import ECHO, EchoInput, EchoOutput


def _echo_output(root: dict[str, Any]) -> EchoOutput:
    """``EchoOutput(root=root)`` without validating ``root`` again: it is an ``EchoInput``'s, validated already."""
    return built(EchoOutput, {"root": root}, {"root"})


class EchoHandler(ModelHandler[EchoInput, EchoOutput]):
    """Returns each input object as its output."""

    spec = ECHO

    def predict(self, batch: list[EchoInput]) -> list[EchoOutput | Exception]:
        return [_echo_output(item.root) for item in batch]

    def output_json(self, output: EchoOutput, encoding: str = "float") -> Any:
        """The output's object as it is: echo's outputs are its inputs, decoded from JSON (no vectors to encode)."""
        return output.root

    def sample_input(self) -> EchoInput:
        return EchoInput(root={"warmup": True})
