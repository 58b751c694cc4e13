import pytest
import torch

from stabledrl.data import completion_mask, decode_completions, encode_completions, encode_prompts
from stabledrl.tokenizer import build_char_tokenizer

tok = build_char_tokenizer()
PAD, BOS, EOS = tok.pad_token_id, tok.bos_token_id, tok.eos_token_id


def test_prompts_are_left_padded_with_bos_first():
    ids, mask = encode_prompts(tok, ["1,2=3", "10,20=30"])
    assert ids.shape == (2, 9)  # BOS + 8 characters
    assert ids[0, :3].tolist() == [PAD, PAD, PAD] and mask[0].tolist() == [0] * 3 + [1] * 6
    assert ids[0, 3] == BOS and ids[1, 0] == BOS
    assert tok.decode(ids[1, 1:].tolist()) == "10,20=30"


def test_completions_are_answer_eos_then_pad():
    ids = encode_completions(tok, ["12", ""], 5)
    one, two = tok.encode("12", add_special_tokens=False)
    assert ids.tolist() == [[one, two, EOS, PAD, PAD], [EOS, PAD, PAD, PAD, PAD]]
    with pytest.raises(ValueError, match="needs 6 slots"):
        encode_completions(tok, ["12345"], 5)


def test_completion_mask_scores_up_to_and_including_the_first_eos():
    ids = torch.tensor([[7, 8, EOS, PAD], [7, EOS, 8, EOS], [7, 8, 9, 10]])
    assert completion_mask(ids, EOS).tolist() == [
        [True, True, True, False],
        [True, True, False, False],
        [True, True, True, True],  # no EOS: everything is scored (truncated completion)
    ]


def test_decode_round_trip():
    answers = ["3*5+7", "(20-19)*18", ""]
    ids = encode_completions(tok, answers, 11)
    assert decode_completions(tok, ids) == answers


def test_strict_encoding_names_the_characters_outside_the_tokenizer():
    # They would become UNK, which the model never saw: the completion would answer
    # another prompt. The tiny tokenizer knows digits and + - * / ( ) = , . only.
    with pytest.raises(ValueError, match=r"prompt 'h\u00e9llo=2' has characters the tokenizer does not know: "
                                         r"'h', '\u00e9', 'l', 'o'"):
        encode_prompts(tok, ["1,2=3", "h\u00e9llo=2"], strict=True)
    ids, _ = encode_prompts(tok, ["x=2"])  # not strict: UNK, as the tokenizer encodes it
    assert ids[0, 1] == tok.unk_token_id
