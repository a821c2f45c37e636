"""Requests a PD pair cannot answer as asked, refused with a 400 naming the field before any worker is touched.

A field that would be accepted and then quietly dropped or answered wrong is worse than a clear refusal: the
client cannot tell. Each rule says why the pair cannot serve it.
"""

from __future__ import annotations

from typing import Optional

from pd.router.admission import OverLimit
from pd.router.jsonio import truthy


def check(route: str, body: dict) -> Optional[OverLimit]:
    """None when ``body`` (a JSON object) can be served on ``route``, else the reason and the field.

    - ``/v1/completions`` with ``echo`` and ``logprobs``: the echoed prompt's logprobs. SGLang's OpenAI layer
      reads them from the worker's own ``meta_info.input_token_logprobs`` (serving_completions.py, which also
      only warns that echo with logprobs is unsupported); in PD only the prefill runs the prompt, so the
      decode that answers has none, and the router cannot graft the prefill's into an OpenAI answer whose
      token offsets it never saw. ``/generate`` with ``return_logprob`` and ``logprob_start_len: 0`` returns
      them (the router merges the prefill's lists, pd.router.logprobs).
    """
    if route == "/v1/completions" and truthy(body.get("echo")) and body.get("logprobs") is not None \
            and body.get("logprobs") is not False:
        return OverLimit("echo with logprobs is not supported by a PD pair (only the prefill sees the prompt): "
                         "for the prompt's logprobs use /generate with return_logprob and logprob_start_len 0",
                         "echo")
    return None
