"""Unit tests of the reference engine's parts: pages, transfer segments, sampling, stops, expansion."""

import asyncio

import pytest
import torch

from pd.engines.errors import EngineError
from pd.engines.handoff.kv_pool import KVPagePool, PoolExhausted
from pd.engines.handoff.transfer import coalesce
from pd.engines.models.model_runner import KVLayout
from pd.engines.protocol import CompletionRequest, SeqRequest, expand
from pd.engines.sampling import SamplingParams, sample
from pd.engines.sequence import Sequence

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32")


def test_coalesce_joins_only_runs_contiguous_on_both_sides():
    src = [0, 100, 200, 400]
    dst = [1000, 1100, 1300, 1400]
    assert coalesce(src, dst, 100) == ([0, 200, 400], [1000, 1300, 1400], [200, 100, 100])
    assert coalesce([], [], 100) == ([], [], [])


async def test_pool_alloc_free_and_wait():
    pool = KVPagePool(LAYOUT, page_size=4, max_total_tokens=16)
    assert pool.num_pages == 4 and pool.page_bytes == 2 * 2 * 4 * 2 * 4 * 4
    a = pool.try_alloc(9)  # 3 pages
    assert a == [0, 1, 2] and pool.held == 3
    assert pool.try_alloc(8) is None
    with pytest.raises(PoolExhausted):
        pool.try_alloc(17)
    waiter = asyncio.create_task(pool.alloc(8))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    pool.free(a)
    assert await asyncio.wait_for(waiter, 1) == [0, 1]
    with pytest.raises(ValueError):
        pool.free([3])
    assert pool.page_addr(1) - pool.page_addr(0) == pool.page_bytes


def test_sampling_greedy_topk_topp_and_seeded():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    greedy = SamplingParams(temperature=0)
    assert sample(logits, greedy, 0, 0, []) == 1
    assert sample(logits, greedy, 0, 0, [1]) == 3  # banned before min_new_tokens
    topk = SamplingParams(temperature=1.0, top_k=2)
    assert {sample(logits, topk, s, 0, []) for s in range(50)} == {1, 3}
    topp = SamplingParams(temperature=1.0, top_p=0.05)
    assert {sample(logits, topp, s, 0, []) for s in range(20)} == {1}
    free = SamplingParams(temperature=1.0)
    draws = [sample(logits, free, 42, step, []) for step in range(30)]
    assert draws == [sample(logits, free, 42, step, []) for step in range(30)]  # counter-based: reproducible
    assert len(set(draws)) > 1


def test_sampling_penalties_logit_bias_and_min_p():
    """SGLang's order and formulas (sglang/srt/sampling/penaltylib, sampling_batch_info, sampler): penalties
    on the output tokens' logits, then logit_bias, then greedy or the filtered draw."""
    logits = torch.tensor([2.0, 1.9, -1.0, 0.0])
    greedy = dict(temperature=0)
    # frequency: per occurrence (2 - 2 x 0.04 = 1.92 still wins, 2 - 3 x 0.04 = 1.88 does not)
    assert sample(logits, SamplingParams(**greedy, frequency_penalty=0.04), 0, 2, [], [0, 0]) == 0
    assert sample(logits, SamplingParams(**greedy, frequency_penalty=0.04), 0, 3, [], [0, 0, 0]) == 1
    # presence: once, however often (2 - 0.05 = 1.95 wins after 3 occurrences; 2 - 0.2 = 1.8 loses)
    assert sample(logits, SamplingParams(**greedy, presence_penalty=0.05), 0, 3, [], [0, 0, 0]) == 0
    assert sample(logits, SamplingParams(**greedy, presence_penalty=0.2), 0, 1, [], [0]) == 1
    assert sample(logits, SamplingParams(**greedy, presence_penalty=-0.5), 0, 2, [], [1]) == 1  # negative: favour
    assert sample(logits, SamplingParams(**greedy, repetition_penalty=1.5), 0, 1, [], [0]) == 1  # 2 / 1.5 < 1.9
    # repetition penalty multiplies negative logits: -1 x 2 = -2 loses to -1.5
    assert sample(torch.tensor([-1.0, -1.5, -10, -10]), SamplingParams(**greedy, repetition_penalty=2), 0, 1, [],
                  [0]) == 1
    assert sample(logits, SamplingParams(**greedy), 0, 2, [], [0, 0, 0]) == 0  # no penalty: output ids unused
    assert sample(logits, SamplingParams(**greedy, logit_bias={"3": 2.5}), 0, 0, []) == 3
    assert sample(logits, SamplingParams(**greedy, logit_bias={"3": 2.5}), 0, 0, [3]) == 0  # banned wins
    # min_p: probabilities below min_p x the largest are dropped (e^-1 / e^0 = 0.37 < 0.5: only token 0 left)
    flat = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert {sample(flat, SamplingParams(temperature=1.0, min_p=0.5), s, 0, []) for s in range(40)} == {0}
    assert len({sample(flat, SamplingParams(temperature=1.0, min_p=0.3), s, 0, []) for s in range(40)}) > 1


