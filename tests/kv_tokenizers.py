"""Fast Hugging Face tokenizers built in-process for the kv_aware tests (no download): a character-level one, a
GPT-2-style byte-level BPE and a Llama-style SentencePiece BPE (``Metaspace``, no pre-split), each trained on this
repo's docs, with special tokens a chat template writes."""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parent.parent
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def corpus() -> list[str]:
    """Lines of the repo's docs and a slice of its code: words, punctuation, digits, indentation, unicode."""
    lines: list[str] = []
    for path in sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "router").glob("kv_*.py")):
        lines += path.read_text().splitlines()
    return lines


def _wrap(tk: Tokenizer, bos: bool) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>" if bos else None, eos_token="</s>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHATML
    return tok


@functools.cache
def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, id = its code point (ASCII); no BOS."""
    tk = Tokenizer(models.WordLevel({chr(i): i for i in range(32, 127)} | {"\n": 10, "<unk>": 0}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return _wrap(tk, bos=False)


@functools.cache
def byte_level_bpe() -> PreTrainedTokenizerFast:
    """GPT-2-style: byte-level pre-tokenizer (its regex splits words, spaces, digits), BPE of 4000 tokens; BOS."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=4000, special_tokens=SPECIALS,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _wrap(tk, bos=True)


@functools.cache
def metaspace_bpe() -> PreTrainedTokenizerFast:
    """Llama/SentencePiece-style: spaces become U+2581, one prepended, BPE over the whole text (no pre-split, so
    merges may reach across words), byte fallback off; BOS."""
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=False)
    tk.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tk.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=4000, special_tokens=["<unk>", *SPECIALS]))
    return _wrap(tk, bos=True)
