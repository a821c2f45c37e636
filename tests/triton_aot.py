"""Ahead-of-time Triton compiles for GPUs this machine does not have (docs/design.md, testing tier 3).

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` runs the whole NVIDIA pipeline down to
PTX/cubin on a CPU-only machine, so every kernel config is checked for sm_120a (RTX PRO 6000 Blackwell:
mma.sync tensor cores, no wgmma, 99 KiB = 101376 bytes of shared memory per block) and sm_90a (H200).
"""

from __future__ import annotations

import os

import pytest

SM120_SHARED_LIMIT = 101376  # bytes of shared memory per block on sm_120 (99 KiB)

# AOT needs the real compiler; under TRITON_INTERPRET=1 the kernels are interpreted instead.
AOT_REASON = "AOT compile needs the compiler, not the interpreter"
aot = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason=AOT_REASON)


def compile_for(fn, signature: dict, constexprs: dict, cc: int, num_warps: int = 4, num_stages: int = 2,
                aligned: tuple = (), maxnreg: int | None = None):
    """Compile the ``@triton.jit`` function ``fn`` for compute capability ``cc`` (120 or 90).

    ``signature`` maps each runtime argument to a Triton type string ("*bf16", "i32", "fp32", ...); every
    name in ``constexprs`` is added as "constexpr". ``aligned`` names arguments to specialize as divisible by
    16, as the launcher does at run time for 16-byte-aligned pointers (vector loads and cp.async pipelining,
    hence the real shared-memory use, depend on it); ``maxnreg`` caps registers per thread, as the launch option
    does. Returns the compiled kernel (``.asm["ptx"]``, ``.metadata.shared`` in bytes). Raises whatever Triton
    raises when the kernel does not lower.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       **({"maxnreg": maxnreg} if maxnreg else {})))


def assert_sm120_ok(kernel, needs_mma: bool = True) -> None:
    """An sm_120a build: mma.sync tensor-core ops (when ``needs_mma``), no wgmma, shared memory within 99 KiB."""
    ptx = kernel.asm["ptx"]
    assert "wgmma" not in ptx, "sm_120 has no wgmma"
    if needs_mma:
        assert "mma.sync" in ptx, "expected mma.sync tensor-core ops in the sm_120a PTX"
    shared = kernel.metadata.shared
    assert shared <= SM120_SHARED_LIMIT, f"shared memory {shared} > {SM120_SHARED_LIMIT}"
