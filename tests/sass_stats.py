"""SASS statistics of a compiled Triton kernel, for instruction-count checks that need no GPU.

A test helper, not part of the shipped package: tests/test_mxfp4_moe.py (regression bounds on the MXFP4 MoE K loop)
imports it from here (tests/ is on its path), and benchmarks/kernels/mxfp4_moe_sass.py (the per-weight table)
puts tests/ on its path for it, as benchmarks/kernels/ptx_fingerprint.py does for tests/triton_aot.py. The
disassembler is the ``cuobjdump`` that ships inside Triton's NVIDIA backend, so a CPU-only machine with Triton
installed suffices.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

_SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4})\*/\s+(.*)")
_BRANCH_TARGET = re.compile(r"BRA\s.*0x([0-9a-f]+)\s*;")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def cuobjdump_path() -> str:
    """Path of the cuobjdump bundled with the installed Triton (raises FileNotFoundError if it is missing)."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise FileNotFoundError(f"cuobjdump not found at {path} (Triton without its NVIDIA tools?)")
    return path


def _cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump_path(), flag, f.name], capture_output=True, text=True, check=True).stdout


def longest_loop(cubin: bytes) -> tuple[int, collections.Counter]:
    """(instructions, opcode -> count) of the longest loop in the cubin: the span from a backward branch's target
    to the branch itself, i.e. the body of a kernel's main (K) loop. (0, empty) when there is no loop.

    Opcodes are the mnemonic with its modifiers (``HMMA.16816.F32.BF16``), predicates stripped.
    Raises: subprocess.CalledProcessError if cuobjdump rejects the cubin.
    """
    lines = [m for m in map(_SASS_LINE.match, _cuobjdump(cubin, "-sass").splitlines()) if m]
    addr = [int(m.group(1), 16) for m in lines]
    index = {a: i for i, a in enumerate(addr)}
    best = (0, 0, -1)
    for i, m in enumerate(lines):
        tgt = _BRANCH_TARGET.search(m.group(2))
        if tgt and index.get(int(tgt.group(1), 16), i + 1) <= i:
            j = index[int(tgt.group(1), 16)]
            if i - j + 1 > best[0]:
                best = (i - j + 1, j, i)
    n, j, i = best
    ops = collections.Counter(_PREDICATE.sub("", m.group(2)).split()[0].rstrip(";") for m in lines[j:i + 1])
    return n, ops


def innermost_loop_with(cubin: bytes, opcode_prefix: str) -> tuple[int, collections.Counter]:
    """(instructions, opcode -> count) of the shortest loop (backward branch target .. branch) whose body holds an
    instruction whose opcode starts with ``opcode_prefix`` (e.g. "QGMMA": the per-tile loop of a kernel whose
    tile loop sits inside an outer one, which ``longest_loop`` would return). (0, empty) when there is none.

    Raises: subprocess.CalledProcessError if cuobjdump rejects the cubin.
    """
    lines = [m for m in map(_SASS_LINE.match, _cuobjdump(cubin, "-sass").splitlines()) if m]
    index = {int(m.group(1), 16): i for i, m in enumerate(lines)}
    ops = [_PREDICATE.sub("", m.group(2)).split()[0].rstrip(";") for m in lines]
    best = None
    for i, m in enumerate(lines):
        tgt = _BRANCH_TARGET.search(m.group(2))
        j = index.get(int(tgt.group(1), 16), i + 1) if tgt else i + 1
        shorter = best is None or i - j < best[1] - best[0]
        if j <= i and shorter and any(o.startswith(opcode_prefix) for o in ops[j:i + 1]):
            best = (j, i)
    if best is None:
        return 0, collections.Counter()
    return best[1] - best[0] + 1, collections.Counter(ops[best[0]:best[1] + 1])


def registers(cubin: bytes) -> int | None:
    """Registers per thread of the cubin's kernel (``cuobjdump -res-usage``), None if not reported."""
    m = re.search(r"REG:(\d+)", _cuobjdump(cubin, "-res-usage"))
    return int(m.group(1)) if m else None
