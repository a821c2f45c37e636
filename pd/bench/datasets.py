"""The requests of a benchmark run: ``sharegpt`` through SGLang's own ShareGPT sampler, ``random`` /
``random-ids`` generated here.

What SGLang's benchmark lacks and this file adds: log-normal lengths (served traffic is heavy-tailed;
DistServe and Splitwise fit their traces so), a prefix shared by a group of prompts (to exercise cache-aware
routing), and random prompts that never need a download (SGLang's ``random`` draws its text from the
ShareGPT file it downloads; here both random names draw token ids from the tokenizer's vocabulary, keeping
ids whose text encodes back to the same one id, so a text prompt has the intended length in the server's
tokenizer too). Uniform lengths are SGLang's (``compute_random_lens``: ``[len x ratio, len]``).

With no ``--dataset-path``, ``sharegpt`` reads the synthetic ShareGPT-format file shipped in
``pd/bench/data/`` (written by ``benchmarks/make_sharegpt_dataset.py``; no download, ever).
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import numpy as np

from pd.bench.config import BenchConfig
from pd.bench.sglang_serving import serving

SHIPPED_SHAREGPT = Path(__file__).resolve().parent / "data" / "sharegpt_synthetic.json"
# How many vocabulary ids to test for the text round trip (a 150k vocabulary costs ~2 s to test whole).
_VOCAB_SAMPLE = 4096


def lengths(dist: str, length: int, n: int, range_ratio: float, sigma: float, rng: np.random.Generator) -> list[int]:
    """``n`` token lengths of distribution ``dist`` (ints >= 1).

    - ``fixed``: ``length`` each;
    - ``uniform``: SGLang's ``compute_random_lens``, uniform integers in ``[max(1, length x range_ratio), length]``
      (it draws from numpy's global generator, seeded by the run);
    - ``lognormal``: mean ``length`` (``mu = ln(length) - sigma^2 / 2``), rounded, clipped to ``[1, 16 x length]``.

    Raises:
        ValueError: an unknown ``dist``.
    """
    if dist == "fixed":
        return [length] * n
    if dist == "uniform":
        return _uniform(length, range_ratio, n)
    if dist == "lognormal":
        mu = math.log(length) - sigma * sigma / 2
        draws = rng.lognormal(mu, sigma, n)
        return [int(min(max(round(x), 1), 16 * length)) for x in draws]
    raise ValueError(f"unknown length distribution {dist!r}")


def _uniform(length: int, range_ratio: float, n: int) -> list[int]:
    serving()  # SGLang's benchmark package, imported with its stand-ins
    from sglang.benchmark.datasets.common import compute_random_lens

    return [int(x) for x in compute_random_lens(length, range_ratio, n)]


def round_trip_ids(tokenizer, rng: np.random.Generator) -> list[int]:
    """Vocabulary ids (sorted) that are not special and whose decoded text encodes back to exactly that id.

    Raises:
        ValueError: the tokenizer has no such id.
    """
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = sorted(i for i in tokenizer.get_vocab().values() if isinstance(i, int) and i not in special)
    if len(vocab) > _VOCAB_SAMPLE:
        vocab = sorted(rng.choice(vocab, _VOCAB_SAMPLE, replace=False).tolist())
    ok = [i for i in vocab if tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False) == [i]]
    if not ok:
        raise ValueError("the tokenizer has no token whose text encodes back to itself: use --tokenize-prompt")
    return ok


def random_requests(cfg: BenchConfig, tokenizer) -> list:
    """``cfg.num_prompts`` random prompts (SGLang ``DatasetRow``s) of the configured lengths, with a shared
    prefix of ``round(random_shared_prefix_ratio x random_input_len)`` tokens per group (at most the prompt's
    length - 1), groups assigned round-robin."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_prompts
    in_lens = lengths(cfg.random_input_dist, cfg.random_input_len, n, cfg.random_range_ratio,
                      cfg.random_lognormal_sigma, rng)
    out_lens = lengths(cfg.random_output_dist, cfg.random_output_len, n, cfg.random_range_ratio,
                       cfg.random_lognormal_sigma, rng)
    text = not cfg.tokenize_prompt
    if text:
        # The server adds its special tokens (BOS) to a text prompt, as SGLang's random dataset assumes.
        specials = int(tokenizer.num_special_tokens_to_add())
        in_lens = [max(1, x - specials) for x in in_lens]
    ids = np.asarray(round_trip_ids(tokenizer, rng))
    prefix_len = round(cfg.random_shared_prefix_ratio * cfg.random_input_len)
    prefixes = [rng.choice(ids, prefix_len).tolist() for _ in range(cfg.random_shared_prefix_groups)]
    row = serving().DatasetRow
    rows = []
    for i in range(n):
        shared = prefixes[i % len(prefixes)][: max(0, in_lens[i] - 1)]
        tokens = shared + rng.choice(ids, in_lens[i] - len(shared)).tolist()
        prompt = tokenizer.decode(tokens) if text else [int(t) for t in tokens]
        rows.append(row(prompt=prompt, prompt_len=in_lens[i], output_len=out_lens[i]))
    return rows


def sharegpt_requests(cfg: BenchConfig, tokenizer) -> list:
    """Requests from a ShareGPT-format file by SGLang's ``sample_sharegpt_requests`` (first turn = prompt,
    second = the answer whose token length is the output length unless ``--sharegpt-output-len``; too short
    or over ``--sharegpt-context-len`` pruned). A file with fewer usable conversations than ``--num-prompts``
    is cycled (SGLang would send fewer requests), with a note on stderr.

    Raises:
        ValueError: the file does not exist, is not ShareGPT-format JSON, or has no usable conversation.
    """
    path = Path(cfg.dataset_path) if cfg.dataset_path else SHIPPED_SHAREGPT
    if not path.is_file():
        raise ValueError(f"--dataset-path: no file {str(path)!r} (pdserve bench never downloads a dataset)")
    from sglang.benchmark.datasets.sharegpt import sample_sharegpt_requests

    try:
        rows = sample_sharegpt_requests(dataset_path=str(path), num_requests=cfg.num_prompts, tokenizer=tokenizer,
                                        fixed_output_len=cfg.sharegpt_output_len,
                                        context_len=cfg.sharegpt_context_len)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ValueError(f"--dataset-path {str(path)!r} is not a ShareGPT-format JSON list "
                         f"([{{'conversations': [{{'from', 'value'}}, ...]}}, ...]): {e!r}") from None
    if not rows:
        raise ValueError(f"--dataset-path {str(path)!r}: no conversation with a prompt and an answer of >= 2 tokens "
                         "(within --sharegpt-context-len)")
    if len(rows) < cfg.num_prompts:
        print(f"pdserve bench: {path} has {len(rows)} usable conversations; cycling them to {cfg.num_prompts} "
              "requests", file=sys.stderr)
        rows = [rows[i % len(rows)] for i in range(cfg.num_prompts)]
    return rows


def load_requests(cfg: BenchConfig, tokenizer) -> list:
    """The run's requests (SGLang ``DatasetRow``: prompt, prompt_len, output_len), seeded by ``cfg.seed``
    (Python's and numpy's global generators, as SGLang's benchmark seeds them)."""
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    if cfg.dataset_name == "sharegpt":
        return sharegpt_requests(cfg, tokenizer)
    return random_requests(cfg, tokenizer)
