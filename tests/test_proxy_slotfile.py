"""The slot-file format (sippcache/proxy/slotfile.py) and the model-file facts (sippcache/modelfile.py):
round trips, bad input, and a real slot file written by llama-server."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from sippcache.proxy import slotfile
from sippcache.state.modelfile import read_metadata, read_model_facts


def test_build_then_parse_round_trips() -> None:
    state = bytes(range(256)) * 3
    data = b"".join(slotfile.build(4, [1, 2, 300000, -1], state))
    parsed = slotfile.parse(data)
    assert parsed.version == 4
    assert parsed.tokens == (1, 2, 300000, -1)
    assert bytes(parsed.state) == state


def test_read_tokens_reads_the_header_alone(tmp_path: Path) -> None:
    path = tmp_path / "a.slot"
    path.write_bytes(b"".join(slotfile.build(4, list(range(1000)), b"x" * 10)))
    assert slotfile.read_tokens(str(path)) == tuple(range(1000))


@pytest.mark.parametrize("n_tokens", [0, 1, 5])
def test_sequence_state_form_round_trips_in_place(n_tokens: int) -> None:
    """The sequence header goes over the slot header's last 8 bytes: even a file of no tokens has 12."""
    data = bytearray(b"".join(slotfile.build(4, list(range(n_tokens)), b"payload")))
    parsed = slotfile.parse(data)
    seq = slotfile.seq_state_in_place(memoryview(data), parsed, seq_id=3)
    assert struct.unpack_from("<Ii", seq) == (slotfile.SEQ_STATE_MAGIC, 3)
    assert bytes(slotfile.state_of(seq)) == b"payload" and len(seq) == 8 + len(b"payload")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "too short"),
        (b"ggsq" + b"\0" * 8, "magic"),
        (struct.pack("<III", slotfile.SLOT_FILE_MAGIC, 4, 10) + b"\0" * 8, "10 tokens"),
    ],
)
def test_bad_slot_files_are_refused_with_a_reason(data: bytes, message: str) -> None:
    with pytest.raises(slotfile.SlotFileError, match=message):
        slotfile.parse(data)


def test_a_state_without_its_header_is_refused() -> None:
    with pytest.raises(slotfile.SlotFileError):
        slotfile.state_of(b"\0" * 16)


def test_model_facts_of_the_tiny_and_gemma_models(tiny_model: Path, gemma_model: Path) -> None:
    tiny = read_model_facts(tiny_model)
    assert (tiny.architecture, tiny.kind, tiny.n_swa) == ("llama", "full", 0)
    gemma = read_model_facts(gemma_model)
    assert gemma.architecture == "gemma3"
    assert gemma.kind == "swa" and gemma.n_swa == 512
    assert read_metadata(gemma_model)["general.architecture"] == "gemma3"
    assert tiny.digest != gemma.digest


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a model at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_model_facts(path)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 5))
    with pytest.raises(ValueError, match="truncated"):
        read_model_facts(path)


@pytest.mark.parametrize(
    ("kind", "expected"), [("attention", "full"), ("swa", "swa"), ("recurrent", "recurrent"), ("hybrid", "recurrent")]
)
def test_model_facts_tell_every_memory_kind_apart(tmp_path: Path, kind: str, expected: str) -> None:
    from harness.tinymodel import N_SWA, write_tiny_model

    facts = read_model_facts(write_tiny_model(tmp_path / f"{kind}.gguf", kind=kind))
    assert facts.kind == expected
    assert facts.n_swa == (N_SWA if kind == "swa" else 0)
