"""The workers' tokenizer as the ``kv_aware`` policy (pd.router.kv_aware) uses it: a prompt's token ids as the
engines compute them, found lazily, only as far as routing asks.

Why lazy: tokenizing a 1000-token prompt whole costs about 1 ms with Mistral 7B's fast tokenizer, five times the
router's whole CPU per request under ``round_robin`` (the policy that did so cost 16x round_robin's CPU per request
on a prefix-free workload, benchmarks/results/kv_router_cpu.md), and a prompt that no worker holds needs only its
first page to be ranked. ``LazyPrompt`` tokenizes a leading chunk of the text and tokenizes a four times longer
one only when the policy asks for a page past the tokens it trusts: a prompt's cost grows with how much of it some
worker holds, and a prefix-free prompt costs one small chunk (or nothing: pd.router.kv_aware places a prompt it
has no reason to look up untokenized).

A cut's token boundaries: tokenizing ``text[:cut]`` may end differently from tokenizing ``text`` (a word cut in
two, a space a pre-tokenizer attaches to the next word, a special token split, BPE merges across the cut). Only
tokens that end ``margin`` characters or more before the cut are trusted (the fast tokenizer's offset mapping);
tests/test_kv_tokenizer.py checks that the pages found this way equal the whole prompt's on varied texts and
tokenizers. A tokenizer without offsets (a Python "slow" tokenizer, e.g. ByT5's of ``builtin:tiny``) tokenizes
the whole prompt, as before.

The engines' way (pd.engines.models.model_runner, as SGLang's tokenizer manager): a text prompt is the BOS id,
when the tokenizer has one, then ``encode(text, add_special_tokens=False)``; a chat prompt is the chat template
rendered with ``add_generation_prompt=True`` over the messages' roles and text contents, then encoded the same way
without a BOS (the template writes its own).

Repeated prefixes: chunks are cut at fixed character positions (``first_cut x 4^k``), so requests that share a
system prompt share their chunks' text; a chunk that led to a longer one (some worker held its pages) is kept
in an LRU of ``cache_size`` entries keyed by its text, and whole prompts likewise.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

MARGIN_CHARS = 32  # tokens ending closer than this to a cut are not trusted (more for long special tokens)
GROWTH = 4  # each further chunk is this many times longer
_SAMPLE = ("The router reads each prefill's events and hashes the prompt's pages as the engines do, so a request "
           "goes where its prefix is cached. ")  # text whose characters per token size the first chunk


class PromptTokenizer:
    """Token ids of prompts with a Hugging Face tokenizer, whole or a leading part.

    Args:
        tok: a ``transformers`` tokenizer (``AutoTokenizer.from_pretrained``).
        cache_size: chunks and whole prompts whose ids are kept (least recently used out); 0 keeps none.
    """

    def __init__(self, tok, cache_size: int):
        self._tok = tok
        bos = tok.bos_token_id
        self.bos: list[int] = [bos] if bos is not None else []
        backend = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
        self._backend = backend  # a ``tokenizers.Tokenizer``: ids and offsets in one call
        longest = max((len(t) for t in getattr(tok, "added_tokens_encoder", {})), default=0)
        self.margin = max(MARGIN_CHARS, 2 * longest)
        n = len(self.encode(_SAMPLE * 4)) or 1
        self.chars_per_token = len(_SAMPLE) * 4 / n
        self.cache_size = cache_size
        self._cache: OrderedDict[str, tuple[list[int], bool]] = OrderedDict()
        self._render = _template_renderer(tok)

    @property
    def has_chat_template(self) -> bool:
        """Whether chat prompts can be rendered."""
        return self._render is not None

    @property
    def lazy(self) -> bool:
        """Whether prompts are tokenized a chunk at a time (the tokenizer gives offsets)."""
        return self._backend is not None

    def encode(self, text: str) -> list[int]:
        """``text``'s ids as the engines encode it, without the BOS (``add_special_tokens=False``)."""
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self._tok.encode(text, add_special_tokens=False))

    def first_cut(self, tokens: int) -> int:
        """Characters of the first chunk, for ``tokens`` trusted tokens on text like the sample."""
        return int(tokens * self.chars_per_token * 1.1) + self.margin

    def prefix(self, text: str, cut: int) -> tuple[list[int], bool]:
        """The ids (no BOS) that tokenizing ``text[:cut]`` gives as tokenizing ``text`` would, and whether they
        are all of ``text``'s (from the cache when this chunk was kept).

        Args:
            cut: characters tokenized; at or past ``len(text)`` (or without offsets) the whole text.
        """
        whole = cut >= len(text) or self._backend is None
        key = text if whole else text[:cut]
        got = self._cache.get(key)
        if got is not None:
            self._cache.move_to_end(key)
            return got
        if whole:
            return self.encode(text), True
        enc = self._backend.encode(key, add_special_tokens=False)  # type: ignore[union-attr]
        limit = cut - self.margin
        if limit <= 0:
            return [], False
        n = enc.char_to_token(limit)  # the first token reaching the limit (one call, not the offsets list)
        if n is None:  # the character at the limit became no token (a normalizer dropped it): by offsets
            n = 0
            for _, end in enc.offsets:
                if end > limit:
                    break
                n += 1
        return enc.ids[:n], False

    def keep(self, text: str, cut: int, got: tuple[list[int], bool]) -> None:
        """Cache ``prefix(text, cut)``'s answer ``got`` (a prefix seen again)."""
        if self.cache_size:
            key = text if cut >= len(text) or self._backend is None else text[:cut]
            self._cache[key] = got
            self._cache.move_to_end(key)
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def chat_text(self, messages: list[dict]) -> str:
        """The chat prompt's text: the chat template over ``[{"role", "content"}]`` with the generation prompt.

        Raises:
            ValueError: the tokenizer has no chat template. Jinja errors of the template propagate.
        """
        if self._render is None:
            raise ValueError("the tokenizer has no chat template")
        return self._render(messages)


