"""pd.tools.diagnose: root cause of a failed SGLang start/crash from multi-rank logs (fixtures in SGLang's format)."""

import json
import os
import random
import time

import pytest

from pd.tools.diagnose import Diagnosis, diagnose_logs, diagnose_text, render

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "sglang_logs")
ALL_FIXTURES = sorted(
    [os.path.join(FIX, f) for f in os.listdir(FIX) if f.endswith(".log")]
    + [os.path.join(FIX, "per_rank", f) for f in os.listdir(os.path.join(FIX, "per_rank"))]
)


def fx(name: str) -> str:
    return os.path.join(FIX, name)


def line_no(path: str, needle: str, nth: int = 0) -> int:
    """1-based number of the nth line of ``path`` that contains ``needle``."""
    with open(path) as f:
        hits = [i for i, t in enumerate(f, 1) if needle in t]
    return hits[nth]


def lines_of(d: Diagnosis, path: str) -> set[int]:
    return {e.line for e in d.evidence if e.file == path}


def only(found: list[Diagnosis]) -> Diagnosis:
    assert len(found) == 1, render(found)
    assert found[0].primary
    return found[0]


def primary(found: list[Diagnosis]) -> Diagnosis:
    p = [d for d in found if d.primary]
    assert len(p) == 1 and found[0] is p[0], render(found)
    return p[0]


# --------------------------------------------------------------------------------------------------
# Fixtures: one realistic log per category
# --------------------------------------------------------------------------------------------------


def test_sm100_kernel_on_four_ranks_is_one_cause_with_the_ranks_listed():
    path = fx("eagle_sm100_no_kernel_image.log")
    d = only(diagnose_logs([path]))
    assert d.category == "kernel_arch"
    assert d.ranks == [0, 1, 2, 3] and d.occurrences == 4
    assert "no kernel image" in d.cause and "sm_100 kernel" in d.cause and "sm100f" in d.cause
    assert "EAGLE/MTP draft" in d.cause and "sm_120" in d.cause
    # the backend by expert format, as pdserve doctor says: this draft's experts are MXFP4, which triton
    # cannot read (doctor refuses "moe_runner_backend: triton" for them)
    assert "--speculative-moe-runner-backend" in d.fix and "MXFP4 experts (DeepSeek-V4, its MTP layer included) " \
        "flashinfer_mxfp4" in d.fix
    assert "NVFP4 (modelopt_fp4) flashinfer_cutlass" in d.fix and "FP8/BF16 experts triton" in d.fix
    assert "--moe-runner-backend triton" not in d.fix
    assert "--quantization" in d.fix and "fp8 for DeepSeek-V4-Flash" in d.fix
    got = lines_of(d, path)
    # each rank's exception line, the first rank's header, the sm_100 kernel line, the parent's SIGQUIT
    for k in range(4):
        assert line_no(path, "no kernel image is available", k) in got
    assert line_no(path, "Scheduler hit an exception", 0) in got
    assert line_no(path, "_sm100f", 3) in got  # the nearest one before the first failure
    assert line_no(path, "Received sigquit") in got
    text = render([d])
    assert "TP0, TP1, TP2, TP3" in text and text.count("ROOT CAUSE") == 1


def test_oom_during_cuda_graph_capture_on_tp2_only():
    path = fx("cuda_graph_oom_tp2.log")
    d = only(diagnose_logs([path]))
    assert d.category == "cuda_oom" and d.ranks == [2]
    assert "CUDA graph capture" in d.cause and "1.50 GiB" in d.cause
    assert "--mem-fraction-static" in d.fix and "--cuda-graph-max-bs-decode" in d.fix
    assert "--cuda-graph-max-bs-prefill" in d.fix
    got = lines_of(d, path)
    assert line_no(path, "torch.OutOfMemoryError") in got  # the wrapped (real) error
    assert line_no(path, "Capture cuda graph failed") in got  # SGLang's wrapper
    assert line_no(path, "[2025-11-02 09:40:57 TP2] Scheduler hit an exception") in got
    assert line_no(path, "Received sigquit") in got
    # the other ranks' capture progress is not evidence
    assert not any("Capturing batches" in e.text for e in d.evidence)


