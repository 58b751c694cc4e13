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
from stabledrl.models.attention import (
    block_ids,
    block_offset,
    completion_block_slices,
    completion_blocks,
    staircase_inputs,
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


# --- where the prompt's blocks fall (prompt_attention) ---------------------------------------


def test_block_ids_of_each_prompt_convention_by_hand():
    # Row 0: one padding column, then a prompt of 3 real tokens (positions 0 1 2); row 1: 4 real
    # tokens (0 1 2 3). L = 3 completion slots, S = 2.
    pm = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    # bidirectional: the prompt is block 0, the completion's blocks 1 + i // S.
    assert block_ids(pm, 3, 2, "bidirectional").tolist() == [[0, 0, 0, 0, 1, 1, 2]] * 2
    # sequence_blocks (SDAR): position // S over the whole sequence, padding aside (its
    # id is that of position 0). Row 0's prompt ends mid-block: its tail (position 2)
    # and the first slot (position 3) are block 1.
    assert block_ids(pm, 3, 2, "sequence_blocks").tolist() == [[0, 0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 2, 2, 3]]
    # prompt_blocks (dLLM-RL's trainers): (position − prompt length) // S in the prompt, so
    # its blocks end where it ends, and i // S in the completion.
    assert block_ids(pm, 3, 2, "prompt_blocks").tolist() == [[-2, -2, -1, -1, 0, 0, 1], [-2, -2, -1, -1, 0, 0, 1]]
    # The first completion block holds the prompt's 3 mod 2 = 1 and 4 mod 2 = 0 tail tokens.
    assert block_offset(pm, 2, "sequence_blocks").tolist() == [1, 0]
    assert block_offset(pm, 2, "prompt_blocks").tolist() == [0, 0]
    assert completion_blocks(torch.tensor([1, 0]), 3, 2).tolist() == [[0, 1, 1], [0, 0, 1]]
    assert completion_block_slices(1, 3, 2) == [slice(0, 1), slice(1, 3)]
    assert completion_block_slices(3, 9, 4) == [slice(0, 1), slice(1, 5), slice(5, 9)]
    assert completion_block_slices(0, 5, 4) == block_slices(5, 4)


def test_sequence_blocks_masks_by_hand():
    # One padding column, prompt a b c (positions 0 1 2), completion y0 y1 y2 (3 4 5), S = 2:
    # blocks {a b} {c y0} {y1 y2}. The staircase copies the last W = S − 1 = 1 prompt column
    # (c), which is in the first completion block: the noisy view of that block is [c̃ ; ỹ0].
    pm = torch.tensor([[0, 1, 1, 1]])
    assert _rows(block_causal_attention_mask(pm, 3, 2, "sequence_blocks")[0]) == [
        ".xx....",  # padding row (never read)
        ".xx....",  # a → a b
        ".xx....",  # b
        ".xxxx..",  # c → a b c y0: the prompt's tail sees the first slot, both ways
        ".xxxx..",  # y0
        ".xxxxxx",  # y1 → everything
        ".xxxxxx",  # y2
    ]
    #       columns: pad a b c | y0 y1 y2 | c̃ | ỹ0 ỹ1 ỹ2
    assert _rows(staircase_attention_mask(pm, 3, 2, "sequence_blocks")[0]) == [
        ".xx........",
        ".xx........",
        ".xx........",
        ".xxxx......",  # clean c → clean blocks ≤ its own
        ".xxxx......",
        ".xxxxxx....",
        ".xxxxxx....",
        ".xx....xx..",  # c̃ → clean a b (earlier block), noisy c̃ ỹ0 (its block)
        ".xx....xx..",  # ỹ0 the same: the tail is clean context inside the noisy block
        ".xxxx....xx",  # ỹ1 → clean blocks < 2 (the staircase), noisy ỹ1 ỹ2
        ".xxxx....xx",
    ]
    assert staircase_position_ids(pm, 3, 2, "sequence_blocks").tolist() == [[0, 0, 1, 2, 3, 4, 5, 2, 3, 4, 5]]
    # A prompt of 4 real tokens fills its blocks: the copy c̃ of its last token is inert (no
    # query attends to it; it sees nothing, the model lets it see itself).
    m = staircase_attention_mask(torch.ones(1, 4, dtype=torch.long), 3, 2, "sequence_blocks")[0]
    assert not m[:, 4 + 3].any() and not m[4 + 3].any()


def test_prompt_blocks_mask_by_hand():
    # Prompt a b c (one padding column before it), S = 2: blocks {a} {b c}, ending where the
    # prompt ends; the completion's blocks start at y0: {y0 y1} {y2}.
    pm = torch.tensor([[0, 1, 1, 1]])
    assert _rows(block_causal_attention_mask(pm, 3, 2, "prompt_blocks")[0]) == [
        ".x.....",  # padding row (never read)
        ".x.....",  # a → a
        ".xxx...",  # b → a b c
        ".xxx...",
        ".xxxxx.",  # y0 → prompt, y0 y1
        ".xxxxx.",
        ".xxxxxx",
    ]
    assert staircase_attention_mask(pm, 3, 2, "prompt_blocks").shape == (1, 10, 10)  # no copies: [q ; y ; ỹ]


def test_the_general_masks_reproduce_the_bidirectional_ones():
    # The tiny models' masks (one prompt block) are the unbatched ones with padding keys hidden.
    gen = torch.Generator().manual_seed(0)
    for P, L, S in [(0, 3, 2), (3, 5, 2), (4, 7, 3), (2, 1, 4), (5, 8, 8)]:
        pm = (torch.rand(3, P, generator=gen) > 0.3).long()
        keys = torch.cat([pm.bool(), torch.ones(3, 2 * L, dtype=torch.bool)], dim=1)
        assert torch.equal(staircase_attention_mask(pm, L, S), staircase_mask(P, L, S)[None] & keys[:, None, :])
        bc = block_causal_attention_mask(pm, L, S)
        assert torch.equal(bc, block_causal_mask(P, L, S)[None] & keys[:, None, : P + L])
        x_ids = torch.arange(P)[None].expand(3, P)
        y, noisy = torch.ones(3, L, dtype=torch.long), torch.zeros(3, L, dtype=torch.long)
        ids, mask, pos = staircase_inputs(x_ids, pm, y, noisy, S)
        assert ids.shape == (3, P + 2 * L) and torch.equal(pos, staircase_position_ids(pm, L))


def test_an_unknown_prompt_convention_is_refused():
    with pytest.raises(ValueError, match="prompt_attention must be one of"):
        block_ids(torch.ones(1, 2, dtype=torch.long), 3, 2, "causal")
