"""The ``kv_aware`` policy's view of one request (pd.router.kv_aware): its prompt's pages, hashed and tokenized
only as far as the policy asks, and what the latest decision expects of the chosen prefill."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from pd.router.kv_tokenizer import LazyPrompt, PromptTokenizer
from pd.util.kv_block_hash import page_hashes

if TYPE_CHECKING:
    from pd.router.workers import Worker

log = logging.getLogger("pd.router")


class KvPlan:
    """One request's prompt pages, kept on its routing key (``PromptKey.kv``) across attempts.

    Args:
        ids: the prompt's token ids, when it came as ids.
        tokenizer, text: else what tokenizes it and its text (a ``LazyPrompt`` made when a page is first
            asked for), or with ``messages`` (a chat's (role, text content) pairs) a chat prompt, rendered with the
            chat template only then.
        gate: the prompt's first characters, by which the policy knows a prompt it has not routed before
            (pd.router.kv_aware); None for ids.
        known: whether the policy routed a prompt with the same ``gate`` lately; an unknown prompt is placed
            as a miss without being tokenized.

    Attributes:
        text, messages: as given (a chat's ``text`` is its routing key's, for the length estimate).
        worker: the prefill of the latest decision; ``blocks`` (prompt pages counted in flight there) and
            ``predicted`` (tokens expected from its cache; None when only estimated) belong to it.
        overlaps: url -> (pages, overlap, exact) of the latest pick, until ``picked`` reads it (None then).
    """

    __slots__ = ("_ids", "_prompt", "_tok", "text", "messages", "gate", "known", "_hashes", "overlaps",
                 "worker", "blocks", "predicted")

    def __init__(self, ids: Optional[list[int]] = None, tokenizer: Optional[PromptTokenizer] = None,
                 text: str = "", messages: Optional[tuple[tuple[Any, str], ...]] = None, gate: Optional[str] = None,
                 known: bool = True):
        if (ids is None) == (tokenizer is None):
            raise ValueError("a KvPlan needs token ids or a tokenizer, not both")
        self._ids = ids
        self._prompt: Optional[LazyPrompt] = None
        self._tok, self.text, self.messages = tokenizer, text, messages
        self.gate, self.known = gate, known
        self._hashes: Optional[dict[int, tuple[list[int], Optional[bytes]]]] = None  # size -> (hashes, digest)
        self.overlaps: Optional[dict[str, tuple[int, int, bool]]] = None
        self.worker: Optional[Worker] = None
        self.blocks = 0
        self.predicted: Optional[int] = None

    @property
    def prompt(self) -> Optional[LazyPrompt]:
        """The prompt being tokenized (made on first use; a chat's template rendered then); None for ids. A chat
        the template refuses (the engine will refuse it too) is an empty prompt: no pages, a miss everywhere."""
        tok = self._tok
        if self._prompt is None and tok is not None:
            if self.messages is None:
                self._prompt = LazyPrompt(tok, self.text, tok.bos, keep=self.known)
            else:  # the template writes any BOS itself
                try:
                    text = tok.chat_text([{"role": role, "content": content} for role, content in self.messages])
                except Exception as e:  # a jinja error of the template, raise_exception() included
                    log.debug("kv_aware: the chat template refused a request's messages (%s)", e)
                    text = ""
                self._prompt = LazyPrompt(tok, text, [], keep=self.known)
        return self._prompt

    @property
    def ids(self) -> list[int]:
        """The token ids known so far (all of them once ``complete``)."""
        if self._ids is not None:
            return self._ids
        return self.prompt.ids  # type: ignore[union-attr]

    @property
    def complete(self) -> bool:
        """Whether ``ids`` are the whole prompt's."""
        if self._ids is not None:
            return True
        return self._prompt is not None and self._prompt.complete

    def tokens(self) -> int:
        """The prompt's length in tokens: exact when complete, else estimated from the part tokenized (or from
        its characters before any)."""
        if self._ids is not None:
            return len(self._ids)
        if self._prompt is not None:
            return self._prompt.estimate()
        return max(1, round(len(self.text) / self._tok.chars_per_token))  # type: ignore[union-attr]

    def page(self, block: int, k: int) -> Optional[int]:
        """The hash of page ``k`` (0-based) of ``block`` tokens, tokenizing and hashing only as far as that
        (SHA-256 per page and the tokenizer are the policy's main costs); None past the last whole page."""
        if self._hashes is None:
            self._hashes = {}
        have, last = self._hashes.get(block, ([], None))
        if k < len(have):
            return have[k]
        need = (k + 1) * block
        prompt = self.prompt
        if prompt is not None:
            prompt.ensure(need, block)
        ids = self.ids
        if len(ids) < need:
            return None
        # hash ahead to twice what is known (a match so far is likely to go on), within the ids known
        upto = min(len(ids) // block, max(k + 1, 2 * len(have)))
        more = page_hashes(ids[len(have) * block:upto * block], block, last)
        have = have + [v for _, v in more]
        self._hashes[block] = (have, more[-1][0])
        return have[k]

    def hashed(self, block: int) -> list[int]:
        """The page hashes computed so far."""
        got = self._hashes.get(block) if self._hashes is not None else None
        return got[0] if got is not None else []

    def may_have(self, block: int, pages: int) -> bool:
        """Whether the prompt may have more than ``pages`` whole pages of ``block`` tokens."""
        return not self.complete or len(self.ids) // block > pages
