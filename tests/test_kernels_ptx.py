"""The GPU code of the cross-entropy kernels, compiled for an H100/H200 (sm_90) on the CPU: no GPU is needed, since
Triton compiles for any target it has a backend for. What the PTX shows, no timing can hide: whether the logits
stream through 16-byte vector loads and stores or one 16-bit element at a time (issue 64)."""
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels

if kernels.triton is not None:
    import triton.language as tl

    @kernels.triton.jit
    def _probe_kernel(X, BLOCK: tl.constexpr):  # the least a CUDA compile needs: a load and a store
        offs = tl.arange(0, BLOCK)
        tl.store(X + offs, tl.load(X + offs) + 1.0)

SM90 = ("cuda", 90, 32)  # backend, compute capability, warp size
POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int64: "*i64"}


def sm90_ptx(kernel, args, meta):
    """The PTX of kernel as this launch (positional args; constexprs and options in meta) would compile it on an
    H100/H200. The launch's specialization is Triton's own rule, written out: an int divisible by 16 and a 16-byte
    aligned pointer are hinted divisible by 16 (which is what lets Triton prove a vector access aligned), and an int
    equal to 1 becomes a constant."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    values = dict(zip(kernel.arg_names, args)) | meta
    signature, constants, hints = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        v = values[name]
        if kernel.params[i].is_constexpr or (type(v) is int and v == 1):
            signature[name], constants[(i,)] = "constexpr", v
            continue
        if isinstance(v, torch.Tensor):  # the allocator aligns a tensor's storage; its offset may not be
            signature[name], aligned = POINTER[v.dtype], v.storage_offset() * v.element_size() % 16 == 0
        elif isinstance(v, int):
            signature[name], aligned = "i32" if abs(v) < 2 ** 31 else "i64", v % 16 == 0
        else:
            signature[name], aligned = "fp32", False
        if aligned:
            hints[(i,)] = [["tt.divisibility", 16]]
    options = {k: v for k, v in meta.items() if k not in kernel.arg_names}  # num_warps
    src = ASTSource(kernel, signature, constants, hints)
    return kernels.triton.compile(src, target=GPUTarget(*SM90), options=options).asm["ptx"]


def global_accesses(ptx):
    """(vector, scalar 16-bit) loads and stores of global memory in PTX: `ld.global.v4.b32` moves 8 bf16 at once,
    `ld.global.b16` one."""
    ops = [op.split(".") for op in re.findall(r"\b(?:ld|st)\.global[\w.:]*", ptx)]
    vector = [any(re.fullmatch(r"v\d", part) for part in op) for op in ops]
    scalar16 = [not v and op[-1] in ("b16", "u16", "s16", "f16", "bf16") for op, v in zip(ops, vector)]
    return sum(vector), sum(scalar16)


def cuda_compile_error():
    """None if this Triton compiles for sm_90 on this machine, else why not (no NVIDIA backend, no ptxas, ...)."""
    if kernels.triton is None:
        return "triton is not installed"
    try:
        sm90_ptx(_probe_kernel, (torch.empty(16, device="meta"),), dict(BLOCK=16))
    except Exception as e:  # noqa: BLE001 - any failure to compile a trivial kernel for CUDA
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return None


def ce_launches(V, W, N, softcap=0.0):
    """The CE kernels' launches [(kernel, args, meta)], forward and backward, of a GPT's loss in bf16: N rows, V
    classes in a head of W rows, as linear_cross_entropy makes them (kernels._lce_chunks) or, with W None, as
    cross_entropy does on (N, V) logits; recorded on meta tensors, never run."""
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)  # the GPU's tiles
        mp.setattr(kernels, "_launch", lambda kernel, grid, *args, **meta: calls.append((kernel, args, meta)))
        if W is None:
            z = torch.empty(N, V, device="meta", dtype=torch.bfloat16)
            t = torch.empty(N, device="meta", dtype=torch.long)
            _, lse = kernels._ce_fwd(z, t, -100, softcap, 0.0)
            kernels._ce_bwd(z, t, lse, torch.empty(N, device="meta"), -100, softcap, 0.0)
        else:
            mp.setattr(kernels, "_use_triton", lambda *ts, auto=True: True)
            x, w = (torch.empty(n, 768, device="meta", dtype=torch.bfloat16) for n in (N, W))
            t, g = torch.empty(N, device="meta", dtype=torch.long), torch.empty(N, device="meta")
            kernels._lce_chunks(x, w, t, -100, softcap, 0.0, g, V)
    return calls


def access_counts():
    """{case: [vector, scalar 16-bit] global accesses} of every CE kernel launch below, compiled for sm_90, or
    {"error": why} where Triton cannot compile for CUDA here. fresh_access_counts calls it in a child process."""
    error = cuda_compile_error()
    if error:
        return {"error": error}
    counts = {}
    cases = [(V, 50304, softcap) for V in (50257, 50304) for softcap in (0.0, 30.0)] + [(50257, None, 0.0)]
    for V, W, softcap in cases:
        for kernel, args, meta in ce_launches(V, W, N=64, softcap=softcap):
            counts[f"{kernel.__name__} V={V} W={W} softcap={softcap}"] = global_accesses(sm90_ptx(kernel, args, meta))
    return counts


@functools.cache
def fresh_access_counts():
    """access_counts() from a fresh process: once the Triton interpreter has run in a process (the parity tests in
    test_kernels.py), it leaves triton.language patched there, and compiling for CUDA fails."""
    root = Path(__file__).parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests"), env.get("PYTHONPATH", "")])
    code = "import json, test_kernels_ptx as t; print(json.dumps(t.access_counts()))"
    p = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


def compiled_counts():
    """fresh_access_counts(), or a skip that says why Triton cannot compile for CUDA here."""
    counts = fresh_access_counts()
    if "error" in counts:
        pytest.skip(f"Triton cannot compile for CUDA sm_90 on this machine: {counts['error']}")
    return counts


def test_ce_kernels_stream_the_logits_with_vector_accesses_at_gpt2s_odd_vocab():
    """GPT-2's loss, 50,257 classes in a head of 50,304 rows, compiled as its launches would be, with and without a
    softcap: every access to the logits is a vector one, as at 50,304 classes. Masked by `col < 50,257` instead,
    every one was a scalar 16-bit access (forward 17, backward 32); the forward keeps one, the target's own logit."""
    padded = {case: n for case, n in compiled_counts().items() if "W=50304" in case}
    assert len(padded) == 8
    for case, (vector, scalar16) in padded.items():
        target = 1 if case.startswith("_ce_fwd_kernel") else 0  # the forward's load of the target's logit
        assert vector >= 2 and scalar16 <= target, (case, vector, scalar16)


def test_unpadded_logits_still_compile():
    """cross_entropy on (N, 50,257) logits, whose rows have no width divisible by 16 to stream: scalar accesses,
    correct all the same (test_kernels.py); here so that the counter is seen to tell the two paths apart."""
    unpadded = {case: n for case, n in compiled_counts().items() if "W=None" in case}
    assert len(unpadded) == 2
    for case, (vector, scalar16) in unpadded.items():
        assert vector == 0 and scalar16 >= 16, (case, vector, scalar16)
