"""TensorBoard event files of scalars, written without importing TensorBoard.

``torch.utils.tensorboard`` imports the ``tensorboard`` package and protobuf, which cost a
run about 5 MiB of resident memory for the few scalars it logs (benchmarks/results/memory.md).
A scalar event file is small to write by hand: a TFRecord stream (length, masked CRC-32C of
the length, the bytes, their masked CRC-32C) of ``Event`` protocol buffers, which TensorBoard
reads like any other (``tensorboard --logdir RUN``; tests read them back with TensorBoard's
own ``EventAccumulator``). The formats: TensorFlow's ``tensorflow/core/util/event.proto``,
``summary.proto`` and ``lib/io/record_writer.cc``.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time
from pathlib import Path

_CASTAGNOLI = 0x82F63B78  # CRC-32C's polynomial, reflected
# Numbers this process's event files: two writers in one second must not share a file.
_FILE_NUMBERS = itertools.count()


class Crc32c:
    """The CRC-32C (Castagnoli) checksum, by a table of every byte's remainder. The table is made with
    each writer, not at import: code run at import is out of the mutation check's reach
    (tests/MUTATION.md), and a run that logs no TensorBoard scalars never needs it."""

    def __init__(self) -> None:
        self.table = []
        for byte in range(256):
            crc = byte
            for _ in range(8):
                crc = (crc >> 1) ^ _CASTAGNOLI if crc & 1 else crc >> 1
            self.table.append(crc)

    def __call__(self, data: bytes) -> int:
        crc = 0xFFFFFFFF
        for byte in data:
            crc = self.table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
        return crc ^ 0xFFFFFFFF

    def masked(self, data: bytes) -> int:
        """TFRecord's checksum: the CRC rotated right by 15 bits plus a constant (mod 2**32)."""
        crc = self(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    def record(self, data: bytes) -> bytes:
        """One TFRecord: the length and its checksum, the data and its checksum."""
        length = struct.pack("<Q", len(data))
        return length + struct.pack("<I", self.masked(length)) + data + struct.pack("<I", self.masked(data))


_FLOAT32_MAX = 3.4028234663852886e38

# Protocol buffer wire format: a key is (field number << 3) | wire type.
_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 values take ten bytes, as two's complement
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, _BYTES) + _varint(len(payload)) + payload


def event(wall_time: float, step: int, what: bytes) -> bytes:
    """An ``Event``: wall_time (1, double), step (2, int64), then one field of its ``what``."""
    return _key(1, _FIXED64) + struct.pack("<d", wall_time) + _key(2, _VARINT) + _varint(step) + what


def file_version(version: str = "brain.Event:2") -> bytes:
    return _length_delimited(3, version.encode())


def scalars(values: dict[str, float]) -> bytes:
    """A ``Summary`` (Event field 5) of ``Value``s: tag (1, string), simple_value (2, float)."""
    summary = b"".join(
        _length_delimited(1, _length_delimited(1, tag.encode()) + _key(2, _FIXED32) + _float32(value))
        for tag, value in values.items()
    )
    return _length_delimited(5, summary)


def _float32(value: float) -> bytes:
    """As float32; beyond its range, infinity (struct refuses to round it there)."""
    if abs(value) > _FLOAT32_MAX:
        value = math.copysign(math.inf, value)
    return struct.pack("<f", value)


def session_start() -> bytes:
    """A ``SessionLog`` (Event field 7) with status START (1): TensorBoard then hides the events
    of earlier files whose step is at or after this event's step (a resumed run's restart)."""
    return _length_delimited(7, _key(1, _VARINT) + _varint(1))


class EventFileWriter:
    """Appends scalar events to a new ``events.out.tfevents.*`` file in ``log_dir``.

    ``restart_step`` (a resumed run's first step) makes TensorBoard drop what earlier files
    logged from that step on: the interrupted run's events after its checkpoint.
    """

    def __init__(self, log_dir: Path, restart_step: int | None = None) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        number = next(_FILE_NUMBERS)
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.{number}"
        self.path = log_dir / name
        self._crc = Crc32c()
        self._file = self.path.open("xb")
        self._write(event(now, 0, file_version()))
        if restart_step is not None:
            self._write(event(now, restart_step, session_start()))
        self._file.flush()

    def add_scalars(self, step: int, values: dict[str, float]) -> None:
        """One event holding every value of the step; on disk when this returns."""
        self._write(event(time.time(), step, scalars(values)))
        self._file.flush()

    def _write(self, data: bytes) -> None:
        self._file.write(self._crc.record(data))

    def close(self) -> None:
        self._file.close()
