"""The WorkerPool payload codec: pickle 5, out-of-band buffers inline or in shared memory."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
from workerpool_models import owner_of

from poolserve.service.workerpool.payload import PayloadError, SegmentDir, dumps, loads


@pytest.fixture
def segments(tmp_path: Path) -> SegmentDir:
    return SegmentDir.create(tmp_path, threshold=1024)


def test_small_buffers_travel_inline_and_arrive_writable() -> None:
    value = {"a": np.arange(10, dtype=np.int32), "b": [1, "two", 3.0]}
    encoded = dumps(value)
    assert encoded.segments == []
    back = loads(encoded.data)
    assert np.array_equal(back["a"], value["a"]) and back["b"] == value["b"]
    assert back["a"].flags.writeable and owner_of(back["a"]) == "bytearray"


def test_large_buffers_go_to_segments_and_map_copy_on_write(segments: SegmentDir) -> None:
    big = np.arange(4096, dtype=np.float64)
    small = np.ones(3)
    encoded = dumps((big, small, b"bytes stay in band"), segments, prefix="7-a")
    assert encoded.segments == ["7-a0"] and encoded.segment_bytes == big.nbytes
    assert big.tobytes() not in encoded.data, "the big array is not in the frame"
    got_big, got_small, raw = loads(encoded.data, segments)
    assert np.array_equal(got_big, big) and np.array_equal(got_small, small)
    assert raw == b"bytes stay in band"
    assert owner_of(got_big) == "mmap"
    got_big[0] = -1.0  # private mapping: the segment itself is not written
    assert np.array_equal(loads(encoded.data, segments, unlink=True)[0], big)
    assert os.listdir(segments.path) == []


def test_missing_or_short_segment_is_an_error_not_a_crash(segments: SegmentDir) -> None:
    encoded = dumps(np.zeros(1000), segments, prefix="1-r")
    (segments.path / "1-r0").write_bytes(b"short")
    with pytest.raises(PayloadError, match="holds 5 of 8000 bytes"):
        loads(encoded.data, segments)
    segments.unlink(["1-r0"])
    with pytest.raises(PayloadError, match="is gone"):
        loads(encoded.data, segments)
    with pytest.raises(PayloadError, match="shorter or longer"):
        loads(encoded.data[:-1], segments)


def test_no_room_in_shared_memory_falls_back_to_inline(
    segments: SegmentDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    encoded = dumps(np.ones(2048), segments, prefix="2-a")
    monkeypatch.undo()
    assert encoded.segments == [] and os.listdir(segments.path) == []
    assert np.array_equal(loads(encoded.data, segments), np.ones(2048))


def test_sweep_keeps_what_live_calls_still_read(segments: SegmentDir) -> None:
    for name in ("1-a0", "2-99-r0", "3-a0"):
        (segments.path / name).write_bytes(b"x")
    assert segments.sweep(lambda name: name.startswith("2-")) == 2
    assert os.listdir(segments.path) == ["2-99-r0"]
    segments.remove()
    assert not segments.path.exists()