def test_decode_bootstrap_timeout():
    path = fx("decode_bootstrap_timeout.log")
    d = only(diagnose_logs([path]))
    assert d.category == "kv_transfer" and d.ranks == [0, 1]
    assert "KVPoll.Bootstrapping" in d.cause and d.occurrences == 7
    assert "MC_FORCE_TCP=1" in d.fix and "bootstrap" in d.fix and "--disaggregation-ib-device" in d.fix
    got = lines_of(d, path)
    assert line_no(path, "timed out when bootstrapping") in got
    assert line_no(path, "KVTransferError", 1) in got  # TP1's first failure
    assert not any("fired up" in e.text for e in d.evidence)


def test_port_in_use_names_the_port():
    path = fx("port_in_use.log")
    d = only(diagnose_logs([path]))
    assert d.category == "port_in_use" and "Port 30000" in d.cause
    assert "30000" in d.fix and "--port" in d.fix
    assert lines_of(d, path) == {line_no(path, "address already in use")}


def test_nccl_peer_access():
    path = fx("nccl_p2p.log")
    d = only(diagnose_logs([path]))
    assert d.category == "nccl" and d.ranks == [0, 1, 2, 3]
    assert "peer access is not supported" in d.cause
    assert "NCCL_P2P_DISABLE=1" in d.fix and "NCCL_DEBUG=INFO" in d.fix
    got = lines_of(d, path)
    assert line_no(path, "NCCL WARN") in got
    for k in range(4):
        assert line_no(path, "DistBackendError", k) in got
    assert not any("NCCL INFO" in e.text for e in d.evidence)


def test_page_size_mismatch_at_run_time():
    path = fx("page_size_mismatch_decode.log")
    d = only(diagnose_logs([path]))
    assert d.category == "page_size_mismatch" and d.ranks == [0, 1]
    assert "prefill page_size=64" in d.cause and "decode page_size=1" in d.cause
    assert "--page-size" in d.fix
    got = lines_of(d, path)
    assert {line_no(path, "RuntimeError: Page size mismatch", k) for k in range(2)} <= got
    assert line_no(path, "SIGQUIT received") in got  # the running-phase handler's message, as evidence


def test_clean_start_finds_nothing():
    assert diagnose_logs([fx("ready_clean.log")]) == []


def test_mooncake_rdma_device():
    path = fx("prefill_mooncake_rdma.log")
    d = only(diagnose_logs([path]))
    assert d.category == "kv_transfer" and d.ranks == [0, 1]
    assert "Failed to open RDMA device mlx5_9" in d.cause
    assert "MC_FORCE_TCP=1" in d.fix and "--disaggregation-ib-device" in d.fix
    got = lines_of(d, path)
    assert line_no(path, "Failed to open RDMA device") in got
    assert line_no(path, "RuntimeError: Mooncake memory registration failed") in got


def test_per_rank_files_one_cause_across_files():
    d0, d1, srv = (os.path.join(FIX, "per_rank", f) for f in ("tp0.log", "tp1.log", "server.log"))
    d = only(diagnose_logs([srv, d0, d1]))
    assert d.category == "kv_cache_memory" and d.ranks == [0, 1]
    assert "--mem-fraction-static" in d.fix
    assert line_no(d0, "RuntimeError: Not enough memory") in lines_of(d, d0)
    assert line_no(d1, "RuntimeError: Not enough memory") in lines_of(d, d1)
    assert line_no(srv, "Received sigquit") in lines_of(d, srv)


def test_prefill_crash_is_the_root_cause_of_the_decode_lost_connection():
    dec, pre = fx("decode_lost_prefill.log"), fx("prefill_oom_runtime.log")
    found = diagnose_logs([dec, pre])  # the decode's log first: order of the files does not matter
    assert [d.category for d in found] == ["cuda_oom", "kv_transfer"]
    p = primary(found)
    assert p.ranks == [1] and "CUDA graph" not in p.cause
    assert line_no(pre, "torch.OutOfMemoryError") in lines_of(p, pre)
    lost = found[1]
    assert not lost.primary and "10.0.0.5:8998" in lost.cause and lost.ranks == [0, 1]
    # the decode's log alone: the lost prefill is the best available cause
    alone = primary(diagnose_logs([dec]))
    assert alone.category == "kv_transfer" and "Lost connection" in alone.cause
    assert "pdserve diagnose" in alone.fix


