"""Caps on one generation request of the reference engine: ``--max-n``, ``--max-batch-size`` and
``--max-sequences-per-request`` (the router's names and defaults, pd.router.config; SGLang has no such
caps). A request over one gets 400 naming the cap and its flag before any prompt is tokenized, so one
small request cannot make the engine tokenize thousands of prompts or allocate KV for them. The body
size cap is ``--max-body-bytes`` (pd.engines.api.server.read_json: 413).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pd.engines.errors import bad_request
from pd.util import request_caps as caps

if TYPE_CHECKING:
    from pd.engines.settings import EngineSettings


@dataclass(frozen=True)
class RequestLimits:
    """The caps (defaults: pd.util.request_caps, the router's too)."""

    max_n: int = caps.MAX_N
    max_batch_size: int = caps.MAX_BATCH_SIZE
    max_sequences_per_request: int = caps.MAX_SEQUENCES_PER_REQUEST

    @classmethod
    def from_args(cls, args: EngineSettings) -> "RequestLimits":
        """The caps of an engine's settings (pd.engines.settings)."""
        return cls(args.max_n, args.max_batch_size, args.max_sequences_per_request)

    def check(self, prompts: int, n: int, n_param: str, batch_param: str) -> None:
        """Check a request of ``prompts`` prompts x ``n`` samples.

        Args:
            n_param / batch_param: the request fields of ``n`` and of the prompts, for the error.

        Raises:
            EngineError: 400 over a cap: ``n``, then the batch size, then prompts x n.
        """
        if n > self.max_n:
            raise bad_request(f"{n_param} = {n} is over the engine's limit of {self.max_n} (--max-n)", n_param)
        if prompts > self.max_batch_size:
            raise bad_request(f"a batch of {prompts} prompts is over the engine's limit of {self.max_batch_size} "
                              "(--max-batch-size)", batch_param)
        if prompts * n > self.max_sequences_per_request:
            raise bad_request(f"{prompts} prompts x n = {n} make {prompts * n} sequences, over the engine's limit "
                              f"of {self.max_sequences_per_request} (--max-sequences-per-request)", n_param)

    def check_generate(self, req) -> None:
        """Check a parsed /generate request (pd.engines.protocol.GenerateRequest): prompts from a list
        ``text`` or a list of ``input_ids`` lists, ``n`` from ``sampling_params`` (the largest, where a
        list disagrees: generate_api refuses that later). Raises EngineError 400 as ``check``."""
        batch = req.text if req.text is not None else req.input_ids
        is_batch = isinstance(batch, list) and (req.text is not None or bool(batch) and isinstance(batch[0], list))
        params = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params or {}]
        ns = [p.get("n", 1) for p in params if isinstance(p, dict)]
        n = max((x for x in ns if isinstance(x, int) and not isinstance(x, bool)), default=1)
        field = "text" if req.text is not None else "input_ids"
        self.check(len(batch) if is_batch else 1, n, "sampling_params.n", field)

    def check_completion(self, req) -> None:
        """Check a parsed /v1/completions request: a list of strings or of token-id lists is a batch."""
        p = req.prompt
        is_batch = isinstance(p, list) and bool(p) and not isinstance(p[0], int)
        self.check(len(p) if is_batch else 1, req.n, "n", "prompt")

    def check_chat(self, req) -> None:
        """Check a parsed /v1/chat/completions request (one prompt, ``n`` samples)."""
        self.check(1, req.n, "n", "messages")
