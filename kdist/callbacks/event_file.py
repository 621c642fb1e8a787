"""TensorBoard scalars written without TensorFlow: the event file, encoded here.

TensorBoard reads ``events.out.tfevents.*`` files: TFRecord framing (length, masked CRC-32C
of the length, data, masked CRC-32C of the data) around ``Event`` protocol buffers
(tensorflow/core/util/event.proto). A scalar is encoded as ``tf.summary.scalar`` writes it,
a float32 scalar tensor with the scalars plugin's metadata, field for field and in the
order protobuf serializes them, so TensorBoard reads these files as it read the ones
TensorFlow wrote for kdist before (``tests/callbacks/test_event_file.py`` compares the
bytes with TensorFlow's own messages and reads the files with TensorFlow and TensorBoard).
Only the handful of fields a scalar needs are encoded; nothing here imports TensorFlow,
``tensorboard`` or ``protobuf``.

Example:
    >>> import tempfile
    >>> writer = EventFileWriter(tempfile.mkdtemp())
    >>> writer.write(10, {"loss": 2.5, "tokens_per_s": 1234.0})
    >>> writer.close()
    >>> writer.path.name.startswith("events.out.tfevents.")
    True
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time
from pathlib import Path

FILE_VERSION = b"brain.Event:2"
_FILE_NUMBERS = itertools.count()  # two writers of one process in one second: two files


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):  # Castagnoli polynomial, reflected
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum TFRecord files use.

    Example:
        >>> hex(crc32c(b"123456789"))  # the standard check value
        '0xe3069283'
    """
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> bytes:
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def record(data: bytes) -> bytes:
    """One TFRecord: ``length | masked crc(length) | data | masked crc(data)``."""
    length = struct.pack("<Q", len(data))
    return length + _masked_crc(length) + data + _masked_crc(data)


# --- protocol buffers, by hand: (field number << 3 | wire type), then the value -----------


def _varint(value: int) -> bytes:
    value &= 0xFFFFFFFFFFFFFFFF  # int64: a negative number is its 64-bit two's complement
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _message(field: int, payload: bytes) -> bytes:  # wire type 2: length-delimited
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _integer(field: int, value: int) -> bytes:  # wire type 0; proto3 leaves out a zero
    return _varint(field << 3) + _varint(value) if value else b""


def _double(field: int, value: float) -> bytes:  # wire type 1
    return _varint(field << 3 | 1) + struct.pack("<d", value)


def _float32(value: float) -> bytes:
    try:
        return struct.pack("<f", value)
    except OverflowError:  # beyond float32: infinity, as a float32 cast gives
        return struct.pack("<f", math.copysign(math.inf, value))


# SummaryMetadata{plugin_data{plugin_name: "scalars"}, data_class: DATA_CLASS_SCALAR (1)}
_SCALAR_METADATA = _message(1, _message(1, b"scalars")) + _integer(4, 1)


def scalar_value(tag: str, value: float) -> bytes:
    """``Summary.Value{tag, tensor: float32 scalar, metadata: scalars plugin}``, encoded."""
    # TensorProto{dtype: DT_FLOAT (1), tensor_shape: {} (a scalar), float_val: [value]}
    tensor = _integer(1, 1) + _message(2, b"") + _message(5, _float32(value))
    return _message(1, _message(1, tag.encode("utf-8")) + _message(8, tensor)
                    + _message(9, _SCALAR_METADATA))


def summary_event(step: int, values: dict[str, float], wall_time: float) -> bytes:
    """``Event{wall_time, step, summary{value...}}``, encoded."""
    summary = b"".join(scalar_value(tag, value) for tag, value in values.items())
    return _double(1, wall_time) + _integer(2, step) + _message(5, summary)


def file_version_event(wall_time: float) -> bytes:
    """The event every file starts with: ``Event{wall_time, file_version, source_metadata}``."""
    return (_double(1, wall_time) + _message(3, FILE_VERSION)
            + _message(10, _message(1, b"kdist.callbacks.event_file")))


class EventFileWriter:
    """Appends scalar events to a new ``events.out.tfevents.*`` file in ``directory``.

    Each :meth:`write` is one event (one row of scalars at a step), flushed at once, so
    TensorBoard shows a running run; :meth:`close` closes the file.
    """

    def __init__(self, directory: str | os.PathLike):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = directory / (f"events.out.tfevents.{int(now)}.{socket.gethostname()}."
                                 f"{os.getpid()}.{next(_FILE_NUMBERS)}.v2")
        self._file = open(self.path, "wb")  # noqa: SIM115 - held until close()
        self._file.write(record(file_version_event(now)))
        self._file.flush()

    def write(self, step: int, values: dict[str, float]) -> None:
        if values and self._file is not None:
            self._file.write(record(summary_event(step, values, time.time())))
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
