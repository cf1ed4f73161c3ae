"""``echo``: returns its input unchanged. The cheapest model, for testing the plumbing."""

from __future__ import annotations

from typing import Any

from consumers.handlers.base import ModelHandler
from schemas.models import ECHO, EchoInput, EchoOutput

_set = object.__setattr__


def _echo_output(root: dict[str, Any]) -> EchoOutput:
    """``EchoOutput(root=root)`` without validating ``root`` again: it is an ``EchoInput``'s, validated already."""
    out: EchoOutput = EchoOutput.__new__(EchoOutput)
    _set(out, "__dict__", {"root": root})
    _set(out, "__pydantic_fields_set__", {"root"})
    _set(out, "__pydantic_extra__", None)
    _set(out, "__pydantic_private__", None)
    return out


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
