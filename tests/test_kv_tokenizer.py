"""kv_aware's lazy prompt tokenization (pd.router.kv_tokenizer): the pages it finds a chunk at a time are the
whole prompt's, its chat prompts are the engine's, and a prefix-free prompt costs one small chunk."""

from __future__ import annotations

import random

import pytest

from kv_tokenizers import byte_level_bpe, char_tokenizer, corpus, metaspace_bpe
from pd.router.kv_plan import KvPlan
from pd.router.kv_tokenizer import PromptTokenizer
from pd.util.kv_block_hash import page_hashes

TOKENIZERS = {"char": char_tokenizer, "byte_level_bpe": byte_level_bpe, "metaspace_bpe": metaspace_bpe}
PIECES = ["  ", "   \n", "\n\n", "\t", " 12345", "3.14159", "é", "naïve café", "中文字符", "🙂", "<|im_end|>",
          "<|im_start|>", "</s>", "don't", "—", "x" * 40, " " * 37, "\u2581", "''", "**bold**"]


def texts(n: int, seed: int) -> list[str]:
    """Varied prompts: the docs' lines and words mixed with whitespace runs, digits, accents, CJK, emoji, the
    tokenizers' special tokens and long runs, 10 to 4000 characters."""
    rng = random.Random(seed)
    lines = [ln for ln in corpus() if ln.strip()]
    words = " ".join(lines).split()
    out = []
    for _ in range(n):
        parts, size = [], rng.choice((10, 60, 300, 1200, 4000))
        while sum(map(len, parts)) < size:
            r = rng.random()
            parts.append(rng.choice(lines) + "\n" if r < 0.4 else rng.choice(PIECES) if r < 0.6
                         else " " + rng.choice(words))
        out.append("".join(parts)[:size])
    return out


def whole_hashes(ids: list[int], block: int) -> list[int]:
    return [h for _, h in page_hashes(ids, block)]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_pages_found_a_chunk_at_a_time_are_the_whole_prompts(name):
    """Every page the lazy plan yields, to the last, equals the page of the engine's whole tokenization
    (BOS + ``encode(text, add_special_tokens=False)``), for page sizes 1, 4 and 16."""
    hf = TOKENIZERS[name]()
    tok = PromptTokenizer(hf, 0)
    assert tok.lazy
    for i, text in enumerate(texts(80, seed=len(name))):
        want_ids = ([hf.bos_token_id] if hf.bos_token_id is not None else []) + hf.encode(text,
                                                                                        add_special_tokens=False)
        for block in (1, 4, 16):
            plan = KvPlan(tokenizer=tok, text=text)
            got = []
            while (h := plan.page(block, len(got))) is not None:
                got.append(h)
            assert got == whole_hashes(want_ids, block), (name, i, block, text[:80])
            assert plan.complete and plan.tokens() == len(want_ids)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_prompt_no_worker_holds_costs_one_small_chunk(name):
    """The first page needs the first chunk only (about a page of text and the margin), not the prompt."""
    tok = PromptTokenizer(TOKENIZERS[name](), 0)
    text = texts(1, seed=7)[0] * 4
    plan = KvPlan(tokenizer=tok, text=text)
    assert plan.page(16, 0) is not None
    prompt = plan.prompt
    assert not prompt.complete and prompt._cut == tok.first_cut(16) < 200 and len(plan.hashed(16)) == 1
    assert abs(plan.tokens() - len(tok.encode(text))) < 0.5 * len(tok.encode(text))  # an estimate meanwhile


def test_chunks_of_a_repeated_prefix_come_from_the_cache():
    hf = byte_level_bpe()
    tok = PromptTokenizer(hf, 8)
    calls = []
    backend = tok._backend
    tok._backend = type("Counting", (), {"encode": lambda self, t, **kw: calls.append(len(t)) or backend.encode(
        t, **kw)})()
    system = " ".join(corpus())[:3000]
    for question in ("first question?", "second question?"):
        plan = KvPlan(tokenizer=tok, text=system + question, known=False)
        while plan.page(16, len(plan.hashed(16))) is not None:  # as a walk through held pages asks
            pass
    first = len(calls)
    wholes = [len(system) + len("first question?"), len(system) + len("second question?")]
    assert first == 5 and calls[3:] == wholes  # three chunks once (the second prompt's came from the cache)
    plan = KvPlan(tokenizer=tok, text=system + "third?", known=False)
    plan.page(16, 0)
    assert len(calls) == first  # the first chunk of the system prompt was kept: no tokenizer call


@pytest.mark.parametrize("name", [*TOKENIZERS, "builtin:tiny"])
def test_chat_prompts_render_as_the_engine_renders_them(name, model_cache):
    """``chat_text`` is what the engine's ``apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True)`` gives (pd.engines.models.model_runner), without its per-call preparation."""
    if name == "builtin:tiny":
        from transformers import AutoTokenizer

        from pd.engines.models.builtin_model import resolve_model_path

        hf = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny"))
    else:
        hf = TOKENIZERS[name]()
    tok = PromptTokenizer(hf, 0)
    rng = random.Random(3)
    for text in texts(12, seed=11):
        cut = rng.randrange(len(text) + 1)
        messages = [{"role": "system", "content": text[:cut]}, {"role": "user", "content": text[cut:]},
                    {"role": "assistant", "content": "ok"}, {"role": "user", "content": ""}][:rng.randrange(1, 5)]
        assert tok.chat_text(messages) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
