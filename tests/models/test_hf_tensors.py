"""The tensor maps' exact re-indexing: any box of a kdist weight read from its HF tensor
equals the same box of the whole mapped array, and export inverts the map."""

import itertools

import numpy as np

from kdist.models.hf.stacked import StackedMap
from kdist.models.hf.tensors import Pad, Split, TensorMap, Transpose, assemble

rng = np.random.default_rng(0)


def boxes(shape, count=40):
    """Random boxes, plus every even split of each axis in two (shards)."""
    out = []
    for _ in range(count):
        box = []
        for n in shape:
            a = int(rng.integers(0, n))
            box.append(slice(a, int(rng.integers(a + 1, n + 1))))
        out.append(tuple(box))
    for halves in itertools.product(*[(slice(0, n // 2), slice(n // 2, n)) for n in shape]):
        out.append(halves)
    return out


def check(tensor_map, hf):
    reads = []

    def reader(key, box):
        assert key == tensor_map.key
        part = hf[box]
        reads.append(part.size)
        return np.array(part)

    full = tensor_map.read(reader)
    for box in boxes(full.shape):
        reads.clear()
        np.testing.assert_array_equal(tensor_map.read(reader, box), full[box])
        padded = any(isinstance(s, Pad) for s in tensor_map.steps)
        if not padded:  # read exactly what the box holds, no more
            assert sum(reads) == full[box].size, box
    return full


def test_linear_heads_split_transposed():  # Llama q_proj (N*H, D) -> (D, N, H)
    hf = rng.normal(size=(4 * 6, 10))
    m = TensorMap("q", hf.shape, steps=(Transpose((1, 0)), Split(1, (4, 6))))
    full = check(m, hf)
    np.testing.assert_array_equal(full, hf.T.reshape(10, 4, 6))
    np.testing.assert_array_equal(m.to_hf(full), hf)


def test_fused_regions_and_biases():  # GPT-2 c_attn (D, 3D) and its bias (3D,)
    hf, bias = rng.normal(size=(8, 3 * 12)), rng.normal(size=(3 * 12,))
    kernels = [TensorMap("c", hf.shape, region=((0, 8), (i * 12, (i + 1) * 12)),
                         steps=(Split(1, (3, 4)),)) for i in range(3)]
    biases = [TensorMap("b", bias.shape, region=((i * 12, (i + 1) * 12),),
                        steps=(Split(0, (3, 4)),)) for i in range(3)]
    fulls = [check(m, hf) for m in kernels]
    check(biases[1], bias)
    np.testing.assert_array_equal(fulls[2], hf[:, 24:].reshape(8, 3, 4))
    np.testing.assert_array_equal(assemble(list(zip(kernels, fulls))), hf)


def test_padded_tables_tied_and_untied():
    wte = rng.normal(size=(7, 4))
    table = TensorMap("wte", wte.shape, steps=(Pad(0, 16),))
    head = TensorMap("lm_head", wte.shape, steps=(Transpose((1, 0)), Pad(1, 16)))
    full = check(table, wte)
    assert not full[7:].any() and full.shape == (16, 4)
    np.testing.assert_array_equal(check(head, wte), full.T)
    np.testing.assert_array_equal(head.to_hf(full.T), wte)


def test_stacked_layers_read_box_by_box_in_the_stacks_order():
    # (R, L / R, D, N, H) from L = 6 per-layer (N*H, D) tensors: layer r * 3 + j at [r, j].
    hf = {f"h.{i}": rng.normal(size=(4 * 2, 5)) for i in range(6)}
    layers = tuple(TensorMap(f"h.{i}", (8, 5), steps=(Transpose((1, 0)), Split(1, (4, 2))))
                   for i in range(6))
    for lead in ((6,), (2, 3)):
        m = StackedMap(layers, lead)
        want = np.stack([hf[f"h.{i}"].T.reshape(5, 4, 2) for i in range(6)]).reshape(
            lead + (5, 4, 2))
        np.testing.assert_array_equal(m.read(lambda key, box: hf[key][box]), want)
        for box in boxes(m.shape, count=20) + [(slice(1, 1),) * len(lead)]:
            reads = []

            def reader(key, b, reads=reads):
                reads.append(hf[key][b].size)
                return np.array(hf[key][b])

            np.testing.assert_array_equal(m.read(reader, box), want[box])
            assert sum(reads) == want[box].size  # only the box, of only its layers
        assert [a.tobytes() for a in m.to_hf(want)] == [hf[f"h.{i}"].tobytes() for i in range(6)]
        assert m.layer_index(4) == ((4,) if lead == (6,) else (1, 1))
    assert StackedMap(layers).viewed((2, 3, 5, 4, 2)).lead == (2, 3)
