"""Chat templates and stop tokens: properties of the policy, seen alike by SFT, RL rollouts,
evaluation and `stabledrl sample` (`stabledrl.models.prompting`, `stabledrl.data`)."""

from __future__ import annotations

import dataclasses

from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import BertConfig, BertForMaskedLM, PreTrainedTokenizerFast

from stabledrl.cli import main
from stabledrl.config import ConfigError, load_config
from stabledrl.data import (decode_completions, decode_policy_completions, encode_policy_prompts, encode_prompts)
from stabledrl.evaluate import evaluate
from stabledrl.models import ModelConfig, TinyPolicy, load_policy
from stabledrl.sampling import SamplingConfig, generate
from stabledrl.tasks import get_task
from stabledrl.tokenizer import CHARS, SPECIAL_TOKENS, build_char_tokenizer
from stabledrl.rollouts import roll_groups
from stabledrl.train import TrainConfig
from tests.conftest import make_tiny_policy

ROOT = Path(__file__).resolve().parents[1]
TURN_TOKENS = ["<|user|>", "<|end|>", "<|assistant|>"]
# A template in the style of LLaDA-Instruct's: BOS, then each turn between its markers, then
# the assistant's marker when a generation prompt is asked for.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer's specials and characters, then three turn markers, and a chat template."""
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS.values(), *CHARS, *TURN_TOKENS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, padding_side="left", additional_special_tokens=TURN_TOKENS,
                                  **SPECIAL_TOKENS)
    tok.chat_template = TEMPLATE
    return tok


def chat_policy(seed: int = 0, **kw) -> TinyPolicy:
    policy = make_tiny_policy(seed=seed, vocab_size=len(chat_tokenizer()))
    return TinyPolicy(policy.model, chat_tokenizer(), **kw)


# --- encoding ---------------------------------------------------------------------------


def test_a_template_wraps_each_prompt_as_one_user_turn_with_the_generation_prompt_and_one_bos():
    tok = chat_tokenizer()
    ids, mask = encode_prompts(tok, ["1,2=3", "10=9"])  # the tokenizer has a template: on by default
    c = tok.convert_tokens_to_ids
    # [BOS] <|user|> 1 , 2 = 3 <|end|> <|assistant|>: the template's BOS only, none added
    first = [tok.bos_token_id, c("<|user|>"), *tok.encode("1,2=3", add_special_tokens=False), c("<|end|>"),
             c("<|assistant|>")]
    assert ids[0].tolist() == first and mask[0].tolist() == [1] * 9
    assert ids[1, 0] == tok.pad_token_id and mask[1].tolist() == [0] + [1] * 8  # left-padded
    assert (ids == tok.bos_token_id).sum() == 2
    off, off_mask = encode_prompts(tok, ["1,2=3"], chat_template=False)  # the switch: BOS and the raw text
    assert off[0].tolist() == [tok.bos_token_id, *tok.encode("1,2=3", add_special_tokens=False)]
    assert torch.equal(encode_prompts(tok, ["1,2=3"], chat_template=True)[0], ids[:1])


def test_a_template_is_refused_where_the_tokenizer_has_none():
    with pytest.raises(ValueError, match="no chat template"):
        TinyPolicy(make_tiny_policy().model, build_char_tokenizer(), chat_template=True)


@pytest.mark.parametrize("name", ["countdown-tiny", "countdown-tiny-block", "countdown-tiny-diverse"])
def test_the_shipped_models_have_no_template_and_encode_prompts_as_before(name):
    # [PAD ..] [BOS] characters: the layout every figure of the README was measured with.
    policy = load_policy(ROOT / "checkpoints" / name)
    tok = policy.tokenizer
    assert policy.chat_template is False and not tok.chat_template
    assert policy.stop_token_ids == (tok.eos_token_id, tok.pad_token_id)
    prompts = ["3,5,7=22", "12,4,6=9"]
    ids, mask = encode_policy_prompts(policy, prompts)
    for row, m, p in zip(ids.tolist(), mask.tolist(), prompts):
        body = [tok.bos_token_id] + [tok.convert_tokens_to_ids(ch) for ch in p]
        assert row == [tok.pad_token_id] * (len(row) - len(body)) + body
        assert m == [0] * (len(row) - len(body)) + [1] * len(body)


def test_the_policy_setting_decides_and_load_policy_maps_auto_on_off(tmp_path):
    assert chat_policy().chat_template is True  # None: the tokenizer has one
    assert chat_policy(chat_template=False).chat_template is False
    chat_policy(seed=1).save(tmp_path / "m")
    assert load_policy(ModelConfig(path=str(tmp_path / "m"))).chat_template is True
    off = load_policy(ModelConfig(path=str(tmp_path / "m"), chat_template=False))
    assert off.chat_template is False
    ids, _ = encode_policy_prompts(off, ["1=1"])
    assert not set(ids[0].tolist()) & set(off.tokenizer.convert_tokens_to_ids(TURN_TOKENS))