def test_openai_penalty_fields_reach_the_sampler():
    sp = CompletionRequest(prompt="x", frequency_penalty=0.5, presence_penalty=-0.5, logit_bias={"3": 2.0},
                           min_p=0.1, repetition_penalty=1.2).sampling(16)
    assert (sp.frequency_penalty, sp.presence_penalty, sp.logit_bias, sp.min_p, sp.repetition_penalty) == \
        (0.5, -0.5, {"3": 2.0}, 0.1, 1.2)


@pytest.mark.parametrize("bad", [{"max_new_tokens": 0}, {"temperature": -0.1}, {"top_p": 0}, {"top_k": 0},
                                 {"min_new_tokens": 5, "max_new_tokens": 2}, {"stop_token_ids": [999]},
                                 {"min_p": 1.5}, {"frequency_penalty": 2.5}, {"presence_penalty": -3},
                                 {"repetition_penalty": 0}, {"repetition_penalty": 2.5},
                                 {"logit_bias": {"384": 1.0}}, {"logit_bias": {"x": 1.0}}])
def test_sampling_params_validation_names_the_field(bad):
    with pytest.raises(EngineError) as e:
        SamplingParams(**bad).validate_for(384)
    assert e.value.status == 400 and e.value.param in bad


def _seq(**params):
    spec = SeqRequest(index=0, prompt_index=0, sample_index=0, prompt_ids=[1, 2], params=SamplingParams(**params),
                   rid="r", seed=0)
    return Sequence(spec, eos_ids={1}, decode_fn=lambda ids, skip: "".join(chr(i) for i in ids if i != 1),
                    context_length=100)


def test_stop_string_trim_and_stream_holdback():
    seq = _seq(stop="xyz", max_new_tokens=10)
    streamed = ""
    for ch in "abxyq" + "xyz":
        seq.append(ord(ch), -1.0, [])
        stable = seq.stable_text()
        assert stable.startswith(streamed)
        streamed = stable
        if seq.done:
            break
    assert seq.finish_reason == {"type": "stop", "matched": "xyz"}
    assert seq.text() == "abxyq" == streamed


def test_eos_min_tokens_and_length():
    seq = _seq(max_new_tokens=3, min_new_tokens=2)
    assert seq.banned_tokens(0) == [1] and seq.banned_tokens(2) == []
    seq.append(65, 0.0, [])
    seq.append(1, 0.0, [])  # EOS at step 2 = min_new_tokens: stops
    assert seq.finish_reason == {"type": "stop", "matched": 1}
    seq = _seq(max_new_tokens=2, ignore_eos=True)
    seq.append(1, 0.0, [])
    assert not seq.done
    seq.append(1, 0.0, [])
    assert seq.finish_reason == {"type": "length", "length": 2}


