"""FleetNatsClient's header parser gives exactly what nats-py's own parser gives (no server needed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from fleet.brokers.nats_client import FleetNatsClient

BLOCKS = [
    b"",
    b"\r\n",
    b"Nats-Msg-Id: 0f3c\r\nFleet-Job-Id: 0f3c\r\nFleet-Model: embed\r\n\r\n",
    b"A:1\r\nB:\t2 \r\nC:  spaced value  \r\n\r\n",
    b"Empty:\r\nNoColonLine\r\n:no-name\r\n\r\n",
    b"Has Space: dropped\r\nTab\tName: dropped\r\nSep\x1cName: dropped\r\nok: kept\r\n",
    b"Caf\xc3\xa9: non-ascii name is skipped\r\nValue: caf\xc3\xa9 \xff broken utf-8\r\n",
    b"Repeat: first\r\nRepeat: second\r\n",
    b"Colon: a:b:c\r\n  Leading: spaces around the name  \r\n",
]


@pytest.mark.parametrize("block", BLOCKS)
def test_the_fast_header_parser_matches_the_library(block: bytes) -> None:
    assert FleetNatsClient._parse_header_lines(block) == Client._parse_header_lines(block)


def test_every_whitespace_character_in_a_name_drops_it_as_the_library_does() -> None:
    for code in range(128):
        block = b"A" + bytes([code]) + b"B: v\r\nok: 1\r\n"
        assert FleetNatsClient._parse_header_lines(block) == Client._parse_header_lines(block), hex(code)


def test_a_fleet_request_header_block_is_parsed() -> None:
    block = b"Nats-Msg-Id: j1\r\nFleet-Job-Id: j1\r\nFleet-Model: embed\r\n\r\n"
    assert FleetNatsClient._parse_header_lines(block) == {
        "Nats-Msg-Id": "j1",
        "Fleet-Job-Id": "j1",
        "Fleet-Model": "embed",
    }


_PIECES = [b"\r\n", b":", b" ", b"\t", b"\x1c", b"\x0b", b"\r", b"\n", b"Nats-Msg-Id", b"a", b"Z9"]
_PIECES += [b"\xc3\xa9", b"\xff"]  # UTF-8 and not


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=40).map(b"".join))
def test_generated_header_blocks_parse_as_the_library_parses_them(block: bytes) -> None:
    # ASCII blocks take the decode-once path, the others the line-by-line one: both must agree with nats-py on
    # separators, stray CR or LF, whitespace inside or around names and values (\x1c included), and bad UTF-8.
    assert FleetNatsClient._parse_header_lines(block) == Client._parse_header_lines(block)
