"""A whole ``pdserve bench`` run: find the model and tokenizer, build the requests, warm up, then for each
request rate: read the stage metrics, drive the load, read them again, summarize; write the JSON and the
PNG, also after a Ctrl-C (with what was measured), then re-raise it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import sys
from typing import Optional, Union

import httpx
import numpy as np

from pd.bench import stages as stages_mod
from pd.bench.config import BenchConfig
from pd.bench.datasets import load_requests
from pd.bench.goodput import max_rate_meeting_attainment
from pd.bench.load import LoadState, arrival_offsets, drive
from pd.bench.metrics import columns, summarize
from pd.bench.recorder import native_request_func
from pd.bench.report import table
from pd.bench.sglang_serving import serving, sglang_args
from pd.util.wait import wait_until

INFO_TIMEOUT = 10.0  # seconds for each /v1/models or /model_info request


class BenchError(RuntimeError):
    """The run cannot start (server not answering, no tokenizer, a warm-up that failed); the message says why."""


def _get_json(url: str, headers: dict) -> Optional[dict]:
    try:
        r = httpx.get(url, headers=headers, timeout=INFO_TIMEOUT)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _auth_headers() -> dict:
    """SGLang's benchmark authentication (``get_auth_headers``): ``OPENAI_API_KEY`` as a bearer token, else
    ``API_KEY`` as is; read here too so the readiness check needs no SGLang import."""
    if os.environ.get("OPENAI_API_KEY"):
        return {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
    return {"Authorization": os.environ["API_KEY"]} if os.environ.get("API_KEY") else {}


def wait_ready(cfg: BenchConfig) -> None:
    """Wait up to ``--ready-check-timeout-sec`` for ``GET /v1/models`` to answer 200 (once when it is 0).

    Raises:
        BenchError: it did not.
    """
    url = cfg.url + "/v1/models"

    def ready() -> bool:
        return httpx.get(url, headers=_auth_headers(), timeout=INFO_TIMEOUT).status_code == 200

    try:
        if cfg.ready_check_timeout_sec == 0:
            if ready():
                return
            raise TimeoutError
        wait_until(ready, cfg.ready_check_timeout_sec, interval=0.5, what=f"{url} answering 200",
                   retry=(httpx.HTTPError,))
    except (TimeoutError, httpx.HTTPError):
        raise BenchError(f"{url} did not answer 200 within --ready-check-timeout-sec {cfg.ready_check_timeout_sec:g}"
                         f" (is the server up at --base-url {cfg.url}?)") from None


def _local(path: str) -> str:
    if path.startswith("builtin:"):
        from pd.engines.models.builtin_model import resolve_model_path

        return resolve_model_path(path)
    return path


def resolve_model(cfg: BenchConfig) -> tuple[str, str]:
    """``(model id for OpenAI requests, tokenizer path)``: ``--model`` / ``--tokenizer`` when given, else the
    server's ``/v1/models`` (first id) and ``/model_info`` (``tokenizer_path`` when it is a local
    directory, else ``model_path``).

    Raises:
        BenchError: no tokenizer could be named.
    """
    headers = _auth_headers()
    model_id = cfg.model
    if model_id is None:
        models = _get_json(cfg.url + "/v1/models", headers) or {}
        data = models.get("data") or [{}]
        model_id = data[0].get("id") or "default"
    tok = cfg.tokenizer or cfg.model
    if tok is None:
        info = _get_json(cfg.url + "/model_info", headers) or {}
        path = info.get("tokenizer_path")
        tok = path if path and os.path.isdir(path) else info.get("model_path")
    if not tok:
        raise BenchError("no tokenizer: give --tokenizer DIR (or builtin:NAME); /model_info named none")
    return model_id, tok


def load_tokenizer(name: str):
    """The Hugging Face tokenizer of a local directory or ``builtin:NAME`` (from local files only).

    Raises:
        BenchError: it cannot be loaded without a download.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(_local(name), local_files_only=True)
    except (OSError, ValueError) as e:
        raise BenchError(f"--tokenizer {name!r}: cannot load it from local files (pdserve bench never downloads; "
                         f"give a local directory or builtin:NAME): {e}") from None