def test_expand_is_prompt_major_with_a_room_per_sequence():
    req = CompletionRequest(prompt=["a", "b"], n=3, bootstrap_room=100, bootstrap_host="h", bootstrap_port=9)
    reqs = expand([[1], [2]], 3, [SamplingParams(sampling_seed=5)] * 2, req, "r", [False] * 2, [-1] * 2, [0] * 2,
                   False)
    assert [(s.prompt_index, s.sample_index) for s in reqs] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [s.bootstrap.room for s in reqs] == list(range(100, 106))
    assert [s.rid for s in reqs] == [f"r_{i}" for i in range(6)]
    assert [s.seed for s in reqs] == [5, 6, 7, 5, 6, 7]
    req = CompletionRequest(prompt=["a", "b"], n=3, bootstrap_room=[1, 2], bootstrap_host="h", bootstrap_port=9)
    with pytest.raises(EngineError, match="bootstrap_room has 2 entries; expected 6"):
        expand([[1], [2]], 3, [SamplingParams()] * 2, req, None, [False] * 2, [-1] * 2, [0] * 2, False)


def test_engine_help_documents_every_flag():
    from pd.engines.settings import build_parser

    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 15, action.option_strings
    text = parser.format_help()
    for flag in ("--model-path", "--disaggregation-mode", "--disaggregation-bootstrap-port",
                 "--disaggregation-transfer-backend", "--disaggregation-transfer-protocol",
                 "--disaggregation-ib-device"):
        assert flag in text


def engine_settings(*argv: str):
    """The resolved settings ``pdserve engine ARGV`` starts with (its parser, its checks)."""
    from pd.engines.settings import parse_settings, resolve

    return resolve(parse_settings(list(argv), environ={}))


