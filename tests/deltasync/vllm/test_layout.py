"""A block's segments (`layout.Segments`): what a rank reads of a tensor it holds in parts, batch by batch,
covers exactly the block's positions in the window, in its element order, cut where the decoder needs."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync.vllm.layout import Block, Segments


@st.composite
def boxes(draw) -> tuple[tuple[int, ...], list[Block]]:
    """An HF shape (1-3 dims) and one or two disjoint boxes of it, each in a contiguous tensor of its own."""
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    strides = [int(np.prod(shape[d + 1 :])) for d in range(len(shape))]
    cut_dim = draw(st.integers(0, len(shape) - 1))  # the dim along which the boxes split the tensor
    cut = draw(st.integers(0, shape[cut_dim]))
    blocks = []
    for lo, hi in ((0, cut), (cut, shape[cut_dim])):
        if lo == hi:
            continue
        size = tuple(hi - lo if d == cut_dim else n for d, n in enumerate(shape))
        blocks.append(Block(torch.zeros(size), size, tuple(strides), lo * strides[cut_dim]))
    return shape, blocks


@settings(max_examples=200, deadline=None)
@given(boxes(), st.data(), st.integers(1, 40), st.integers(1, 40))
def test_segments_cover_the_window_in_element_order(box, data, chunk: int, budget: int):
    shape, blocks = box
    numel = int(np.prod(shape))
    lo = data.draw(st.integers(0, numel - 1))
    n = data.draw(st.integers(1, numel - lo))
    segments = Segments.of(blocks, lo, n, chunk, budget)
    assert np.all(segments.length >= 1) and np.all(segments.length <= budget)
    ends = segments.start + segments.length - 1
    assert np.array_equal(segments.start // chunk, ends // chunk)  # no segment across a chunk boundary
    seen = []
    for first, last in segments.batches(budget, chunk):
        e0, e1 = segments.span(first, last)
        block = blocks[segments.block[first]]
        positions = segments.positions(first, last)
        # The batch's elements, read as a slice of the block, are those positions, in that order.
        assert np.array_equal(block.positions().numpy()[e0:e1] - lo, positions)
        assert len(set((segments.start[first:last] // chunk).tolist())) == 1 and e1 - e0 <= 2 * budget
        seen.append(positions)
    held = np.concatenate([b.positions().numpy() for b in blocks]) - lo
    in_window = np.sort(held[(held >= 0) & (held < n)])
    assert np.array_equal(np.sort(np.concatenate(seen)) if seen else np.empty(0), in_window)