def _template_renderer(tok) -> Optional[Callable[[list[dict]], str]]:
    """What ``tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`` renders for messages
    of string roles and contents: the compiled template called with the same variables (the special tokens, no
    tools or documents), without the per-call preparation that costs ~30 us; None without a template."""
    template = getattr(tok, "chat_template", None)
    if not isinstance(template, str):
        return None
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        compiled = _compile_jinja_template(template)
    except (ImportError, AttributeError):  # another transformers: its own call, slower but the same text
        return lambda messages: tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    variables = dict(tok.special_tokens_map, tools=None, documents=None, add_generation_prompt=True)
    return lambda messages: compiled.render(messages=messages, **variables)


class LazyPrompt:
    """One prompt's token ids, tokenized as far as asked.

    Args:
        keep: cache every chunk (the prompt's start was seen before); else a chunk is kept once a longer one
            follows it.

    Attributes:
        ids: the trusted ids so far (BOS or not, as the engines begin this kind of prompt).
        complete: ``ids`` are the whole prompt's.
    """

    __slots__ = ("tokenizer", "text", "head", "ids", "complete", "_cut", "_body", "_keep")

    def __init__(self, tokenizer: PromptTokenizer, text: str, head: list[int], keep: bool = False):
        self.tokenizer, self.text, self.head, self._keep = tokenizer, text, head, keep
        self.ids: list[int] = list(head)
        self.complete = not text
        self._cut = 0  # characters of the last chunk tokenized (0: none yet)
        self._body: tuple[list[int], bool] = ([], self.complete)  # that chunk's answer

    def ensure(self, tokens: int, first: int) -> None:
        """Have at least ``tokens`` ids, or all of them.

        Args:
            first: tokens the first chunk should cover (its characters are ``first_cut(first)``).
        """
        tok = self.tokenizer
        while not self.complete and len(self.ids) < tokens:
            if self._cut and not self._keep:  # the last chunk led further (a worker holds its pages): keep it
                tok.keep(self.text, self._cut, self._body)
            cut = self._cut * GROWTH if self._cut else tok.first_cut(first)
            self._body = tok.prefix(self.text, cut)
            body, self.complete = self._body
            if self._keep or self._cut or (self.complete and not tok.lazy):  # a repeated prefix, or never lazy
                tok.keep(self.text, cut, self._body)
            self.ids = self.head + body
            self._cut = min(cut, len(self.text))

    def estimate(self) -> int:
        """The prompt's token count: exact once complete, else scaled from the chunk tokenized."""
        if self.complete:
            return len(self.ids)
        known = len(self.ids) - len(self.head)
        per_char = known / max(1, self._cut - self.tokenizer.margin) if known else 1 / self.tokenizer.chars_per_token
        return len(self.head) + max(known + 1, round(len(self.text) * per_char))


def load_tokenizer(path: str, cache_size: int) -> PromptTokenizer:
    """The tokenizer at ``path`` (a directory or a Hugging Face name the host can load) for the router.

    Raises:
        ImportError: transformers is not installed. OSError / ValueError: no tokenizer at ``path``.
    """
    from transformers import AutoTokenizer

    return PromptTokenizer(AutoTokenizer.from_pretrained(path), cache_size)
