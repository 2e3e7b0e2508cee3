"""The one draft KV cache: append/update/crop, row selection, merging ragged requests, compaction.

Shape legend: B = rows, K = heads, C = entries, D = head dim.
"""

import pytest
import torch

from deepspec.decoding.kv_cache import DraftKVCache, pad_entries


def entries(rows: int, num: int, start: float) -> torch.Tensor:
    """[B, 1, C, 2] keys whose values encode (row, entry) so moves are visible."""
    row_B = torch.arange(rows, dtype=torch.float32)[:, None, None, None]
    entry_C = torch.arange(num, dtype=torch.float32)[None, None, :, None] + start
    return (100 * row_B + entry_C).expand(rows, 1, num, 2).clone()


def test_append_tracks_positions_and_visibility():
    cache = DraftKVCache()
    cache.append([entries(2, 3, 0)], [entries(2, 3, 0)], torch.arange(3).expand(2, 3),
                 torch.ones(2, 3, dtype=torch.bool))
    cache.append([entries(2, 2, 3)], [entries(2, 2, 3)], torch.tensor([[3, 4], [3, 4]]),
                 torch.tensor([[True, False], [True, True]]))
    assert cache.length == 5 and cache.num_holes == 1
    # A block anchored at position 4 sees valid entries strictly before it.
    assert cache.visible_BC(torch.tensor([4, 4])).tolist() == [[True] * 4 + [False], [True] * 4 + [False]]
    with pytest.raises(ValueError, match="batch size"):
        cache.append([entries(3, 1, 0)], [entries(3, 1, 0)], torch.zeros(3, 1, dtype=torch.long),
                     torch.ones(3, 1, dtype=torch.bool))


def test_update_is_the_transformers_cache_protocol_and_crop_drops_speculative_entries():
    cache = DraftKVCache()
    keys, values = cache.update(entries(1, 2, 0), entries(1, 2, 0), layer_idx=3)
    assert keys.shape == (1, 1, 2, 2) and cache.get_seq_length(3) == 2 and cache.get_seq_length() == 2
    keys, _ = cache.update(entries(1, 1, 2), entries(1, 1, 2), layer_idx=3)
    assert keys[0, 0, :, 0].tolist() == [0.0, 1.0, 2.0]
    cache.crop(2)
    assert cache.get_seq_length(3) == 2 and cache.layer_kv(4)[3][0][0, 0, :, 0].tolist() == [0.0, 1.0]
    assert cache.layer_kv(4)[0] is None  # layers never written
    with pytest.raises(ValueError, match="crop length"):
        cache.crop(5)


def test_select_merge_and_compact_keep_each_rows_entries_in_order():
    cache = DraftKVCache()
    cache.append([entries(2, 3, 0)], [entries(2, 3, 0)], torch.arange(3).expand(2, 3),
                 torch.tensor([[True, False, True], [True, True, True]]))
    joining = DraftKVCache()
    joining.append([entries(1, 5, 10)], [entries(1, 5, 10)], torch.arange(5)[None], torch.ones(1, 5, dtype=torch.bool))
    cache.merge(joining)  # right-padded to 5 entries, the padding invalid
    assert cache.keys[0].shape == (3, 1, 5, 2) and cache.valid_BC[0].tolist() == [True, False, True, False, False]
    assert cache.keys[0][2, 0, :, 0].tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]
    cache.select_rows([2, 0])  # a finished request leaves; the order follows the list
    assert cache.keys[0][:, 0, 0, 0].tolist() == [10.0, 0.0]
    cache.compact()
    assert cache.valid_BC.tolist() == [[True] * 5, [True, True, False, False, False]]
    assert cache.keys[0][1, 0, :2, 0].tolist() == [0.0, 2.0] and cache.positions_BC[1, :2].tolist() == [0, 2]
    cache.select_rows([])
    assert cache.length == 0 and cache.positions_BC is None


def test_pad_entries():
    assert pad_entries(torch.ones(1, 2), 4, 1, 7).tolist() == [[1, 1, 7, 7]]
    assert pad_entries(torch.ones(1, 3), 2, 1).shape == (1, 3)