class _Recording:
    """A policy that keeps the input ids of its model calls."""

    def __init__(self, policy):
        self._policy, self.inputs = policy, []

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def logits(self, input_ids, *args, **kwargs):
        self.inputs.append(input_ids.clone())
        return self._policy.logits(input_ids, *args, **kwargs)


def _one_process():
    """The real `Shards` of rank 0 of 1 (no accelerator needed)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from stabledrl.shards import Shards

    return Shards(SimpleNamespace(process_index=0, num_processes=1, distributed_type=DistributedType.NO))


@pytest.mark.parametrize("chat", [True, False])
def test_evaluation_and_rollouts_feed_the_model_the_prompt_text_of_the_policy_setting(chat):
    task = get_task("countdown")
    problems = task.generate(3, split="test", seed=0)
    policy = _Recording(chat_policy(seed=2, chat_template=chat))
    expected, _ = encode_prompts(policy.tokenizer, [p.prompt for p in problems], chat_template=chat)
    P = expected.size(1)
    evaluate(policy, task, problems, progress=False)
    assert torch.equal(policy.inputs[0][:, :P], expected)
    assert ((policy.inputs[0][:, :P] == policy.tokenizer.convert_tokens_to_ids("<|assistant|>")).any(1)
            == chat).all()
    policy.inputs.clear()
    groups = roll_groups(policy, task, problems[:2], group_size=2, sampling=TrainConfig().rollout, gen_length=11, tag="t",
                         shards=_one_process())
    assert torch.equal(groups.prompt_ids, expected[:2].repeat_interleave(2, 0)[:, -groups.prompt_ids.size(1):])
    assert torch.equal(policy.inputs[0][:, :groups.prompt_ids.size(1)], groups.prompt_ids)


def test_max_prompt_length_keeps_each_prompts_last_tokens_in_rollouts_and_evaluation():
    # d1's (TRL's) max_prompt_length: the left-padded batch cut to its last N columns, so a longer
    # prompt loses its beginning and a shorter one keeps all its tokens (and some padding)
    task = get_task("countdown")
    problems = task.generate(3, split="test", seed=0)
    policy = _Recording(chat_policy(seed=2, chat_template=True))
    whole, mask = encode_prompts(policy.tokenizer, [p.prompt for p in problems], chat_template=True)  # (3, P)
    N = 12
    assert whole.size(1) > N and (mask.sum(1) > N).any()  # a prompt longer than N
    sampling = dataclasses.replace(TrainConfig().rollout, max_prompt_length=N)
    groups = roll_groups(policy, task, problems, group_size=2, sampling=sampling, gen_length=11, tag="t",
                         shards=_one_process())
    assert torch.equal(groups.prompt_ids, whole[:, -N:].repeat_interleave(2, 0))
    assert torch.equal(groups.prompt_mask, mask[:, -N:].repeat_interleave(2, 0))
    policy.inputs.clear()
    evaluate(policy, task, problems, SamplingConfig(gen_length=11, max_prompt_length=N), progress=False)
    assert torch.equal(policy.inputs[0][:, :N], whole[:, -N:])
    with pytest.raises(ValueError, match="max_prompt_length"):
        SamplingConfig(max_prompt_length=0)


# --- stop tokens ------------------------------------------------------------------------


def test_stop_tokens_by_text_or_id_join_eos_and_bad_ones_are_refused():
    tok = build_char_tokenizer()
    plus, star = tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("*")
    policy = TinyPolicy(make_tiny_policy().model, tok, stop_tokens=("+", star, tok.eos_token_id))
    assert policy.stop_token_ids == (tok.eos_token_id, plus, star, tok.pad_token_id)  # PAD ends one too
    with pytest.raises(ValueError, match=r"'\+\+' is not one token"):
        TinyPolicy(make_tiny_policy().model, tok, stop_tokens=("++",))
    with pytest.raises(ValueError, match="'<|eot_id|>' is not one token"):
        TinyPolicy(make_tiny_policy().model, tok, stop_tokens=("<|eot_id|>",))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        TinyPolicy(make_tiny_policy().model, tok, stop_tokens=(10_000,))
    with pytest.raises(ValueError, match="is one of the stop tokens"):
        TinyPolicy(make_tiny_policy().model, tok, stop_tokens=("[MASK]",))
    chat = chat_policy(stop_tokens=("<|end|>",))  # a special token by its text
    assert chat.stop_token_ids[1] == chat.tokenizer.convert_tokens_to_ids("<|end|>")


def test_decoding_cuts_at_the_first_of_any_stop_token():
    tok = build_char_tokenizer()
    plus = tok.convert_tokens_to_ids("+")
    row = tok.encode("12*3+4", add_special_tokens=False) + [tok.eos_token_id, tok.pad_token_id]
    ids = torch.tensor([row, tok.encode("5-6", add_special_tokens=False) + [plus] + [tok.pad_token_id] * 4])
    assert decode_completions(tok, ids) == ["12*3+4", "5-6+"]  # EOS alone by default
    assert decode_completions(tok, ids, [tok.eos_token_id, plus]) == ["12*3", "5-6"]
    policy = TinyPolicy(make_tiny_policy().model, tok, stop_tokens=("+",))
    assert decode_policy_completions(policy, ids) == ["12*3", "5-6"]


class _Boost:
    """`policy` with the logit of token `token` raised by `by`."""

    def __init__(self, policy, token: int, by: float):
        self._policy, self._token, self._by = policy, token, by

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def logits(self, *args, **kwargs):
        out = self._policy.logits(*args, **kwargs).clone()
        out[..., self._token] += self._by
        return out


def test_the_sampler_ends_a_completion_at_an_added_stop_token():
    tok = build_char_tokenizer()
    plus = tok.convert_tokens_to_ids("+")
    tiny = make_tiny_policy(seed=3)
    policy = _Boost(TinyPolicy(tiny.model, tok, stop_tokens=("+",)), plus, 3.0)
    ids, mask = encode_policy_prompts(policy, ["3,5,7=22", "12,4,6=9", "1=1"])
    out = generate(policy, ids, mask, SamplingConfig(gen_length=9, temperature=1.0),
                   generator=torch.Generator().manual_seed(0))
    ended = 0
    for row, m in zip(out.completion_ids.tolist(), out.completion_mask.tolist()):
        if plus in row:  # '+' now ends the completion: PAD after it, and it is the last scored slot
            first = row.index(plus)
            assert row[first + 1:] == [tok.pad_token_id] * (len(row) - first - 1)
            assert m == [True] * (first + 1) + [False] * (len(row) - first - 1)
            ended += 1
    assert ended >= 2  # the boost makes '+' likely: the rule was exercised
    plain = generate(_Boost(tiny, plus, 3.0), ids, mask, SamplingConfig(gen_length=9, temperature=1.0),
                     generator=torch.Generator().manual_seed(0))
    assert any(r.count(plus) > 1 for r in plain.completion_ids.tolist())  # without the setting '+' goes on


def _bert_dir(path: Path) -> Path:
    tok = chat_tokenizer()
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=64,
                               pad_token_id=tok.pad_token_id)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_an_adapter_policy_saves_its_template_switch_and_stop_tokens(tmp_path):
    # A run's final model must encode and stop as the run did.
    base = _bert_dir(tmp_path / "bert")
    assert load_policy(ModelConfig(path=str(base), adapter="masked_lm")).chat_template is True
    policy = load_policy(ModelConfig(path=str(base), adapter="masked_lm", chat_template=False,
                                     stop_tokens=["<|end|>", 9]))
    end = policy.tokenizer.convert_tokens_to_ids("<|end|>")
    assert policy.chat_template is False and policy.stop_token_ids == (policy.eos_token_id, end, 9, policy.pad_token_id)
    policy.save(tmp_path / "final")
    again = load_policy(tmp_path / "final")
    assert again.chat_template is False and again.stop_token_ids == policy.stop_token_ids
    assert load_policy(ModelConfig(path=str(tmp_path / "final"), chat_template=True)).chat_template is True


# --- settings and the command line --------------------------------------------------------


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("off", False), ("on", True), ("false", False)])
def test_yaml_on_and_off_read_as_the_switch(value, expected):
    assert load_config(TrainConfig, None, [f"model.chat_template={value}"]).model.chat_template == expected


@pytest.mark.parametrize("override, message", [
    ("model.chat_template=always", "config field 'model.chat_template': expected bool or one of 'auto'"),
    ("model.stop_tokens=[-1]", "model.stop_tokens: -1 is neither a token id"),
    ("model.stop_tokens=['']", "model.stop_tokens: '' is neither"),
    ("model.stop_tokens=[true]", "model.stop_tokens: True is neither"),
    ("model.stop_tokens=<|eot_id|>", "expected a list, got '<|eot_id|>'; write ['<|eot_id|>']"),
])
def test_bad_prompt_settings_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, None, [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_command_line_switches_the_template_and_adds_stop_tokens(tmp_path, capsys):
    chat_policy(seed=4).save(tmp_path / "m")
    args = ["sample", "--model", str(tmp_path / "m"), "--prompt", "3,5,7=22", "--temperature", "1.0",
            "--num-samples", "4", "--gen-length", "9"]
    star = build_char_tokenizer().convert_tokens_to_ids("*")
    assert main(args) == 0
    texts = [line.split("\t")[1] for line in capsys.readouterr().out.strip().splitlines()]
    assert any("+" in t or "*" in t for t in texts)  # without stop tokens these completions go on past them
    assert main(args + ["--stop-token", "+", "--stop-token", str(star)]) == 0  # by text and by id
    texts = [line.split("\t")[1] for line in capsys.readouterr().out.strip().splitlines()]
    assert len(texts) == 4 and not any("+" in t or "*" in t for t in texts)
    assert main(["sample", "--model", str(ROOT / "checkpoints" / "countdown-tiny"), "--prompt", "1=1",
                 "--chat-template", "on"]) == 2
    assert "no chat template" in capsys.readouterr().err
