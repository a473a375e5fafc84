"""Bad input raises ValueError/TypeError naming the argument, before any work is done."""

from __future__ import annotations

import numpy as np
import pytest

from nbinfer.formats import (
    BSR,
    PageTable,
    block_element_mask,
    bsr_from_mask,
    bsr_from_ragged,
    causal_mask,
    packbits,
    ragged_mask,
    segment_packbits,
    segment_unpackbits,
    sliding_window_mask,
    unpackbits,
)

GOOD_BSR = {"indptr": [0, 2, 3], "indices": [0, 1, 1], "block_shape": (2, 4), "shape": (4, 8)}
GOOD_TABLE = {"indptr": [0, 2, 2, 3], "indices": [3, 1, 1], "last_page_len": [2, 0, 4],
              "page_size": 4, "num_pages": 4}


def bsr(**changes):
    return BSR(**{**GOOD_BSR, **changes})


def table(**changes):
    return PageTable(**{**GOOD_TABLE, **changes})


def test_good_inputs_pass():
    bsr()
    bsr(last_block_len=[4, 1])
    table()


CASES = [
    # (error, match, call) -- match is the argument's name as the message spells it.
    (ValueError, r"indptr must be non-decreasing", lambda: bsr(indptr=[0, 3, 2])),
    (ValueError, r"indptr\[0\] must be 0", lambda: bsr(indptr=[1, 2, 3])),
    (ValueError, r"indptr must have length 3", lambda: bsr(indptr=[0, 3])),
    (ValueError, r"indptr\[-1\] must be 3", lambda: bsr(indptr=[0, 1, 2])),
    (ValueError, r"indices values must lie in \[0, 2\)", lambda: bsr(indices=[0, -1, 1])),
    (ValueError, r"indices values must lie in \[0, 2\)", lambda: bsr(indices=[0, 2, 1])),
    (TypeError, r"indices must be an integer array", lambda: bsr(indices=[0.0, 1.0, 1.0])),
    (TypeError, r"indices must be an integer array", lambda: bsr(indices=[True, False, True])),
    (ValueError, r"indices must have 1 dimension", lambda: bsr(indices=[[0, 1, 1]])),
    (ValueError, r"indptr must have 1 dimension", lambda: bsr(indptr=[[0, 2, 3]])),
    (ValueError, r"block_shape\[0\] \(Br\) must be >= 1", lambda: bsr(block_shape=(0, 4))),
    (ValueError, r"block_shape\[1\] \(Bc\) must be >= 1", lambda: bsr(block_shape=(2, -4))),
    (ValueError, r"block_shape must be a pair", lambda: bsr(block_shape=(2, 4, 1))),
    (TypeError, r"block_shape must be a pair", lambda: bsr(block_shape=4)),
    (TypeError, r"block_shape\[1\] \(Bc\) must be an int", lambda: bsr(block_shape=(2, 4.0))),
    (ValueError, r"shape\[0\] \(M\) must be >= 0", lambda: bsr(shape=(-1, 8))),
    (ValueError, r"last_block_len values must lie in \[1, 5\)",
     lambda: bsr(last_block_len=[0, 1])),
    (ValueError, r"last_block_len values must lie in \[1, 5\)",
     lambda: bsr(last_block_len=[5, 1])),
    (ValueError, r"last_block_len must have length 2", lambda: bsr(last_block_len=[1])),
    (TypeError, r"occupancy must be a boolean", lambda: BSR.from_dense([[1, 0]], (1, 1))),
    (ValueError, r"occupancy must have shape \(1, 3\)",
     lambda: BSR.from_dense(np.ones((1, 2), bool), (2, 2), shape=(2, 5))),
    (ValueError, r"i must be < num_block_rows=2", lambda: bsr().row_blocks(2)),
    # PageTable
    (ValueError, r"last_page_len values must lie in \[1, 5\)",
     lambda: table(last_page_len=[0, 0, 4])),
    (ValueError, r"last_page_len values must lie in \[1, 5\)",
     lambda: table(last_page_len=[5, 0, 4])),
    (ValueError, r"last_page_len values must lie in \[0, 5\)",
     lambda: table(last_page_len=[2, -1, 4])),
    (ValueError, r"last_page_len must have length 3", lambda: table(last_page_len=[2, 4])),
    (ValueError, r"indices values must lie in \[0, 4\)", lambda: table(indices=[3, 4, 1])),
    (ValueError, r"indices values must lie in \[0, 4\)", lambda: table(indices=[3, -2, 1])),
    (TypeError, r"indices must be an integer array", lambda: table(indices=np.ones(3))),
    (ValueError, r"indptr must be non-decreasing", lambda: table(indptr=[0, 2, 1, 3])),
    (ValueError, r"indices must have at least indptr\[-1\]=4 entries",
     lambda: table(indptr=[0, 2, 2, 4])),
    (ValueError, r"page_size must be >= 1", lambda: table(page_size=0)),
    (TypeError, r"page_size must be an int", lambda: table(page_size=4.0)),
    (ValueError, r"num_pages must be >= 0", lambda: table(num_pages=-1)),
    (ValueError, r"b must be < batch_size=3", lambda: table().token_slots(3)),
    (ValueError, r"rows_per_request must be >= 1", lambda: table().to_bsr(0)),
    (TypeError, r"bsr must be a BSR", lambda: PageTable.from_bsr(table())),
    (ValueError, r"bsr.last_block_len must be set", lambda: PageTable.from_bsr(bsr())),
    (ValueError, r"bsr.shape\[1\] must be a multiple",
     lambda: PageTable.from_bsr(bsr(shape=(4, 7), last_block_len=[1, 1]))),
    (ValueError, r"kv_lens values must lie in", lambda: PageTable.from_kv_lens([3, -1], 4)),
    (ValueError, r"num_pages must be >= 2", lambda: PageTable.from_kv_lens([3, 1], 4, num_pages=1)),
    (TypeError, r"rng must be None", lambda: PageTable.from_kv_lens([3], 4, rng="seed")),
    # ragged
    (ValueError, r"kv_indptr must have length 3", lambda: ragged_mask([0, 1, 2], [0, 4])),
    (ValueError, r"qo_indptr must be non-decreasing",
     lambda: bsr_from_ragged([0, 2, 1], [0, 1, 2], (1, 1))),
    (ValueError, r"block_shape\[0\] \(Br\) must be >= 1",
     lambda: bsr_from_ragged([0, 1], [0, 1], (0, 1))),
    # masks
    (TypeError, r"mask must be a boolean", lambda: bsr_from_mask(np.ones((2, 2)), (1, 1))),
    (ValueError, r"mask must be 2-D", lambda: bsr_from_mask(np.ones(4, bool), (1, 1))),
    (ValueError, r"mask must have shape \(4, 8\)",
     lambda: block_element_mask(bsr(), np.ones((4, 7), bool))),
    (ValueError, r"window_left must be >= 0", lambda: sliding_window_mask(3, 3, -1)),
    (ValueError, r"M must be >= 0", lambda: causal_mask(-1, 3)),
    # packed bits
    (ValueError, r"bitorder must be one of", lambda: packbits(np.ones(3, bool), bitorder="mid")),
    (ValueError, r"bitorder must be one of",
     lambda: segment_packbits(np.ones(3, bool), [0, 3], bitorder="LITTLE")),
    (ValueError, r"bitorder must be one of",
     lambda: unpackbits(np.zeros(1, np.uint8), 3, bitorder="")),
    (ValueError, r"bitorder must be one of",
     lambda: segment_unpackbits(np.zeros(0, np.uint8), [0], [], bitorder="x")),
    (TypeError, r"x must be a boolean", lambda: packbits(np.ones(3, np.int8))),
    (ValueError, r"indptr\[-1\] must be 3", lambda: segment_packbits(np.ones(3, bool), [0, 2])),
    (ValueError, r"length must be <= 8", lambda: unpackbits(np.zeros(1, np.uint8), 9)),
    (ValueError, r"length must be >= 0", lambda: unpackbits(np.zeros(1, np.uint8), -1)),
    (TypeError, r"packed must be a uint8", lambda: unpackbits(np.zeros(1, np.int32), 3)),
    (ValueError, r"packed_indptr: segment 0 holds 1 bytes, but lengths\[0\]=9",
     lambda: segment_unpackbits(np.zeros(1, np.uint8), [0, 1], [9])),
    (ValueError, r"packed_indptr\[-1\] must be 2",
     lambda: segment_unpackbits(np.zeros(2, np.uint8), [0, 1], [3])),
    (ValueError, r"lengths must be >= 0",
     lambda: segment_unpackbits(np.zeros(1, np.uint8), [0, 1], [-3])),
]


@pytest.mark.parametrize("error,match,call", CASES, ids=[c[1][:40] for c in CASES])
def test_bad_input_names_the_argument(error, match, call):
    with pytest.raises(error, match=match):
        call()


def test_messages_give_expected_and_actual_values():
    with pytest.raises(ValueError) as info:
        table(last_page_len=[7, 0, 4])
    assert "last_page_len[0]=7" in str(info.value) and "[1, 5)" in str(info.value)
    with pytest.raises(ValueError) as info:
        bsr(indptr=[0, 3, 2])
    assert "indptr[2]=2 < indptr[1]=3" in str(info.value)
