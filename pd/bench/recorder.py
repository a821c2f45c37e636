"""The per-request recorder of SGLang's native ``/generate`` stream, keyed on token counts.

SGLang's own (``sglang.benchmark.serving.async_request_sglang_generate``) takes the first token's time at the
first chunk whose ``text`` is not empty, and skips empty-text chunks. A token that decodes to no text yet
(a byte of an incomplete UTF-8 character: every byte-level tokenizer, builtin:tiny's ByT5 included, and
byte-fallback BPE) then delays the TTFT to a later token, and a short answer of such tokens gets TTFT 0.
Measured on builtin:tiny (benchmarks/results/serving_compare.md): most first tokens are such bytes. This
recorder reads ``meta_info.completion_tokens`` instead (every SGLang stream chunk has it), so the first
token is the first chunk that carries one, and each gap is split over the tokens that chunk added, as
SGLang splits it. Same request body, same session per request, same ``RequestFuncOutput``; where every
chunk has text the two record the same times.

The OpenAI backends keep SGLang's recorders (an OpenAI chunk carries no token count).
"""

from __future__ import annotations

import sys
import time
import traceback

import orjson

from pd.bench.config import BenchConfig
from pd.bench.sglang_serving import serving


def native_request_func(cfg: BenchConfig):
    """A request function for ``/generate`` with ``cfg``'s sampling settings, called as SGLang's are:
    ``await f(request_func_input=..., pbar=None) -> RequestFuncOutput`` (seconds; never raises for a failed
    request: ``success`` False and ``error`` say why)."""
    mod = serving()

    async def request(request_func_input, pbar=None):
        inp = request_func_input
        sampling = {"temperature": cfg.temperature, "max_new_tokens": inp.output_len,
                    "ignore_eos": not cfg.disable_ignore_eos}
        if cfg.top_p < 1.0:
            sampling["top_p"] = cfg.top_p
        payload = {("text" if isinstance(inp.prompt, str) else "input_ids"): inp.prompt,
                   "sampling_params": sampling, "stream": not cfg.disable_stream, **inp.extra_request_body}
        out = mod.RequestFuncOutput.init_new(inp)
        async with mod._create_bench_client_session() as session:
            st = time.perf_counter()
            out.start_time = last = st
            seen = 0
            try:
                async with session.post(url=inp.api_url, json=payload, headers=mod.get_auth_headers()) as resp:
                    if resp.status != 200:
                        out.error = f"{resp.reason or ''}: {await resp.text()}"
                        return out
                    async for line in resp.content:
                        line = line.strip()
                        if not line:
                            continue
                        data = line[6:] if line.startswith(b"data: ") else line
                        if data == b"[DONE]":
                            continue
                        chunk = orjson.loads(data)
                        now = time.perf_counter()
                        out.latency = now - st
                        meta = chunk.get("meta_info") or {}
                        if "error" in chunk and not meta:
                            out.error = str(chunk["error"])
                            return out
                        if meta.get("prompt_tokens"):
                            out.prompt_len = meta["prompt_tokens"]
                        tokens = int(meta.get("completion_tokens", len(chunk.get("output_ids") or ())))
                        out.generated_text = chunk.get("text", out.generated_text)
                        if tokens > seen:
                            if seen == 0:
                                out.ttft = now - st
                            else:
                                gap = (now - last) / (tokens - seen)
                                out.itl.extend([gap] * (tokens - seen))
                            seen, last = tokens, now
                    out.output_len = seen
                    out.success = seen > 0
                    if not out.success:
                        out.error = "the stream ended without a token"
            except Exception:  # a broken connection, bad JSON: the request failed, the run goes on (as SGLang's)
                out.success = False
                out.error = "".join(traceback.format_exception(*sys.exc_info()))
        if pbar is not None:
            pbar.update(1)
        return out

    return request