def test_shadowed_import_names_the_folder_the_real_package_and_the_fix():
    """A Ray worker ran from a checkout uploaded as its working dir: transformers' `from kernels import ...` found the
    checkout's kernels/ folder (pd.kernels' source) instead of Hugging Face's kernels package."""
    path = fx("shadowed_kernels_import.log")
    d = only(diagnose_logs([path]))
    folder = ("/tmp/ray/session_2026-12-06_10-01-02_123456_789/runtime_resources/working_dir_files/"
              "_ray_pkg_5f1c2d3e4a5b6c7d/kernels")
    assert d.category == "shadowed_import" and d.recognised and d.ranks == [0, 1] and d.occurrences == 2
    assert f"found the folder {folder}/" in d.cause and "the installed package 'kernels'" in d.cause
    assert "`from kernels import CUDAProperties` in transformers" in d.cause
    assert "Hugging Face's 'kernels'" in d.fix and "pd.kernels" in d.fix
    assert "up-to-date checkout" in d.fix and "off sys.path" in d.fix
    got = lines_of(d, path)
    assert {line_no(path, "ImportError: cannot import name", k) for k in range(2)} <= got
    assert line_no(path, "hub_kernels.py") in got  # the import that went wrong
    assert line_no(path, "Received sigquit") in got


SHADOW_TB = (
    '  File "/home/u/pdserve/.venv/lib/python3.11/site-packages/transformers/integrations/hub_kernels.py", '
    "line 104, in <module>\n"
    "    from kernels import (\n"
    "ImportError: cannot import name 'CUDAProperties' from 'kernels' ({path})\n"
)


@pytest.mark.parametrize("path", [
    "/tmp/ray/session_2026-12-06_10-01-02_123456_789/runtime_resources/working_dir_files/_ray_pkg_5f1c2d3e4a5b6c7d/"
    "kernels/__init__.py",
    "/home/u/pdserve/kernels/__init__.py",
])
def test_shadowed_import_in_a_log_tail_cut_mid_traceback(path):
    d = only(diagnose_text(SHADOW_TB.format(path=path)))
    assert d.category == "shadowed_import" and path.removesuffix("__init__.py") in d.cause
    assert d.evidence[-1].line == 3 and "pd.kernels" in d.fix


def test_import_errors_that_are_not_a_shadow_stay_unrecognised():
    installed = "/home/u/pdserve/.venv/lib/python3.11/site-packages/kernels/__init__.py"  # an old real package
    for exc in (f"ImportError: cannot import name 'CUDAProperties' from 'kernels' ({installed})",
                "ImportError: cannot import name 'X' from partially initialized module 'kernels' (most likely due to "
                "a circular import) (/home/u/pdserve/kernels/__init__.py)",
                "ImportError: cannot import name 'X' from 'kernels' (unknown location)",
                "ImportError: cannot import name 'X' from 'kernels' (/home/u/pdserve/lib/__init__.py)"):
        d = only(diagnose_text(SCHED_TB.format(rank=0, exc=exc)))
        assert d.category == "exception" and not d.recognised, (exc, render([d]))


def test_shadowed_import_of_another_package_by_a_project_folder():
    exc = "ImportError: cannot import name 'parse' from 'utils' (/home/u/proj/utils/__init__.py)"
    text = ("Traceback (most recent call last):\n"
            '  File "/home/u/venv/lib/python3.11/site-packages/somelib/core.py", line 3, in <module>\n'
            "    from utils import parse\n" + exc + "\n")
    d = only(diagnose_text(text))
    assert d.category == "shadowed_import" and "the folder /home/u/proj/utils/" in d.cause and "in somelib" in d.cause
    assert "rename the folder" in d.fix and "somelib" in d.fix and "pd." not in d.fix


@pytest.mark.parametrize("path", ALL_FIXTURES, ids=os.path.basename)
def test_sigquit_is_never_the_primary_cause(path):
    found = diagnose_logs([path])
    for d in found:
        assert d.category != "sigquit" or not d.primary
        if d.primary:
            assert "sigquit" not in d.evidence[0].text.lower()
            assert "sigquit" not in d.cause.lower()


