"""The speculative acceptance alarm (PdserveSpecAcceptanceCollapsed) on what real engines export.

Two speculative engines serve the same prompts: the built-in draft, and a copy of it whose ``enorm`` is zeroed, so
it drafts without the token it is meant to draft from (standing in for the failure a public SGLang report shows
after a cache hit that lost the draft's state: acceptance 0.98 -> 0.10). Zeroing ``hnorm`` instead (dropping the
target's hidden state) does not move builtin:tiny's acceptance: its fitted draft is driven by the token.
Their ``/metrics`` gauges, scraped after each request, become the input series of a promtool unit test of the
committed rules: an hour of the healthy engine's samples then the broken one's must fire the alert on that worker;
the healthy engine's samples alone must not (the normal speculative run stays quiet).
"""

import asyncio
import random
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import SPEC_FLAGS
from engines import async_metric, start_engine, wait_ready

MONITORING = Path(__file__).resolve().parent.parent / "monitoring"
ALERT = "PdserveSpecAcceptanceCollapsed"
GAUGES = ("sglang:spec_accept_length", "sglang:spec_num_steps")
LABELS = 'instance="10.0.0.2:30001", model_name="builtin:tiny", engine_type="decode", tp_rank="0"'


def broken_draft(tmp_path: Path) -> Path:
    """A copy of the built-in draft whose token-embedding norm is zero: it drafts from the hidden state alone."""
    from safetensors.torch import load_file, save_file

    from pd.engines.spec.draft_model import resolve_draft_path

    src = Path(resolve_draft_path("builtin:tiny", None))
    out = tmp_path / "draft-without-its-token"
    shutil.copytree(src, out)
    weights = load_file(str(out / "model.safetensors"))
    weights["model.enorm.weight"].zero_()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


async def scrape_after_requests(engine, prompts) -> list[dict[str, float]]:
    """One greedy request per prompt; after each, the engine's speculative gauges."""
    samples = []
    async with httpx.AsyncClient(timeout=120) as c:
        for prompt in prompts:
            r = await c.post(engine.url + "/generate",
                             json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 32, "temperature": 0}})
            assert r.status_code == 200, r.text
            samples.append({g: await async_metric(engine, g) for g in GAUGES})
    return samples


def series(values: list[float], minutes: int) -> str:
    """promtool's expanded notation: ``values`` cycled over ``minutes`` one-minute samples."""
    return " ".join(f"{values[i % len(values)]:g}" for i in range(minutes))


def description(rules: dict) -> str:
    """The alert's description with this test's labels filled in."""
    rule = next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == ALERT)
    text = rule["annotations"]["description"]
    return text.replace("{{ $labels.instance }}", "10.0.0.2:30001").replace("{{ $labels.model_name }}",
                                                                             "builtin:tiny")


def promtool_case(tmp_path: Path, name: str, length: list[float], steps: list[float], fires: bool) -> str:
    """Run the committed rules over ``length``/``steps`` (one sample a minute, 90 minutes); returns promtool's
    output, asserting it passed with the alert firing at minute 85 iff ``fires``."""
    rules = yaml.safe_load((MONITORING / "rules.yml").read_text())
    expected = []
    if fires:
        expected = [{"exp_labels": {"severity": "warning", "instance": "10.0.0.2:30001", "model_name": "builtin:tiny"},
                     "exp_annotations": {"summary": "Speculative acceptance collapsed on 10.0.0.2:30001",
                                         "description": description(rules)}}]
    case = {
        "rule_files": [str(MONITORING / "rules.yml")],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": f"sglang:spec_accept_length{{{LABELS}}}", "values": series(length, 90)},
                {"series": f"sglang:spec_num_steps{{{LABELS}}}", "values": series(steps, 90)},
                {"series": 'sglang:spec_verify_calls_total{instance="10.0.0.2:30001", model_name="builtin:tiny", '
                           'engine_type="decode"}', "values": "0+10x89"},
            ],
            "alert_rule_test": [{"eval_time": "85m", "alertname": ALERT, "exp_alerts": expected}],
        }],
    }
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(case, sort_keys=False, width=1000))
    r = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{name}: {r.stdout}{r.stderr}"
    return r.stdout


@pytest.fixture(scope="module")
def broken_engine(spec_engines, tmp_path_factory):
    """A speculative null engine (builtin:tiny) drafting with the broken draft."""
    tmp = tmp_path_factory.mktemp("broken-draft")
    engine = start_engine("null", str(tmp), *SPEC_FLAGS, "--speculative-draft-model-path", str(broken_draft(tmp)))
    try:
        wait_ready([engine])
        yield engine
    finally:
        engine.stop()


def test_a_draft_that_lost_its_state_fires_the_alarm_and_a_healthy_one_does_not(spec_engines, broken_engine,
                                                                              tmp_path):
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed (make install installs the Debian prometheus package)")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randrange(16, 48))] for _ in range(4)]
    healthy = asyncio.run(scrape_after_requests(spec_engines["null"], prompts))
    broken = asyncio.run(scrape_after_requests(broken_engine, prompts))
    good_len = [s["sglang:spec_accept_length"] for s in healthy]
    bad_len = [s["sglang:spec_accept_length"] for s in broken]
    steps = [s["sglang:spec_num_steps"] for s in healthy + broken]
    assert min(good_len) > 2 and max(bad_len) < 1.5, (good_len, bad_len)  # the draft really is broken
    assert all(s > 0 for s in steps)

    # an hour healthy, then the broken draft: fires
    collapse = good_len * 15 + bad_len * 8  # 60 healthy minutes, then 32 broken
    promtool_case(tmp_path, "collapse", collapse[:90], steps, fires=True)
    # the healthy engine's own samples for 90 minutes: quiet
    promtool_case(tmp_path, "healthy", good_len, steps, fires=False)
