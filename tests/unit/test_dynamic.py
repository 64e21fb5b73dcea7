"""Which groups DAPO's dynamic sampling keeps (rollout/dynamic.kept_groups), computed by hand."""
import torch

from grpo.rollout.dynamic import kept_groups


def test_groups_with_signal_come_first_then_filler_in_sampled_order():
    # 5 groups of 2 sampled, signal in groups 1 and 3; a batch of 3 keeps both, then group 0 (the first without).
    keep, rows = kept_groups(torch.tensor([False, True, False, True, False]), need=3, group_size=2)
    assert keep.tolist() == [0, 1, 3]
    assert rows.tolist() == [0, 1, 2, 3, 6, 7]


def test_more_groups_with_signal_than_needed_keeps_the_first_sampled():
    keep, rows = kept_groups(torch.tensor([True, False, True, True]), need=2, group_size=3)
    assert keep.tolist() == [0, 2] and rows.tolist() == [0, 1, 2, 6, 7, 8]
