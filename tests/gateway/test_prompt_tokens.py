"""PromptTokenizer gives exactly the ids ``tokenizer(text, add_special_tokens=False)`` gives, cached or not.

Real tokenizers: SmolLM2's (the tiny model's), and the Qwen3 and DeepSeek family tokenizers built in
tests/gateway/family_templates.py (special tokens, non-special added markup tokens, CJK-style markers).
The texts mix added tokens with whitespace, digits, accents, CJK and emoji around every cut, rendered
conversations included; each is encoded twice (the second time from the cache). Tokenizers whose pieces
are not independent (an added token that strips the space beside it, Metaspace's prefix on the first
piece only) are recognised and tokenized whole.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rayrl.gateway.prompt_tokens import PromptTokenizer
from tests.gateway.family_templates import deepseek_tokenizer, qwen3_tokenizer

WORDS = ["hello", " world", "  ", "\n", "\n\n", "\t", "123", "4567", " 89", "ünïcödé", "漢字", "🙂", "don't",
         "'s", " it's", "{\"a\": 1}", "<tool_call>", "</think>", "<think>", "a", " ", "x y", "end."]


def _texts(tok, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    added = list(tok.get_added_vocab())
    texts = []
    for _ in range(n):
        parts = [rng.choice(WORDS + added) for _ in range(rng.randint(1, 14))]
        texts.append("".join(parts))
    chat = [{"role": "system", "content": "You are terse. 漢字 🙂"}, {"role": "user", "content": "What is 12 + 30?\n"},
            {"role": "assistant", "content": " 42 "}, {"role": "user", "content": "  and  again\t"}]
    if tok.chat_template:
        texts.append(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    texts += ["", " ", "\n"] + added + [a + a for a in added]
    return texts


def _check(tok, seed: int) -> PromptTokenizer:
    fast = PromptTokenizer(tok)
    for text in _texts(tok, 300, seed) * 2:  # twice: the second pass reads the cache
        assert fast.encode(text).tolist() == tok(text, add_special_tokens=False)["input_ids"], repr(text)
    return fast


@pytest.mark.parametrize("name", ["smollm2", "qwen3", "deepseek"])
def test_the_same_ids_as_the_tokenizer(name, tiny_model_dir):
    tok = {"smollm2": lambda: AutoTokenizer.from_pretrained(tiny_model_dir), "qwen3": qwen3_tokenizer,
           "deepseek": deepseek_tokenizer}[name]()
    fast = _check(tok, seed=len(name))
    assert fast.cached and fast.hits > 0  # these tokenizers cut at their added tokens: pieces are reused


def _wrapped(backend: Tokenizer, special: list[str]) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=backend, additional_special_tokens=special)


def _trained_bpe(pre: object, normalizer: object = None) -> Tokenizer:
    from tokenizers import trainers

    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = pre
    if normalizer is not None:
        bpe.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=["[UNK]"])
    bpe.train_from_iterator([" ".join(WORDS) * 3, "hello world it's 123 end."], trainer)
    return bpe


def test_an_added_token_that_strips_spaces_is_tokenized_whole():
    bpe = _trained_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False))
    bpe.add_special_tokens([AddedToken("<mark>", lstrip=True, rstrip=True)])
    fast = _check(_wrapped(bpe, ["<mark>"]), seed=1)
    assert not fast.cached


def test_metaspace_on_the_first_piece_only_is_tokenized_whole():
    bpe = _trained_bpe(pre_tokenizers.Metaspace(prepend_scheme="first"))
    bpe.add_special_tokens([AddedToken("<mark>")])
    fast = _check(_wrapped(bpe, ["<mark>"]), seed=2)
    assert not fast.cached


def test_a_normalizer_is_tokenized_whole():
    bpe = _trained_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.Lowercase())
    bpe.add_tokens([AddedToken("<Mark>", normalized=True)])
    fast = _check(_wrapped(bpe, []), seed=3)
    assert not fast.cached


def test_the_cache_stays_within_its_size(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    fast = PromptTokenizer(tok, cache_chars=200)
    for i in range(500):
        text = f"<|im_start|>user\nmessage number {i} with some words<|im_end|>\n"
        assert fast.encode(text).tolist() == tok(text, add_special_tokens=False)["input_ids"]
    assert fast._cached_chars <= 200 and len(fast._cache) < 20