def test_cli_exit_codes_and_output(capsys):
    from pd.cli import main as cli

    with pytest.raises(SystemExit) as e:
        cli(["diagnose", fx("eagle_sm100_no_kernel_image.log")])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "ROOT CAUSE" in out and "TP0, TP1, TP2, TP3" in out

    with pytest.raises(SystemExit) as e:
        cli(["diagnose", fx("ready_clean.log")])
    assert e.value.code == 1 and "No known failure" in capsys.readouterr().out

    with pytest.raises(SystemExit) as e:
        cli(["diagnose", fx("ready_clean.log"), "/nonexistent/engine.log"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "/nonexistent/engine.log" in err

    with pytest.raises(SystemExit) as e:
        cli(["diagnose", "--json", os.path.join(FIX, "per_rank")])  # a directory: its *.log files
    data = json.loads(capsys.readouterr().out)
    assert e.value.code == 0 and data[0]["category"] == "kv_cache_memory" and data[0]["primary"]
    assert {"file", "line", "text"} <= set(data[0]["evidence"][0])


def test_cli_unknown_traceback_exits_1_and_shows_it(tmp_path, capsys):
    from pd.cli import main as cli

    log = tmp_path / "engine.log"
    log.write_text(SCHED_TB.format(rank=0, exc="ValueError: frobnication level 7 is not supported here"))
    with pytest.raises(SystemExit) as e:
        cli(["diagnose", str(log)])
    out = capsys.readouterr().out
    assert e.value.code == 1 and "ValueError: frobnication level 7" in out and "no known pattern" in out

    plain = tmp_path / "plain.log"
    plain.write_text("[2025-11-02 10:00:00] starting\n[2025-11-02 10:00:01] ERROR something odd happened\n")
    with pytest.raises(SystemExit) as e:
        cli(["diagnose", str(plain)])
    out = capsys.readouterr().out
    assert e.value.code == 1 and "Last error lines" in out and "something odd happened" in out


# --------------------------------------------------------------------------------------------------
# Smaller cases, inline
# --------------------------------------------------------------------------------------------------

SCHED_TB = (
    "[2025-11-02 10:00:01 TP{rank}] Scheduler hit an exception: Traceback (most recent call last):\n"
    '  File "/opt/sglang/srt/managers/scheduler.py", line 6362, in run_scheduler_process\n'
    "    scheduler = Scheduler(server_args, port_args)\n"
    "{exc}\n"
)


def test_capture_failure_reports_the_wrapped_error():
    text = SCHED_TB.format(rank=1, exc="Exception: Capture cuda graph failed: AssertionError: the draft "
                                       "token buffer holds 96 rows, need 128\nPossible solutions:\n1. ...")
    d = only(diagnose_text(text))
    assert d.category == "cuda_graph_capture" and d.ranks == [1]
    assert "the draft token buffer holds 96 rows, need 128" in d.cause and d.evidence[-1].line == 4
    text = SCHED_TB.format(rank=1, exc="Exception: Capture cuda graph failed: CUDA error: operation not "
                                       "permitted when stream is capturing")
    d = only(diagnose_text(text))
    assert d.category == "cuda_error" and "CUDA graph capture" in d.cause
    assert "operation not permitted when stream is capturing" in d.cause
    text = SCHED_TB.format(rank=0, exc="Exception: Capture cuda graph failed: CUDA error: no kernel image is "
                                       "available for execution on the device")
    d = only(diagnose_text(text))
    assert d.category == "kernel_arch" and "CUDA graph capture" in d.cause


def test_sm100_kernel_name_in_an_error_without_no_kernel_image():
    text = SCHED_TB.format(rank=3, exc="RuntimeError: Error in function 'run' at moe_launcher.cu:88: kernel "
                                       "bmm_E2m1_E2m1E2m1_Fp32_t128x8x256_sm100a requires SM 10.0, got 12.0")
    d = only(diagnose_text(text))
    assert d.category == "kernel_arch" and "sm100a" in d.cause and d.ranks == [3]


def test_sm100_in_info_lines_is_not_a_failure():
    text = ("[2025-11-02 10:00:01 TP0] Attention backend: flashinfer (fmha_sm100 unavailable, using sm_120 path)\n"
            "[2025-11-02 10:00:02 TP0] if is_sm100: skipping trtllm kernels\n"
            "[2025-11-02 10:00:03] The server is fired up and ready to roll!\n")
    assert diagnose_text(text) == []


def test_sigquit_alone_is_a_symptom_not_a_cause():
    text = ("[2025-11-02 10:00:00] server_args=ServerArgs(port=30000, tp_size=4)\n"
            "[2025-11-02 10:05:00] Received sigquit from a child process. It usually means the child failed.\n")
    found = diagnose_text(text)
    assert [d.category for d in found] == ["sigquit"] and not found[0].primary
    assert "SYMPTOM" in render(found)


def test_unknown_traceback_on_two_ranks_is_one_unrecognised_root_cause():
    exc = "ValueError: unexpected key 'mtp.0.experts.w13_scale' in the checkpoint"
    text = SCHED_TB.format(rank=0, exc=exc) + SCHED_TB.format(rank=1, exc=exc)
    d = only(diagnose_text(text))
    assert d.category == "exception" and not d.recognised and d.ranks == [0, 1]
    assert d.cause == exc and d.evidence[-1].line == 8


def test_chained_traceback_is_one_record_with_the_first_error_as_cause():
    text = (SCHED_TB.format(rank=0, exc="KeyError: 'rope_scaling'") +
            "\nDuring handling of the above exception, another exception occurred:\n\n"
            "Traceback (most recent call last):\n"
            '  File "/opt/sglang/srt/configs/model_config.py", line 412, in __init__\n'
            "    raise ValueError(msg)\n"
            "ValueError: could not read the model config\n")
    d = only(diagnose_text(text))
    assert d.cause == "KeyError: 'rope_scaling'" and d.ranks == [0]


@pytest.mark.parametrize("line,port", [
    ("ValueError: nccl_port at 31337 is not available in 30 seconds. nccl_port is used by a process already.", "31337"),
    ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
     "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use", "29500"),
    ("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:30002')", "30002"),
])
def test_port_in_use_variants(line, port):
    d = only(diagnose_text(SCHED_TB.format(rank=0, exc=line)))
    assert d.category == "port_in_use" and f"Port {port}" in d.cause and port in d.fix


def test_nccl_timeout_after_a_crash_elsewhere_is_secondary():
    text = (SCHED_TB.format(rank=1, exc="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.")
            + "[rank0]:[E1102 10:10:01.123456789 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective "
              "operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600012 ms\n")
    found = diagnose_text(text)
    assert [d.category for d in found] == ["cuda_oom", "nccl"]
    assert found[0].primary and found[0].ranks == [1] and not found[1].primary and found[1].ranks == [0]
    # the timeout alone still says what it is
    alone = primary(diagnose_text(text.split("\n", 4)[-1]))
    assert alone.category == "nccl" and "peer rank" in alone.cause


def test_scheduler_killed_without_traceback():
    text = ("[2025-11-02 10:00:00] server_args=ServerArgs(port=30000, tp_size=2)\n"
            "[2025-11-02 10:02:00] RuntimeError: Rank 1 scheduler died during initialization (exit code: -9). "
            "If exit code is -9 (SIGKILL), a common cause is the OS OOM killer.\n")
    d = only(diagnose_text(text))
    assert d.category == "child_exit" and d.ranks == [1] and "OOM killer" in d.fix


def test_other_categories_inline():
    cases = {
        "pd_config_mismatch": "RuntimeError: KV cache dtype mismatch: prefill server has kv_cache_dtype=fp8_e4m3, "
                              "but decode server has kv_cache_dtype=bf16. Both must match.",
        "shared_memory": "triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 147456, "
                         "Hardware limit: 101376. Reducing block sizes or `num_stages` may help.",
        "cuda_error": "RuntimeError: CUDA error: an illegal memory access was encountered",
        "missing_dependency": "ModuleNotFoundError: No module named 'sgl_kernel'",
        "kv_cache_memory": "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
    }
    for category, exc in cases.items():
        d = only(diagnose_text(SCHED_TB.format(rank=0, exc=exc)))
        assert d.category == category, (category, render([d]))
        assert d.evidence[-1].line == 4 and d.recognised
    smem = diagnose_text(SCHED_TB.format(rank=0, exc=cases["shared_memory"]))[0]
    assert "147456" in smem.cause and "101376" in smem.cause


def test_reference_engine_failures():
    text = ("2025-11-02 10:00:00,101 INFO pd.engine: The server is fired up and ready to roll! (decode mode)\n"
            "2025-11-02 10:00:09,555 ERROR pd.engine: request r7 failed\n"
            "Traceback (most recent call last):\n"
            '  File "/work/pd/engines/handoff/bootstrap.py", line 230, in register\n'
            "    raise RoomFailed(...)\n"
            "pd.engines.handoff.bootstrap.RoomFailed: bootstrap room 77: prefill bootstrap server 10.0.0.5:8998 "
            "unreachable: ConnectError('All connection attempts failed')\n")
    d = only(diagnose_text(text, source="decode-0 engine log"))
    assert d.category == "kv_transfer" and "10.0.0.5:8998" in d.cause and d.evidence[-1].line == 6
    text = ("Traceback (most recent call last):\n"
            '  File "/work/pd/engines/handoff/transfer.py", line 64, in __init__\n'
            "RuntimeError: Mooncake TransferEngine.initialize('10.0.0.5', P2PHANDSHAKE, 'rdma') returned -1\n")
    d = only(diagnose_text(text))
    assert d.category == "kv_transfer" and "Mooncake" in d.cause and "MC_FORCE_TCP" in d.fix


def test_client_aborts_are_not_failures():
    text = ("[2025-11-02 10:00:01 TP0] Prefill transfer failed for request rank=0 req.rid='a' req.bootstrap_room=5 "
            "with exception KVTransferError(bootstrap_room=5): Aborted by AbortReq.\n")
    assert diagnose_text(text) == []


def test_worker_labels_ray_prefixes_and_colors_keep_streams_apart():
    text = (
        "[prefill-0] [2025-11-02 10:00:01 TP1] Scheduler hit an exception: Traceback (most recent call last):\n"
        "[decode-0] [2025-11-02 10:00:01 TP0] Decode batch, #running-req: 3, #token: 700\n"
        '[prefill-0]   File "/opt/sglang/srt/managers/scheduler.py", line 1, in run\n'
        "[decode-0] [2025-11-02 10:00:01 TP0] Decode batch, #running-req: 3, #token: 710\n"
        "[prefill-0] \x1b[31mtorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB.\x1b[0m\n"
        "(SGLangWorker pid=4242) [2025-11-02 10:00:02 TP3] Lost connection with prefill instance "
        "(bootstrap_addr: 10.0.0.5:8998), 2 requests affected\n"
        "(Worker pid=77, ip=10.0.0.7) [decode-1] [2025-11-02 10:00:03 TP2] Scheduler hit an exception: "
        "Traceback (most recent call last):\n"
        "(Worker pid=78, ip=10.0.0.7) [decode-1] [2025-11-02 10:00:03 TP1] Decode batch, #running-req: 1\n"
        '(Worker pid=77, ip=10.0.0.7) [decode-1]   File "/opt/sglang/srt/managers/scheduler.py", line 1, in run\n'
        "(Worker pid=77, ip=10.0.0.7) [decode-1] ValueError: bad draft token count 0\n"
    )
    found = diagnose_text(text, source="job.log")
    assert [(d.category, d.ranks) for d in found] == [("cuda_oom", [1]), ("exception", [2]), ("kv_transfer", [3])]
    assert {e.line for e in found[0].evidence} == {1, 5}
    assert found[1].cause == "ValueError: bad draft token count 0" and found[1].evidence[-1].line == 10
    assert "\x1b" not in render(found)


def test_rank_from_the_file_name_and_a_log_tail_cut_mid_traceback(tmp_path):
    log = tmp_path / "engine_rank3.log"
    log.write_text('  File "/opt/sglang/srt/layers/moe/ep_moe.py", line 88, in forward\n'
                   "    out = torch.empty(n, device='cuda')\n"
                   "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.\n")
    d = only(diagnose_logs([log]))
    assert d.category == "cuda_oom" and d.ranks == [3] and d.evidence[0].line == 3
    assert d.evidence[0].file == str(log)


def test_garbage_and_binary_input_do_not_break_it():
    rng = random.Random(7)
    junk = "".join(chr(rng.randrange(0, 0x3000)) for _ in range(50_000))
    junk += "\n" + "x" * 200_000 + "Traceback (most recent call last)\n\x00\x00[2025-13-99 TP] ]]]\n"
    for text in (junk, "", "\n\n\n", "Traceback (most recent call last):", "[2025-11-02 10:00:00 TP0]"):
        assert isinstance(diagnose_text(text), list)
    found = diagnose_text(junk + SCHED_TB.format(rank=2, exc="RuntimeError: CUDA error: out of memory"))
    assert primary(found).category == "cuda_oom" and found[0].ranks == [2]
    assert all(len(e.text) <= 400 for d in found for e in d.evidence)


def test_diagnosis_serialises():
    found = diagnose_logs([fx("nccl_p2p.log")])
    data = json.loads(json.dumps([d.to_dict() for d in found]))
    assert data[0]["ranks"] == [0, 1, 2, 3] and data[0]["evidence"][0]["line"] > 0
    file, line, text = found[0].evidence[0]  # evidence is a (file, line, text) tuple
    assert file.endswith("nccl_p2p.log") and "NCCL WARN" in text


def _big_log(n: int) -> str:
    normal = ("[2025-11-02 10:{m:02d}:{s:02d} TP{r}] Decode batch, #running-req: {n}, #token: {t}, token usage: 0.31, "
              "accept len: 3.10, cuda graph: True, gen throughput (token/s): 1234.56, #queue-req: 0")
    lines = [normal.format(m=i // 6000 % 60, s=i // 100 % 60, r=i % 4, n=i % 97, t=i * 13 % 100000)
             for i in range(n)]
    # plenty of repeated failure lines too (every 10th line a KV transfer failure)
    for i in range(0, n, 10):
        lines[i] = (f"[2025-11-02 10:00:00 TP{i % 4}] Decode transfer failed for request rank=0 "
                    f"decode_req.req.rid='r{i}' decode_req.req.bootstrap_room={i} with exception "
                    f"KVTransferError(bootstrap_room={i}): Request {i} timed out after 300.0s in KVPoll.Bootstrapping")
    return "\n".join(lines) + "\n" + SCHED_TB.format(rank=2, exc="torch.OutOfMemoryError: CUDA out of memory.")


def test_100k_line_log_scales_linearly():
    """A 100k-line log is diagnosed fully, and its cost grows linearly with the log: timed side by side with a
    10k-line log, the ratio is ~10 for a linear scan and ~100 for a quadratic one (a ratio, not a wall-clock
    bound, so a busy machine slows both sides alike)."""
    small, big = _big_log(10_000), _big_log(100_000)
    times = {}
    for name, text in (("small", small), ("big", big), ("small", small), ("big", big)):
        t0 = time.perf_counter()
        found = diagnose_text(text)
        times[name] = min(times.get(name, float("inf")), time.perf_counter() - t0)
    assert [d.category for d in found] == ["kv_transfer", "cuda_oom"]
    assert found[0].occurrences == 10_000
    assert times["big"] / times["small"] < 30, times


@pytest.mark.parametrize("line, path", [
    ("huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
     "'/nonexistent/model'. Use `repo_type` argument if needed.", "/nonexistent/model"),
    ("OSError: /models/dsv4 does not appear to have a file named config.json. Checkout "
     "'https://huggingface.co//models/dsv4/tree/None' for available files.", "/models/dsv4"),
    ("OSError: We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the "
     "cached files. Check your internet connection or see how to run the library in offline mode. "
     "'/mnt/ckpt/DeepSeek-V4-Flash' is not a local folder and is not a valid model identifier",
     "/mnt/ckpt/DeepSeek-V4-Flash"),
])
def test_bad_model_path_is_named(line, path):
    d = only(diagnose_text(SCHED_TB.format(rank=0, exc=line)))
    assert d.category == "model_path" and path in d.cause and d.recognised and "--model-path" in d.fix


def test_cli_directory_without_logs_and_unknown_option(tmp_path, capsys):
    from pd.tools.diagnose import main

    assert main([str(tmp_path)]) == 2
    assert f"{tmp_path} has no *.log files" in capsys.readouterr().err
    assert main(["--verbose", fx("port_in_use.log")]) == 2
    assert "unknown option --verbose" in capsys.readouterr().err
    assert main([fx("port_in_use.log"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["category"] == "port_in_use"


def test_reference_engine_model_path_exit_is_named():
    text = ("2025-11-02 10:00:00,101 INFO pd.engine: starting\n"
            "--model-path /nonexistent/model: no such directory (give a local Hugging Face checkpoint directory, "
            "or builtin:tiny)\n")
    d = only(diagnose_text(text))
    assert d.category == "model_path" and "/nonexistent/model" in d.cause and d.evidence[0].line == 2
