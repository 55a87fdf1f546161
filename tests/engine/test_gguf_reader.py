"""pdserve's GGUF header reader against the gguf package's `GGUFReader` (the reference) on files
the gguf package writes: every metadata value type, float and quantised tensors, both byte
orders; and a damaged file is a ValueError that says where, never another exception."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pdserve.engine.checkpoint.gguf_reader import GGUFFile

pytestmark = pytest.mark.unit

V = gguf.GGUFValueType


def _write(path, endianess=gguf.GGUFEndian.LITTLE, alignment: int | None = None):
    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(path, arch="llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for kind, value in [(V.UINT8, 7), (V.INT8, -7), (V.UINT16, 60000), (V.INT16, -3),
                        (V.UINT32, 4_000_000_000), (V.INT32, -5), (V.UINT64, 2**40),
                        (V.INT64, -(2**40)), (V.FLOAT32, 0.5), (V.FLOAT64, 1e-300),
                        (V.BOOL, True), (V.STRING, "café 東京 🙂")]:
        w.add_key_value(f"t.{kind.name.lower()}", value, kind)
    w.add_key_value("t.tokens", [f"tok{i}\u0120" for i in range(3000)], V.ARRAY,
                    sub_type=V.STRING)
    w.add_key_value("t.scores", [float(i) / 8 for i in range(2000)], V.ARRAY,
                    sub_type=V.FLOAT32)
    w.add_key_value("t.types", [i % 5 for i in range(100)], V.ARRAY, sub_type=V.INT32)
    w.add_key_value("t.flags", [True, False, True], V.ARRAY, sub_type=V.BOOL)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 64)).astype(np.float16))
    w.add_tensor("vec", rng.standard_normal(7).astype(np.float32))
    for q in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0):
        w.add_tensor(f"q.{q.name}", gguf.quants.quantize(
            rng.standard_normal((2, 64)).astype(np.float32), q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_fields_and_tensors_equal_the_gguf_packages_reader(tmp_path, endianess):
    path = _write(tmp_path / "x.gguf", endianess)
    ours, ref = GGUFFile(path), gguf.GGUFReader(path, "r")
    want = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(want)  # file order
    for key, f in want.items():
        mine = ours.fields[key]
        assert mine.type == f.types[0], key
        assert mine.item_type == (f.types[-1] if f.types[0] == V.ARRAY else None), key
        assert mine.value == f.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, t in zip(ours.tensors, ref.tensors, strict=True):
        assert mine.tensor_type == t.tensor_type and list(mine.dims) == t.shape.tolist()
        assert mine.data_offset == t.data_offset and mine.n_bytes == t.n_bytes
        assert mine.data.shape == t.data.shape and mine.data.dtype == t.data.dtype
        assert np.array_equal(mine.data, t.data)
        assert not mine.data.flags.writeable  # a view into the read-only map
    assert ours.tensors[0].shape == (3, 5)  # outermost first, as torch names it


def test_a_custom_alignment_places_the_data_where_it_says(tmp_path):
    path = _write(tmp_path / "x.gguf", alignment=64)
    ours, ref = GGUFFile(path), gguf.GGUFReader(path, "r")
    assert ours.fields["general.alignment"].value == 64
    assert [t.data_offset for t in ours.tensors] == [t.data_offset for t in ref.tensors]
    assert all(t.data_offset % 64 == 0 for t in ours.tensors)


def test_every_truncation_is_a_value_error_that_says_where(tmp_path):
    path = _write(tmp_path / "x.gguf")
    whole = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    header_end = GGUFFile(path).tensors[0].data_offset
    # Every cut in the first few hundred bytes, then a stride through the rest of the header
    # (the long arrays), then inside the first and the last tensor's data.
    last = GGUFFile(path).tensors[-1]
    points = [*range(0, 300), *range(300, header_end, 97), header_end + 10,
              last.data_offset + last.n_bytes - 1]
    for n in points:
        cut.write_bytes(whole[:n])
        with pytest.raises(ValueError, match=r"cut\.gguf"):
            GGUFFile(cut)


@pytest.mark.parametrize(("offset", "data", "why"), [
    (0, b"GGUX", "no GGUF magic"),
    (4, (9).to_bytes(4, "little"), "GGUF version 9"),
])
def test_a_wrong_magic_or_version_is_refused(tmp_path, offset, data, why):
    raw = bytearray(_write(tmp_path / "x.gguf").read_bytes())
    raw[offset:offset + len(data)] = data
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=why):
        GGUFFile(bad)


def test_an_unknown_value_type_or_a_repeated_key_is_refused(tmp_path):
    raw = _write(tmp_path / "x.gguf").read_bytes()
    first_key = b"general.architecture"
    at = raw.index(first_key) + len(first_key)  # its u32 value type follows the key
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(raw[:at] + (99).to_bytes(4, "little") + raw[at + 4:])
    with pytest.raises(ValueError, match="unknown metadata value type 99"):
        GGUFFile(bad)
    # The same key twice: rename the second key (same length) to the first one's name.
    second = b"t.uint8"
    at = raw.index(second)
    bad.write_bytes(raw[:at] + b"t.int16" + raw[at + len(second):])
    with pytest.raises(ValueError, match="'t.int16' appears twice"):
        GGUFFile(bad)


def test_an_empty_file_is_not_a_gguf(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(empty)
