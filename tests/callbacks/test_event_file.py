"""kdist's TensorBoard event files: the bytes TensorFlow's own messages serialize to, in
files TensorFlow's reader (which checks every CRC) reads back."""

import struct

import pytest
import tensorflow as tf  # the reference (a test dependency); kdist itself never imports it
from tensorflow.core.framework import summary_pb2
from tensorflow.core.util import event_pb2

from kdist.callbacks.event_file import (
    EventFileWriter,
    crc32c,
    file_version_event,
    record,
    summary_event,
)

VALUES = {"tokens_per_s": 1234.5, "mfu": 0.25, "loss": 0.0, "lr": -3e-4, "tokens": 2**40,
          "overflow": 1e39, "größe/ü": 7}  # a zero, a negative, an int, beyond float32, UTF-8


def tensorflow_summary(values):
    """What kdist wrote through TensorFlow before: tf.summary.scalar's message."""
    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"),
        data_class=summary_pb2.DATA_CLASS_SCALAR)
    return summary_pb2.Summary(value=[
        summary_pb2.Summary.Value(tag=k, metadata=metadata,
                                  tensor=tf.make_tensor_proto(float(v), tf.float32))
        for k, v in values.items()])


@pytest.mark.parametrize("step", [0, 1, 300, 2**40, -1])
def test_an_event_is_the_bytes_tensorflow_serializes(step):
    expected = event_pb2.Event(wall_time=1.5e9 + 0.25, step=step,
                               summary=tensorflow_summary(VALUES)).SerializeToString()
    assert summary_event(step, VALUES, 1.5e9 + 0.25) == expected


def test_the_first_event_names_the_file_version():
    event = event_pb2.Event.FromString(file_version_event(1.5e9))
    assert event.file_version == "brain.Event:2" and event.wall_time == 1.5e9


def test_crc32c_and_record_framing():
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert crc32c(b"") == 0
    framed = record(b"abc")
    assert struct.unpack("<Q", framed[:8]) == (3,) and framed[12:15] == b"abc"
    assert len(framed) == 8 + 4 + 3 + 4


def test_tensorflow_reads_the_file_and_checks_its_checksums(tmp_path):
    writer = EventFileWriter(tmp_path)
    writer.write(2, {"loss": 3.5, "mfu": 0.25})
    writer.write(3, {})  # nothing finite to write: no event
    writer.write(4, {"loss": 3.0})
    writer.close()
    (path,) = tmp_path.glob("events.out.tfevents.*.v2")
    events = list(tf.compat.v1.train.summary_iterator(str(path)))
    assert events[0].file_version == "brain.Event:2"
    read = {(v.tag, e.step): float(tf.make_ndarray(v.tensor))
            for e in events[1:] for v in e.summary.value}
    assert read == {("loss", 2): 3.5, ("mfu", 2): 0.25, ("loss", 4): 3.0}
    assert all(v.metadata.plugin_data.plugin_name == "scalars"
               for e in events[1:] for v in e.summary.value)
    # The reader verifies checksums: one flipped byte of data is refused.
    data = bytearray(path.read_bytes())
    data[-6] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(tf.errors.DataLossError):
        list(tf.compat.v1.train.summary_iterator(str(path)))


def test_two_writers_in_one_second_write_two_files(tmp_path):
    first, second = EventFileWriter(tmp_path), EventFileWriter(tmp_path)
    first.close(), second.close()
    assert first.path != second.path and len(list(tmp_path.iterdir())) == 2