def test_engine_refuses_a_model_path_that_is_not_a_checkpoint_directory(tmp_path):
    from pd.engines.errors import EngineSettingsError

    def check(path):
        return engine_settings("--model-path", path)

    with pytest.raises(EngineSettingsError, match=r"^--model-path /nonexistent/model: no such directory"):
        check("/nonexistent/model")
    with pytest.raises(EngineSettingsError, match="no config.json in it"):
        check(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert check(str(tmp_path)).model_path == str(tmp_path)
    assert check("builtin:tiny").model_path == "builtin:tiny"
    with pytest.raises(EngineSettingsError, match=r"^--model-path builtin:huge: unknown built-in model "
                                                  r"\(known: builtin:tiny, builtin:deep\)"):
        check("builtin:huge")


@pytest.mark.parametrize("argv, says", [
    (["--port", "99999"], "--port 99999: Input should be less than or equal to 65535"),
    (["--port", "0"], "--port 0: Input should be greater than or equal to 1"),
    (["--disaggregation-bootstrap-port", "70000"],
     "--disaggregation-bootstrap-port 70000: Input should be less than or equal to 65535")])
def test_engine_refuses_ports_outside_the_tcp_range(argv, says):
    from pd.engines.errors import EngineSettingsError

    with pytest.raises(EngineSettingsError) as e:
        engine_settings(*argv)
    assert str(e.value) == says and e.value.flag == argv[0]


@pytest.mark.slow
def test_engine_ready_line_only_once_listening(model_cache):
    """SGLang's "fired up and ready to roll" line is what operators grep for: an engine whose port is
    taken must exit without it."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "pd.cli", "engine", "--port", str(port)], capture_output=True,
                           text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "address already in use" in out, out
    assert "fired up and ready to roll" not in out, out
    # on a free port the line follows the listening socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "pd.cli", "engine", "--port", str(port)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in p.stdout:
            seen.append(line)
            if "fired up and ready to roll" in line:
                break
        assert any(f"running on http://127.0.0.1:{port}" in x for x in seen[:-1]), seen
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        p.terminate()
        p.wait(timeout=30)


@pytest.mark.parametrize("num_tokens", [1, 16, 37])
def test_kv_export_import_roundtrip(model_cache, num_tokens):
    from pd.engines.models.model_runner import ModelRunner

    runner = ModelRunner("builtin:tiny")
    cache = runner.new_cache()
    ids = [(7 * i) % 300 + 3 for i in range(num_tokens)]
    runner.forward(ids, cache)
    pool = KVPagePool(runner.layout, page_size=16, max_total_tokens=256)
    pages = [5, 2, 9][: pool.pages_for(num_tokens)]
    runner.export_kv(cache, pool.pages, pages, num_tokens)
    back = runner.import_kv(pool.pages, pages, num_tokens)
    for layer in range(runner.layout.num_layers):
        for a, b in zip(runner.cache_kv(cache, layer), runner.cache_kv(back, layer)):
            assert torch.equal(a, b)
    # continuing from the imported cache gives bit-identical logits
    assert torch.equal(runner.forward([42], cache), runner.forward([42], back))


def test_completion_text_offsets_skip_special_tokens_like_the_text(model_cache):
    from pd.engines.api.openai_api import completion_logprobs
    from pd.engines.models.model_runner import ModelRunner

    runner = ModelRunner("builtin:tiny")
    special = runner.tokenizer.convert_tokens_to_ids("<extra_id_118>")
    ids = runner.tokenizer.encode("ab", add_special_tokens=False) + [special] + \
        runner.tokenizer.encode("cd", add_special_tokens=False)
    spec = SeqRequest(index=0, prompt_index=0, sample_index=0, prompt_ids=[5], params=SamplingParams(), rid="r", seed=0,
                   return_logprob=True)
    seq = Sequence(spec, set(), runner.decode, 4096)
    seq.output_ids = ids
    seq.output_logprobs = [(-1.0, i) for i in ids]
    seq.output_top = [[] for _ in ids]
    text = seq.text()
    assert text == "abcd"
    lp = completion_logprobs(seq, runner, 0)
    assert lp["tokens"][2] == "<extra_id_118>"
    assert lp["text_offset"] == [0, 1, 2, 2, 3]  # the special token adds nothing to the text
    assert completion_logprobs(seq, runner, 3)["text_offset"] == [2, 3]  # a stream chunk's tokens, absolute offsets


def test_run_blocking_drops_queued_work_of_a_cancelled_caller_and_waits_for_running_work():
    """An aborted request's model steps still queued behind others never run; one already running is
    waited for (its KV pages stay valid until it returns)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from pd.engines.model_steps import run_blocking
    from pd.util.wait import async_wait_until

    ran = []
    started, release = threading.Event(), threading.Event()

    def step(name):
        if name == "running":
            started.set()
            release.wait(5)
            time.sleep(0.05)
        ran.append(name)

    async def main():
        with ThreadPoolExecutor(max_workers=1) as ex:
            running = asyncio.ensure_future(run_blocking(ex, step, "running"))
            queued = asyncio.ensure_future(run_blocking(ex, step, "queued"))
            await async_wait_until(started.is_set, 30, interval=0.01, what="the running step started")
            running.cancel()
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            assert ran == []
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await running
            assert ran == ["running"]  # awaited to the end before the cancellation surfaced
        assert ran == ["running"]  # the queued step never ran

    asyncio.run(main())


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 1), (8, 7)])
def test_cpu_threads_default_leaves_a_core_to_the_server_thread(cores, threads, monkeypatch):
    from pd.engines.settings import default_cpu_threads

    assert default_cpu_threads(cores) == threads
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(cores)), raising=False)
    assert engine_settings().cpu_threads == threads
    assert engine_settings("--cpu-threads", "5").cpu_threads == 5


@pytest.mark.parametrize("value", ["0", "-2"])
def test_cpu_threads_must_be_positive(value):
    from pd.engines.errors import EngineSettingsError

    with pytest.raises(EngineSettingsError) as e:
        engine_settings("--cpu-threads", value)
    assert str(e.value) == f"--cpu-threads {value}: Input should be greater than or equal to 1"
