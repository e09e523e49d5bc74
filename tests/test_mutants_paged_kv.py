"""The block manager's edges that mutation testing found untested (docs/mutation.md).

Block tables are padded with -1 past each sequence's blocks, after a
rollback (truncate) and after the table tensor grows for more sequences or
longer tables; truncating past a sequence's length is refused naming both
lengths.
"""

from __future__ import annotations

import pytest
import torch

from inference_svc.model.paged_kv import BlockManager


def test_a_truncated_table_is_padded_with_minus_one():
    bm = BlockManager(64, 4)
    bm.allocate("a", 12)
    bm.allocate("b", 12)
    assert bm.truncate("a", 5) == 5
    tables = bm.block_tables(["a", "b"])
    assert tables[0, 2].item() == -1 and tables[0, :2].tolist() == bm.block_table("a")
    assert tables[1].tolist() == bm.block_table("b")


def test_tables_grown_for_more_and_longer_sequences_are_padded_with_minus_one():
    bm = BlockManager(256, 2)
    for i in range(9):  # past the eight rows the tensor starts with
        bm.allocate(i, 2)
    bm.allocate("long", 2 * 12)  # past its eight columns
    tables = bm.block_tables([8, "long"])
    assert tables.dtype == torch.int64 and tables.shape == (2, 12)
    assert tables[0, 0].item() == bm.block_table(8)[0] and (tables[0, 1:] == -1).all()
    assert tables[1].tolist() == bm.block_table("long")


def test_truncating_past_the_end_names_both_lengths():
    bm = BlockManager(16, 4)
    bm.allocate("a", 10)
    with pytest.raises(ValueError, match=r"^sequence 'a': cannot truncate 10 tokens to 11$"):
        bm.truncate("a", 11)
