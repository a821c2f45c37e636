"""Write pd/bench/data/sharegpt_synthetic.json: a small ShareGPT-format file with realistic lengths, the
default of ``pdserve bench --dataset-name sharegpt`` (nothing is ever downloaded).

Format: SGLang's ShareGPT reader's (``[{"id", "conversations": [{"from": "human"|"gpt", "value"}, ...]}]``,
the first two turns are the prompt and the answer). Text: words drawn from a fixed pseudo-English vocabulary
with Zipf frequencies, so any tokenizer sees ordinary words and spaces.

Lengths: log-normal, the shape published ShareGPT length histograms have, with the means of ShareGPT as
the vLLM paper reports them (Kwon et al., SOSP'23, section 6.1: 161 input and 338 output tokens on average
after its filtering) at 0.75 words per token, the usual ratio for English with a BPE tokenizer.

Run: ``python benchmarks/make_sharegpt_dataset.py`` (deterministic: seed 0; rewrites the file).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "pd" / "bench" / "data" / "sharegpt_synthetic.json"
CONVERSATIONS = 200
WORDS_PER_TOKEN = 0.75
MEAN_TOKENS = {"human": 161, "gpt": 338}
SIGMA = {"human": 1.0, "gpt": 0.7}   # prompts vary more than answers in ShareGPT
MAX_TOKENS = 2048                     # ShareGPT samplers drop longer pairs anyway
SYLLABLES = ["ka", "lo", "mi", "ter", "an", "sol", "ve", "ri", "pa", "don", "el", "us", "tra", "ne", "op", "gi"]


def vocabulary(rng: np.random.Generator, n: int = 2000) -> list[str]:
    """``n`` distinct pseudo-words of 1-4 syllables."""
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice(SYLLABLES, rng.integers(1, 5))))
    return sorted(words)


def text(rng: np.random.Generator, vocab: list[str], weights: np.ndarray, tokens: int) -> str:
    """About ``tokens`` tokens of words, in sentences of 6-20 words."""
    n = max(2, round(tokens * WORDS_PER_TOKEN))
    words = rng.choice(vocab, n, p=weights).tolist()
    out, i = [], 0
    while i < n:
        k = int(rng.integers(6, 21))
        sentence = words[i:i + k]
        out.append(sentence[0].capitalize() + " " + " ".join(sentence[1:]) + ".")
        i += k
    return " ".join(out)


def lognormal_tokens(rng: np.random.Generator, role: str) -> int:
    sigma = SIGMA[role]
    mu = math.log(MEAN_TOKENS[role]) - sigma * sigma / 2  # the mean of the log-normal is MEAN_TOKENS
    return int(min(max(round(rng.lognormal(mu, sigma)), 4), MAX_TOKENS))


def main() -> None:
    rng = np.random.default_rng(0)
    vocab = vocabulary(rng)
    ranks = np.arange(1, len(vocab) + 1)
    weights = (1 / ranks) / np.sum(1 / ranks)  # Zipf's law, exponent 1
    data = []
    for i in range(CONVERSATIONS):
        turns = [{"from": role, "value": text(rng, vocab, weights, lognormal_tokens(rng, role))}
                 for role in ("human", "gpt")]
        data.append({"id": f"synthetic-{i:04d}", "conversations": turns})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=0) + "\n")
    words = {r: [len(c["conversations"][j]["value"].split()) for c in data] for j, r in enumerate(("human", "gpt"))}
    print(f"{OUT}: {len(data)} conversations, mean words human {np.mean(words['human']):.0f} "
          f"gpt {np.mean(words['gpt']):.0f}, {OUT.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
