from stabledrl.tokenizer import CHARS, build_char_tokenizer
from transformers import PreTrainedTokenizerFast


def test_round_trip_every_character():
    tok = build_char_tokenizer()
    text = CHARS + "12*(3+4)/5-6=7,8."
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text


def test_special_ids_are_distinct_and_first():
    tok = build_char_tokenizer()
    specials = [tok.pad_token_id, tok.mask_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id]
    assert specials == [0, 1, 2, 3, 4]
    assert len(tok) == 5 + len(CHARS)


def test_unknown_character_maps_to_unk_and_specials_are_skipped():
    tok = build_char_tokenizer()
    ids = tok.encode("1 x", add_special_tokens=False)
    assert ids[1] == tok.unk_token_id and ids[2] == tok.unk_token_id
    assert tok.decode([tok.mask_token_id] + tok.encode("42", add_special_tokens=False) + [tok.eos_token_id],
                      skip_special_tokens=True) == "42"


def test_save_and_load(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    back = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert back.encode("19-5*8", add_special_tokens=False) == tok.encode("19-5*8", add_special_tokens=False)
    assert back.mask_token_id == tok.mask_token_id and back.padding_side == "left"
