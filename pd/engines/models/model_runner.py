"""Model forward for the reference engine: a Hugging Face causal LM run one sequence at a time.

Sequences are never batched together, so a token's logits do not depend on what else is being
served: a prefill + decode pair and a single ``null``-mode engine compute bit-identical logits
for the same request (the property the PD tests check token for token).
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import Optional, cast

import torch

from pd.engines.models.builtin_model import resolve_model_path

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_level_bpe_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, char -> byte: printable Latin-1 bytes stand for themselves,
    the other bytes for chr(256 + k) in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars = list(keep)
    k = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + k)
            k += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def piece_bytes(piece: Optional[str]) -> Optional[bytes]:
    """The raw bytes a vocabulary piece stands for, or None when it is not a byte-level piece.

    ``<0xHH>`` is a SentencePiece byte piece; otherwise each char is one byte: a char below 256 is
    that byte (ByT5, and the printable bytes of byte-level BPE), a higher one a byte through GPT-2's
    byte-level alphabet.
    """
    if not piece:
        return None
    m = _BYTE_PIECE.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    table = _byte_level_bpe_decoder()
    out = bytearray()
    for ch in piece:
        if ord(ch) < 256:
            out.append(ord(ch))
        elif ch in table:
            out.append(table[ch])
        else:
            return None
    return bytes(out)


def undecodable_token_string(raw: bytes) -> str:
    """``bytes:\\xHH...``: the logprob token string of bytes that are not UTF-8 text on their own."""
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVLayout:
    """Shape of one sequence's KV per token: ``num_layers x 2 (K, V) x num_kv_heads x head_dim``.

    The paged pool stores a page as ``[num_layers, 2, page_size, num_kv_heads, head_dim]``
    contiguous elements of ``dtype`` (see kv_pool.KVPagePool).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        """The KV cache element type as a torch dtype."""
        return DTYPES[self.dtype]

    def bytes_per_token(self) -> int:
        """KV bytes one token takes over all layers: layers x 2 (K and V) x kv heads x head_dim x element size."""
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem


class ModelRunner:
    """Loads a checkpoint and runs prefill / decode forwards with a per-sequence KV cache.

    Args:
        model_path: local Hugging Face checkpoint directory, or ``builtin:tiny``.
        dtype: ``float32`` (default, exact on CPU), ``bfloat16`` or ``float16``.

    Raises:
        ValueError: unknown dtype or built-in name; OSError from transformers for a bad path.
    """

    def __init__(self, model_path: str, dtype: str = "float32"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if dtype not in DTYPES:
            raise ValueError(f"--dtype: {dtype!r} is not one of {sorted(DTYPES)}")
        self.model_path = model_path
        local = resolve_model_path(model_path)
        self.local_path = local  # the checkpoint directory (a client loads the tokenizer from it)
        self.tokenizer = AutoTokenizer.from_pretrained(local)
        self.model = AutoModelForCausalLM.from_pretrained(local, dtype=DTYPES[dtype]).eval()
        cfg = self.model.config
        self.config = cfg
        self.vocab_size = int(cfg.vocab_size)
        self.context_length = int(getattr(cfg, "max_position_embeddings", 2048))
        heads = int(cfg.num_attention_heads)
        self.layout = KVLayout(
            num_layers=int(cfg.num_hidden_layers),
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            dtype=dtype,
        )
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        # transformers 5 renamed the forward argument past_key_values -> cache.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ---- tokenization -------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: BOS prepended when the tokenizer has one, never an EOS appended
        (ByT5's tokenizer would append one)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        bos = self.tokenizer.bos_token_id
        return ([bos] if bos is not None else []) + ids

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat prompt (the template supplies any BOS)."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; incomplete UTF-8 sequences are dropped by the tokenizer."""
        # one id list decodes to one string (transformers' annotation also covers a batch's list)
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """Text of one token id, special tokens kept (for /generate's logprob entries, as SGLang's)."""
        return cast(str, self.tokenizer.decode([token_id], skip_special_tokens=False))  # one list: one string

    def logprob_token(self, token_id: int) -> tuple[str, bytes]:
        """The token string and bytes of one token id in an OpenAI logprob entry.

        A token that decodes to text alone is that text and its UTF-8 bytes. A token that is only
        part of a UTF-8 character (ByT5's bytes 0x80-0xFF, a SentencePiece ``<0x80>`` byte piece, a
        byte-level BPE fragment) decodes to nothing or U+FFFD; it is ``bytes:`` followed by its bytes
        as ``\\xHH`` escapes (``bytes:\\x80``, OpenAI's spelling), with its real bytes, so every
        token id has a distinct, stable string.
        """
        text = self.token_text(token_id)
        if text and "\ufffd" not in text:
            return text, text.encode("utf-8")
        # one id: one piece (or None for an id the vocabulary lacks)
        raw = piece_bytes(cast(Optional[str], self.tokenizer.convert_ids_to_tokens(token_id)))
        if raw is None:
            return text, text.encode("utf-8")
        return undecodable_token_string(raw), raw

    # ---- forward ------------------------------------------------------------------------
    def new_cache(self):
        """An empty transformers DynamicCache for this model."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    @torch.inference_mode()
    def forward(self, ids: list[int], cache) -> torch.Tensor:
        """Run ``ids`` after whatever ``cache`` holds; the cache grows by ``len(ids)`` tokens.

        Returns:
            [len(ids), vocab] float32 logits.
        """
        return self.forward_hidden(ids, cache)[0]

    @torch.inference_mode()
    def forward_hidden(self, ids: list[int], cache) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` that also returns the hidden states an MTP/EAGLE draft reads.

        Returns:
            (logits [len(ids), vocab] float32, hidden [len(ids), hidden_size] float32): the hidden state is
            the last decoder layer's output after the final RMSNorm, the LM head's input (what SGLang's
            LogitsProcessor captures for the draft, ``CaptureHiddenMode``).
        """
        input_ids = torch.tensor([ids], dtype=torch.long)
        out = self.model.model(input_ids=input_ids, use_cache=True, **{self._cache_kw: cache})
        hidden = out.last_hidden_state
        return self.model.lm_head(hidden)[0].float(), hidden[0].float()

    # ---- KV <-> pages -------------------------------------------------------------------
    @staticmethod
    def cache_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each [num_kv_heads, tokens, head_dim]."""
        entry = cache.layers[layer]
        return entry.keys[0], entry.values[0]

    def export_kv(self, cache, pool_pages: torch.Tensor, page_ids: list[int], num_tokens: int,
                  first_page: int = 0) -> None:
        """Copy tokens ``[first_page * page_size, num_tokens)`` of ``cache`` into pool pages
        (:func:`export_cache_kv`)."""
        export_cache_kv(self.layout, cache, pool_pages, page_ids, num_tokens, first_page)

    def import_kv(self, pool_pages: torch.Tensor, page_ids: list[int], num_tokens: int):
        """Build a fresh cache holding ``num_tokens`` tokens read from pool pages (:func:`import_cache_kv`)."""
        return import_cache_kv(self.layout, self.new_cache(), pool_pages, page_ids, num_tokens)


def export_cache_kv(layout: KVLayout, cache, pool_pages: torch.Tensor, page_ids: list[int], num_tokens: int,
                    first_page: int = 0) -> None:
    """Copy tokens ``[first_page * page_size, num_tokens)`` of a transformers cache with ``layout.num_layers``
    layers into pool pages (one indexed copy per layer and K/V; the tail of the last page is left as it was).
    ``first_page`` > 0 skips pages that already hold the prompt's start (a prefix cache hit).

    Args:
        pool_pages: the pool tensor [num_pages, num_layers, 2, page_size, kv_heads, head_dim].
        page_ids: pages holding tokens [i*page_size, (i+1)*page_size) in order.
    """
    page_size = pool_pages.shape[3]
    n_pages = -(-num_tokens // page_size)
    full, rest = divmod(num_tokens, page_size)
    idx = torch.tensor(page_ids[:n_pages], dtype=torch.long)
    start = first_page * page_size
    for layer in range(layout.num_layers):
        for j, x in enumerate(ModelRunner.cache_kv(cache, layer)):
            # [kv_heads, tokens, head_dim] -> [pages, page_size, kv_heads, head_dim]
            if full > first_page:
                heads, _, dim = x.shape
                pool_pages[idx[first_page:full], layer, j] = (
                    x[:, start: full * page_size].reshape(heads, full - first_page, page_size, dim).permute(1, 2, 0, 3)
                )
            if rest:
                pool_pages[page_ids[full], layer, j, :rest] = x[:, full * page_size : num_tokens].transpose(0, 1)


def import_cache_kv(layout: KVLayout, cache, pool_pages: torch.Tensor, page_ids: list[int], num_tokens: int):
    """Fill the empty ``cache`` with ``num_tokens`` tokens read from pool pages (inverse of
    :func:`export_cache_kv`) and return it."""
    page_size = pool_pages.shape[3]
    n_pages = -(-num_tokens // page_size)
    pages = pool_pages[torch.tensor(page_ids[:n_pages], dtype=torch.long)]
    for layer in range(layout.num_layers):
        # [pages, page_size, kv_heads, head_dim] -> [1, kv_heads, tokens, head_dim]
        k = pages[:, layer, 0].reshape(-1, *pages.shape[-2:])[:num_tokens].transpose(0, 1)
        v = pages[:, layer, 1].reshape(-1, *pages.shape[-2:])[:num_tokens].transpose(0, 1)
        cache.update(k.unsqueeze(0).contiguous(), v.unsqueeze(0).contiguous(), layer)
    return cache