def _sglang_settings(cfg: BenchConfig) -> argparse.Namespace:
    """The namespace SGLang's request functions read (its module global ``args``)."""
    return sglang_args(backend=cfg.backend, temperature=cfg.temperature, top_p=cfg.top_p,
                       disable_stream=cfg.disable_stream, disable_ignore_eos=cfg.disable_ignore_eos,
                       dataset_name=cfg.dataset_name, seed=cfg.seed)


async def _warmup(cfg, rows, request_func, api_url, model_id) -> None:
    if cfg.warmup_requests == 0:
        return
    warm = [rows[0]] * cfg.warmup_requests
    short = [serving().DatasetRow(prompt=r.prompt, prompt_len=r.prompt_len, output_len=min(r.output_len, 32))
             for r in warm]
    state = LoadState()
    await drive(short, [0.0] * len(short), request_func, api_url=api_url, model_id=model_id,
                extra_body=cfg.extra_body, max_concurrency=cfg.max_concurrency, timeout_s=cfg.request_timeout_secs,
                state=state)
    outs = [f.output for f in state.finished]
    if not any(o.success for o in outs):
        err = next((o.error for o in outs if o.error), "no answer")
        raise BenchError(f"warm-up failed, no request succeeded against {api_url}: {err.strip()[-800:]}")


def _progress(cfg: BenchConfig, total: int, rate: float):
    if cfg.disable_tqdm:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"rate {'inf' if math.isinf(rate) else f'{rate:g}'}", unit="req", file=sys.stderr)


def run_bench(args: Union[argparse.Namespace, BenchConfig], *, quiet: bool = False) -> dict:
    """Run the benchmark ``args`` describes (see pd.bench's docstring for the result's fields).

    Args:
        args: a :class:`BenchConfig` or a namespace of its fields (``pdserve bench``'s parsed flags).
        quiet: print no summary table (the progress bar follows ``disable_tqdm``).

    Returns:
        The result dict, as written to ``--output-file``.

    Raises:
        ValueError: a bad setting (the message names the flag).
        BenchError: the run could not start.
        KeyboardInterrupt: after writing the results measured until the interrupt.
    """
    cfg = args if isinstance(args, BenchConfig) else BenchConfig.from_namespace(args)
    wait_ready(cfg)
    mod = serving()
    model_id, tok_name = resolve_model(cfg)
    tokenizer = load_tokenizer(tok_name)
    rows = load_requests(cfg, tokenizer)
    mod.set_global_args(_sglang_settings(cfg))
    # SGLang's native recorder times the first token at the first non-empty text (pd.bench.recorder says why).
    request_func = (native_request_func(cfg) if cfg.backend in ("sglang", "sglang-native")
                    else mod.ASYNC_REQUEST_FUNCS[cfg.backend])
    api_url = cfg.url + mod._BACKEND_API_PATHS[cfg.backend]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "base_url": cfg.url, "backend": cfg.backend, "model_id": model_id, "tokenizer": tok_name,
        "dataset_name": cfg.dataset_name, "num_prompts": cfg.num_prompts,
        "slo_attainment_target": cfg.slo_attainment_target, "config": cfg.to_dict(),
        "runs": [], "interrupted": False,
    }
    plot_columns: list[dict] = []
    interrupt: Optional[BaseException] = None
    try:
        asyncio.run(_warmup(cfg, rows, request_func, api_url, model_id))
        targets = None if cfg.disable_stage_breakdown else asyncio.run(_discover(cfg))
        for i, rate in enumerate(cfg.request_rate):
            offsets = arrival_offsets(len(rows), rate, cfg.arrival_process, np.random.default_rng([cfg.seed, i]))
            state, before = LoadState(), None
            bar = _progress(cfg, len(rows), rate)
            try:
                before = asyncio.run(_snapshot(targets)) if targets else None
                asyncio.run(drive(rows, offsets, request_func, api_url=api_url, model_id=model_id,
                                  extra_body=cfg.extra_body, max_concurrency=cfg.max_concurrency,
                                  timeout_s=cfg.request_timeout_secs, state=state, progress=bar))
            except KeyboardInterrupt as e:
                interrupt = e
            finally:
                if bar is not None:
                    bar.close()
            run = summarize(cfg, rows, state, rate, tokenizer, interrupted=interrupt is not None)
            done = sorted(state.finished, key=lambda f: f.index)
            plot_columns.append(columns(done, [f.output.output_len if f.output.success else 0 for f in done]))
            if targets is not None and before is not None:
                run["stages"] = stages_mod.breakdown(before, asyncio.run(_snapshot(targets)), targets)
            result["runs"].append(run)
            if interrupt is not None:
                break
    except KeyboardInterrupt as e:  # during warm-up or a snapshot: nothing more to measure
        interrupt = e
    result["interrupted"] = interrupt is not None
    _sweep_goodput(cfg, result)
    _write(cfg, result, plot_columns, quiet)
    if interrupt is not None:
        raise interrupt
    return result


