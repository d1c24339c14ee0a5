"""The lab's ``prefill`` fault (``mlxwatch/_lab/fault_server.py``): its words, and which step of
the batch loop it picks for a hang. The timing itself is measured on the real server
(``bench/patience.py``); the real-server tests use it (``tests/test_patience_real.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mlxwatch._lab.fault_server import (
    PrefillFault,
    _long_prompt_read,
    _prompt_tokens_read,
    parse_prefill,
    read_fault,
    read_prefill,
)


@pytest.mark.parametrize("text, fault", [
    ("prefill 12", PrefillFault(12.0)),
    ("prefill 12.5 idle", PrefillFault(12.5, idle=True)),
    ("prefill 0", PrefillFault(0.0)),
    ("prefill 30 hang", PrefillFault(30.0, then="hang")),
    ("prefill 30 idle hang 3", PrefillFault(30.0, idle=True, then="hang", chunks=3)),
    ("prefill 12 livelock", PrefillFault(12.0, then="livelock")),
    ("  prefill   12\n idle\n", PrefillFault(12.0, idle=True)),
])
def test_prefill_words(text, fault):
    assert parse_prefill(text) == fault


@pytest.mark.parametrize("text, named", [
    ("prefill", "give the milliseconds"),
    ("prefill fast", "'fast'"),
    ("prefill -1", "'-1'"),
    ("prefill nan", "'nan'"),
    ("prefill 12 hang 0", "'0'"),
    ("prefill 12 hang x", "'x'"),
    ("prefill 12 slowly", "'slowly'"),
    ("prefill 12 livelock hang", "'hang'"),
    ("prefill 12 hang 2 idle", "'idle'"),  # idle comes first
    ("slow 2", "not a prefill fault"),
])
def test_a_bad_prefill_fault_names_the_word(text, named):
    with pytest.raises(ValueError, match=named):
        parse_prefill(text)


def test_the_control_file(tmp_path):
    """The generation thread reads the file each step: another fault, an empty or a missing
    file is no prefill fault; the first word and number read as every fault's do."""
    path = tmp_path / "fault"
    assert read_prefill(str(path)) is None
    path.write_text("")
    assert read_prefill(str(path)) is None
    path.write_text("spin")
    assert read_prefill(str(path)) is None
    path.write_text("prefill 12 idle hang 2")
    assert read_prefill(str(path)) == PrefillFault(12.0, idle=True, then="hang", chunks=2)
    assert read_fault(str(path)) == ("prefill", 12.0)


def generator(step: int, processing: list[tuple[int, int]], counters: str = "0.32", read: int = 0):
    """A stand-in with the attributes the fault reads of mlx-lm's ``BatchGenerator``:
    ``_currently_processing`` rows are ``[segments, tokens read, prompt's tokens]``."""
    gen = SimpleNamespace(prefill_step_size=step, _currently_processing=[[[], x, y] for x, y in processing])
    if counters == "0.32":
        gen._counters = SimpleNamespace(prompt_tokens=read)
    else:
        gen._prompt_tokens_counter = read
    return gen


@pytest.mark.parametrize("counters", ["0.32", "0.31.3"])
def test_the_tokens_a_step_read_come_from_the_generators_own_count(counters):
    assert _prompt_tokens_read(generator(512, [], counters, read=1234)) == 1234


@pytest.mark.parametrize("processing, chunks, hangs", [
    ([(0, 1600)], 1, False),  # not begun
    ([(512, 1600)], 1, True),  # a chunk read, more to read: X/Y with X < Y was logged
    ([(512, 1600)], 2, False),
    ([(1024, 1600)], 2, True),
    ([(1599, 1600)], 1, False),  # only the last token left: the prompt is read
    ([(99, 100)], 1, False),  # a short prompt (a probe's) is never where it hangs
    ([(99, 100), (600, 1600)], 1, True),  # ... but beside a long one that is
])
def test_a_hang_comes_in_the_middle_of_a_long_prompt(processing, chunks, hangs):
    assert _long_prompt_read(generator(512, processing), chunks) is hangs
