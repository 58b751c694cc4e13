import pytest
import torch

from stabledrl.models import (
    block_slices,
    block_causal_attention_mask,
    block_causal_mask,
    staircase_attention_mask,
    staircase_mask,
    staircase_position_ids,
)
from tests.conftest import make_tiny_policy


def _rows(m: torch.Tensor) -> list[str]:
    return ["".join("x" if v else "." for v in row) for row in m.tolist()]


def test_block_causal_mask_by_hand():
    # P = 2, L = 5, S = 2: blocks {0,1} {2,3} {4} after the prompt.
    assert _rows(block_causal_mask(2, 5, 2)) == [
        "xx.....",  # q
        "xx.....",
        "xxxx...",  # block 1
        "xxxx...",
        "xxxxxx.",  # block 2
        "xxxxxx.",
        "xxxxxxx",  # block 3 (short)
    ]


def test_staircase_mask_by_hand():
    # P = 1, L = 3, S = 2: columns q | y0 y1 y2 | ỹ0 ỹ1 ỹ2.
    assert _rows(staircase_mask(1, 3, 2)) == [
        "x......",  # q → q
        "xxx....",  # clean block 1 → q, clean block 1
        "xxx....",
        "xxxx...",  # clean block 2 → q, clean blocks 1-2
        "x...xx.",  # noisy block 1 → q, noisy block 1
        "x...xx.",
        "xxx...x",  # noisy block 2 → q, clean block 1 (the staircase), noisy block 2
    ]


def test_staircase_positions_and_padding():
    pm = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert staircase_position_ids(pm, 2).tolist() == [[0, 0, 1, 2, 3, 2, 3], [0, 1, 2, 3, 4, 3, 4]]
    m = staircase_attention_mask(pm, 2, 1)
    assert m.shape == (2, 7, 7)
    assert not m[0, :, 0].any() and m[1, :, 0].all()  # row 0's padding key is hidden from every query
    assert torch.equal(m[1], staircase_mask(3, 2, 1))
    assert torch.equal(block_causal_attention_mask(pm, 2, 1)[1], block_causal_mask(3, 2, 1))


@pytest.mark.parametrize("bad", [dict(block_size=0), dict(completion_len=-1)])
def test_masks_reject_bad_sizes(bad):
    args = dict(prompt_len=2, completion_len=3, block_size=2) | bad
    with pytest.raises(ValueError):
        staircase_mask(**args)


def _other(tok: torch.Tensor, V: int) -> torch.Tensor:
    return (tok - 5 + 1) % (V - 5) + 5  # a different non-special token


@pytest.mark.parametrize("changed_block", [1, 2])
def test_no_leak_from_later_blocks(changed_block):
    # [q ; y ; ỹ] with S = 2, L = 6: changing a clean or a noisy token of block b+1
    # leaves every logit read for blocks <= b unchanged (q, clean and noisy copies).
    policy = make_tiny_policy(seed=7, attention_kind="block", block_size=2)
    V = len(policy.tokenizer)
    P, L, S = 3, 6, 2
    pm = torch.tensor([[0, 1, 1], [1, 1, 1]])
    x = torch.randint(5, V, (2, P + 2 * L))
    mask, pos = staircase_attention_mask(pm, L, S), staircase_position_ids(pm, L)
    base = policy.logits(x, mask, pos)
    first = changed_block * S  # first slot of block b+1 (0-based slot index)
    for col in (P + first, P + L + first):  # its clean token, then its noisy token
        y = x.clone()
        y[:, col] = _other(x[:, col], V)
        out = policy.logits(y, mask, pos)
        unchanged = [*range(P + first), *range(P + L, P + L + first)]  # q, clean and noisy slots of blocks <= b
        assert torch.allclose(out[:, unchanged], base[:, unchanged], atol=1e-6)
        assert not torch.allclose(out, base)  # the change did reach something


def test_block_causal_model_has_no_leak_and_is_bidirectional_within_a_block():
    policy = make_tiny_policy(seed=8, attention_kind="block", block_size=3)
    V = len(policy.tokenizer)
    P, L = 2, 7
    pm = torch.ones(1, P, dtype=torch.long)
    x = torch.randint(5, V, (1, P + L))
    mask = block_causal_attention_mask(pm, L, 3)
    pos = torch.arange(P + L)[None]
    base = policy.logits(x, mask, pos)
    y = x.clone()
    y[0, P + 3] = _other(x[0, P + 3], V)  # first slot of block 2
    out = policy.logits(y, mask, pos)
    assert torch.allclose(out[:, : P + 3], base[:, : P + 3], atol=1e-6)  # prompt and block 1 unchanged
    assert not torch.allclose(out[:, P + 5], base[:, P + 5])  # later slot of the same block sees it


def test_block_slices_by_hand():
    assert block_slices(11, 4) == [slice(0, 4), slice(4, 8), slice(8, 11)]  # the last block is short
    assert block_slices(8, 4) == [slice(0, 4), slice(4, 8)]
    assert block_slices(3, 8) == [slice(0, 3)]
    with pytest.raises(ValueError, match="block_size"):
        block_slices(8, 0)