async def _discover(cfg: BenchConfig):
    async with httpx.AsyncClient() as client:
        return await stages_mod.discover(client, cfg.url, cfg.admin_api_key)


async def _snapshot(targets):
    async with httpx.AsyncClient() as client:
        return await stages_mod.snapshot(client, targets)


def _sweep_goodput(cfg: BenchConfig, result: dict) -> None:
    runs = [r for r in result["runs"] if "slo_attainment" in r and not r["interrupted"]]
    if cfg.slo_ttft_ms is None and cfg.slo_tpot_ms is None:
        return
    rates = [math.inf if r["request_rate"] == "inf" else r["request_rate"] for r in runs]
    best = max_rate_meeting_attainment(rates, [r["slo_attainment"] for r in runs], cfg.slo_attainment_target)
    result["max_request_rate_meeting_slo"] = "inf" if best is not None and math.isinf(best) else best


PNG_EXTRA = "pdserve[monitoring]"  # the extra that brings matplotlib (pyproject.toml)


def _write_plot(cfg: BenchConfig, plot: str, result: dict, plot_columns: list[dict]) -> None:
    """Draw the PNG to ``plot`` and name it in ``result``; without matplotlib, skip it with a one-line note on
    stderr naming the extra that adds it (the JSON is written all the same)."""
    from pd.bench.plots import write_png

    os.makedirs(os.path.dirname(os.path.abspath(plot)), exist_ok=True)
    title = f"pdserve bench: {cfg.backend} {cfg.url}, {cfg.dataset_name}, {cfg.num_prompts} requests per rate"
    try:
        write_png(plot, result["runs"], plot_columns, cfg.slo_ttft_ms, cfg.slo_tpot_ms, cfg.slo_attainment_target,
                  title)
    except ImportError as e:
        if (e.name or "").split(".")[0] != "matplotlib":
            raise
        print(f"pdserve bench: no plot {plot}: matplotlib is not installed (pip install '{PNG_EXTRA}')",
              file=sys.stderr, flush=True)
        return
    result["plot_file"] = plot


def _write(cfg: BenchConfig, result: dict, plot_columns: list[dict], quiet: bool) -> None:
    plot = cfg.plot_file or (os.path.splitext(cfg.output_file)[0] + ".png" if cfg.output_file else None)
    if plot and any(r["completed"] for r in result["runs"]):
        _write_plot(cfg, plot, result, plot_columns)
    if cfg.output_file:
        result["output_file"] = cfg.output_file
        os.makedirs(os.path.dirname(os.path.abspath(cfg.output_file)), exist_ok=True)
        if cfg.output_file.endswith(".jsonl"):  # SGLang's format: one line per rate, appended
            with open(cfg.output_file, "a") as f:
                for run in result["runs"]:
                    f.write(json.dumps(run) + "\n")
        else:
            with open(cfg.output_file, "w") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
    if not quiet:
        print(table(result))
        for name in ("output_file", "plot_file"):
            if name in result:
                print(f"{name.replace('_', ' ')}: {result[name]}")
