"""What speculative decoding adds to the PD handoff: the draft's KV pages and settings in the decode's
registration, the check that both sides draft alike, and the draft state the prefill ships with the first token.

SGLang's PD does the same: the prefill runs the draft on the prompt and puts its hidden state and top-k draft
tokens in its aux buffer (sglang/srt/disaggregation/utils.py, ``MetadataBuffers``: ``output_hidden_states``,
``output_topk_p``, ``output_topk_index``), and the decode registers the draft's KV pool next to the target's.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

from pd.engines.handoff.bootstrap import Registration, RoomFailed
from pd.engines.handoff.kv_pool import KVPagePool
from pd.engines.sequence import Sequence
from pd.engines.spec.config import SpecConfig
from pd.engines.spec.decoder import SpecDecoder, SpecState


def registration_fields(spec: Optional[SpecDecoder], draft_pool: Optional[KVPagePool],
                        draft_pages: list[int]) -> dict:
    """The registration fields a speculative decode adds: where the draft's KV goes and its settings ({} when
    speculation is off)."""
    if spec is None or draft_pool is None:
        return {}
    return {"draft_page_addrs": [draft_pool.page_addr(p) for p in draft_pages],
            "draft_page_bytes": draft_pool.page_bytes, "draft_layout": asdict(spec.draft.layout),
            "speculative": spec.config.handshake()}


def settings_mismatch(spec: Optional[SpecDecoder], draft_pool: Optional[KVPagePool],
                      reg: Registration) -> Optional[str]:
    """Why the decode's speculative settings differ from this prefill's (both sides must run the same draft with
    the same window), or None."""
    ours = spec.config.handshake() if spec is not None else None
    if reg.speculative != ours:
        mine = spec.config.flags() if spec is not None else "no speculative decoding"
        theirs = "no speculative decoding"
        if reg.speculative is not None:
            try:
                theirs = SpecConfig(**reg.speculative, draft_model_path=None).flags()
            except TypeError:  # keys this side's SpecConfig does not take
                theirs = repr(reg.speculative)
        return (f"speculative settings mismatch: decode has {theirs}, prefill has {mine} (set the same "
                "--speculative-* flags on both sides)")
    if spec is not None and draft_pool is not None and (reg.draft_layout != asdict(spec.draft.layout)
                                                        or reg.draft_page_bytes != draft_pool.page_bytes):
        return (f"draft KV layout mismatch: decode has {reg.draft_layout}, prefill has "
                f"{asdict(spec.draft.layout)} (both sides need the same --speculative-draft-model-path)")
    return None


def first_token_metadata(spec: SpecDecoder, seq: Sequence) -> dict:
    """The draft state the prefill ships with the first token: the last hidden state [hidden] as a list, and
    the draft's top-k probabilities and token ids."""
    state = seq.spec_state
    assert state is not None
    topk_p, topk_index = spec.topk(state)
    return {"hidden": state.hidden.tolist(), "topk_p": topk_p, "topk_index": topk_index}


def restore_state(spec: SpecDecoder, draft_pool: KVPagePool, meta: dict, draft_pages: list[int],
                  n: int) -> SpecState:
    """The decode's draft state for a prompt of ``n`` tokens: the draft's KV read from ``draft_pages`` and the
    prefill's shipped metadata (``meta["spec"]``). Runs on the model thread.

    Raises:
        RoomFailed: the metadata is missing or malformed.
    """
    try:
        sm = meta["spec"]
        cache = spec.draft.import_kv(draft_pool.pages, draft_pages, n)
        return spec.restore(cache, sm["hidden"], sm["topk_index"])
    except (KeyError, TypeError, ValueError) as e:
        raise RoomFailed(f"bad speculative metadata from the prefill: {e}") from None
