"""
kernels.py: the Triton kernels shared by the trainsuite scripts, each beside a pure-PyTorch reference.

  attention(q, k, v, causal=True, scale=None)         flash attention, fwd + bwd, GQA/MQA, any T, head dim <= 256
  rms_norm(x, weight=None, eps=1e-6)                  RMSNorm over the last dim, fwd + bwd (dx, dweight)
  cross_entropy(logits, targets, ...)                 online-logsumexp CE with softcap, z-loss, ignore_index
  linear_cross_entropy(x, weight, targets, ...)       x @ weight.T fused with the CE, chunked; padding rows masked

Each public function runs Triton on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (read at call time),
and PyTorch's own fused ops otherwise (F.scaled_dot_product_attention, F.rms_norm, F.cross_entropy; the linear + CE
in chunks of plain PyTorch). kernels.use() picks: "auto" the faster per op on an H100, "triton" Triton wherever it
runs, "torch" PyTorch's always; backend(device) names the choice in force. Each `*_ref` is written from the math and
only checks the others. The Triton paths are torch.library custom ops, so torch.compile(fullgraph=True) traces them.

  python kernels.py --bench        # GPU: TFLOP/s, GB/s, ms and peak memory of our Triton kernels against PyTorch
  python kernels.py --bench_window # GPU: ms of a window of T/4, the masked SDPA against FlexAttention
  python -m pytest tests/test_kernels.py -q   # the tests set TRITON_INTERPRET=1 themselves for the kernel checks

Under the interpreter, tiles are fixed and small and tl.dot is exact only for fp32/fp16 (numpy has no bf16 matmul);
on GPU the attention tiles are autotuned per (T, head dim, causal, T % 128 == 0).
"""
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs, Windows, MPS: every public function runs PyTorch's ops
    triton = None


def _interpret():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_backend = "auto"


def use(name):
    """Pick the path: "auto" (the faster of the two per op, as measured on an H100: Triton for the losses, PyTorch's
    SDPA for attention, and for RMSNorm Triton in eager but PyTorch's op under torch.compile, where Inductor fuses it
    with its neighbours), "triton" (Triton wherever it runs) or "torch" (PyTorch's ops always). Triton runs on CUDA,
    or on the CPU under TRITON_INTERPRET=1; PyTorch's ops everywhere else, whatever the choice."""
    global _backend
    if name not in ("auto", "triton", "torch"):
        raise ValueError(f"kernels.use: backend must be 'auto', 'triton' or 'torch', got {name!r}")
    _backend = name


def backend(device):
    """The choice in force for tensors on device, for log lines: "torch" where Triton cannot run, else use()'s."""
    kind = torch.device(device).type
    on = triton is not None and (kind == "cuda" or (kind == "cpu" and _interpret()))
    return _backend if on else "torch"


def _use_triton(*ts, auto=True):
    """Whether Triton runs for these tensors; auto is the op's choice under use("auto")."""
    return all(backend(t.device) in ("triton", "auto" if auto else "") for t in ts)


_interpreted = {}


def _launch(kernel, grid, *args, **meta):
    """Launch a @triton.jit kernel; under the interpreter, wrap its Python function (triton.jit decides at import)."""
    if not _interpret():
        return kernel[grid](*args, **meta)
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    fn = kernel
    while hasattr(fn, "fn"):  # an Autotuner wraps a JITFunction, which wraps the Python function
        fn = fn.fn
    if fn not in _interpreted:
        _interpreted[fn] = InterpretedFunction(fn)
    # tl.sum, tl.max, ... are @triton.jit too: made before the variable was set, they need interpreting as well
    call, JITFunction.__call__ = JITFunction.__call__, lambda self, *a, **k: InterpretedFunction(self.fn)(*a, **k)
    try:
        meta = {k: v for k, v in meta.items() if k not in ("num_warps", "num_stages")}  # GPU-only launch options
        return _interpreted[fn][grid](*args, **meta)
    finally:
        JITFunction.__call__ = call


def _num_programs(device, n, per_sm=1):
    """Persistent-style program count: per_sm per SM on GPU, a few under the interpreter."""
    if device.type == "cuda":
        return min(n, per_sm * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(n, 4)


# -----------------------------------------------------------------------------
# RMSNorm


def rms_norm_ref(x, weight=None, eps=1e-6):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim, in fp32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


if triton is not None:
    @triton.jit
    def _rms_fwd_kernel(X, W, Y, RSTD, M, N, eps, HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # a tile of ROWS rows per program: narrow rows (QK-norm's head dim of 64) still give each program enough bytes
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(X + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        y = x * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=rows < M)

    @triton.jit
    def _rms_bwd_kernel(DY, X, W, RSTD, DX, DW, M, N, rows_per_prog, HAS_W: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK: tl.constexpr):
        # each program owns a slab of rows, walked a tile of ROWS at a time, and keeps its dweight partial in
        # registers: (n_prog, N) partials in DW, summed after
        cols = tl.arange(0, BLOCK)
        cmask = cols < N
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :] if HAS_W else 1.0
        dw = tl.zeros((BLOCK,), dtype=tl.float32)
        start = tl.program_id(0).to(tl.int64) * rows_per_prog  # int64 offsets: M * N may pass 2^31
        for r in range(0, rows_per_prog, ROWS):
            rows = start + r + tl.arange(0, ROWS)
            mask = (rows[:, None] < M) & cmask[None, :]
            offs = rows[:, None] * N + cols[None, :]
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rows < M, other=0.0)[:, None]
            xhat = x * rstd
            g = dy * w
            dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=1) / N)[:, None])  # d/dx of x*rstd, row by row
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * xhat, axis=0)
        tl.store(DW + tl.program_id(0) * N + cols, dw, mask=cmask)


def _rms_tile(N):
    """(BLOCK, ROWS, num_warps): the row padded to a power of two, and rows per tile for about 4096 elements."""
    block = triton.next_power_of_2(N)
    return block, max(1, 4096 // block), 4 if block <= 4096 else 8 if block <= 8192 else 16


@torch.library.custom_op("trainsuite::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = x.contiguous().view(-1, x.shape[-1])  # (M, N)
    M, N = x2.shape
    y, rstd = torch.empty_like(x2), torch.empty(M, device=x.device, dtype=torch.float32)
    if M == 0:
        return y.view(x.shape), rstd
    w = weight.contiguous() if weight is not None else x2
    block, rows, warps = _rms_tile(N)
    _launch(_rms_fwd_kernel, (triton.cdiv(M, rows),), x2, w, y, rstd, M, N, eps, HAS_W=weight is not None,
            ROWS=rows, BLOCK=block, num_warps=warps)
    return y.view(x.shape), rstd


# Each fake kernel returns contiguous tensors, as the real op does: empty_like would copy a permuted input's strides,
# and torch.compile would then plan wrong memory (found on the first GPU run: every compiled model crashed).
@_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@torch.library.custom_op("trainsuite::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                     rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x2, dy2 = (t.contiguous().view(-1, x.shape[-1]) for t in (x, dy))
    M, N = x2.shape
    dx = torch.empty_like(x2)
    block, rows, warps = _rms_tile(N)
    tiles = triton.cdiv(M, rows)
    n_prog = max(1, _num_programs(x.device, tiles, 4))
    rows_per_prog = rows * triton.cdiv(tiles, n_prog)
    n_prog = triton.cdiv(M, rows_per_prog) if M else 1
    dw_part = torch.zeros(n_prog, N, device=x.device, dtype=torch.float32)
    w = weight.contiguous() if weight is not None else x2
    _launch(_rms_bwd_kernel, (n_prog,), dy2, x2, w, rstd, dx, dw_part, M, N, rows_per_prog,
            HAS_W=weight is not None, ROWS=rows, BLOCK=block, num_warps=warps)
    dw = dw_part.sum(0).to(weight.dtype) if weight is not None else x.new_empty(0)
    return dx.view(x.shape), dw


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), (weight.new_empty(weight.shape) if weight is not None else x.new_empty(0))


def _rms_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_backward(ctx, dy, drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_bwd_op(dy.contiguous(), x, weight, rstd)
    return dx, (dw if weight is not None else None), None


_rms_norm_op.register_autograd(_rms_backward, setup_context=_rms_setup)


class _RMSNormEager(torch.autograd.Function):
    """RMSNorm with its backward written out, for eager runs on the CPU. F.rms_norm's autograd records the forward
    op by op (pow, mean, add, rsqrt, mul) and runs each op's backward: about twice the passes over x of this one."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        # the mean square from the row's norm, in one pass over x that writes nothing of x's size
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)  # (..., 1)
        rstd = torch.rsqrt(norm.square() / x.shape[-1] + eps)
        y = (x * rstd).to(x.dtype)  # x normalised, before the gain
        ctx.save_for_backward(y, rstd, weight)
        return y if weight is None else y * weight.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        y, rstd, weight = ctx.saved_tensors
        g = dy.float()
        yf = y.float()
        dw = None
        if weight is not None:
            if ctx.needs_input_grad[1]:
                dw = (g * yf).flatten(0, -2).sum(0).to(weight.dtype)
            g = g * weight.float()
        # y = x * rstd, and rstd depends on every x of the row: dx = rstd * (g - y * mean(g * y)) row by row
        dx = torch.addcmul(g, yf, (g * yf).mean(-1, keepdim=True), value=-1) * rstd
        return dx.to(y.dtype), dw, None


def _rms_torch(x, weight, eps):
    """F.rms_norm, which accumulates in fp32; on the CPU in eager mode, the same with a shorter backward. Its fused
    kernel wants one dtype (an fp32 gain on bf16 activations, as under autocast, takes a slow path and warns), and
    the output keeps x's dtype under any autocast, as the ref's."""
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        return _RMSNormEager.apply(x, weight, eps)
    w = weight.to(x.dtype) if weight is not None else None
    return F.rms_norm(x, (x.shape[-1],), w, eps).to(x.dtype)


def rms_norm(x, weight=None, eps=1e-6):
    """RMSNorm over the last dim of x (any leading shape), optional elementwise weight."""
    if not _use_triton(x, auto=not torch.compiler.is_compiling()):
        return _rms_torch(x, weight, eps)
    return _rms_norm_op(x, weight, eps)[0]


# -----------------------------------------------------------------------------
# Cross-entropy


def cross_entropy_ref(logits, targets, ignore_index=-100, softcap=None, z_loss=0.0, reduction="mean"):
    """CE on (N, V) logits in fp32: optional cap*tanh(logits/cap), plus z_loss * logsumexp^2 per row."""
    z = logits.float()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, dim=-1)
    valid = targets != ignore_index
    zt = z.gather(1, torch.where(valid, targets, 0)[:, None]).squeeze(1)
    loss = torch.where(valid, lse - zt + z_loss * lse * lse, 0.0)
    return _reduce(loss, valid, reduction).to(logits.dtype)


def _reduce(loss, valid, reduction):
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().clamp(min=1)  # mean over non-ignored rows (0, not nan, when all are ignored)


if triton is not None:
    # A row of logits starts at Z + row * stride and is W wide in memory (W <= stride), of which the first V are classes
    # and the rest padding (GPT-2's 50,257 classes in a head of 50,304 rows). The loops stream all W columns and mask
    # by W; the true V enters only through tl.where. Why: Triton proves a load aligned only from integers divisible by
    # 16 (a launch specializes on W and stride): a mask of `col < V` at an odd V would make every access to the
    # logits a scalar 16-bit one, where `col < W` gives 16-byte vector accesses (BENCHMARKS.md, issue 64). A row of
    # an odd W (an unpadded (N, V) tensor) runs too, with scalar accesses.
    @triton.jit
    def _ce_fwd_kernel(Z, T, LOSS, LSE, V, W, stride, ignore_index, softcap, z_loss, SOFTCAP: tl.constexpr,
                       BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        t = tl.load(T + row)
        m = tl.full((BLOCK,), float("-inf"), tl.float32)  # per-lane running max and sum: one reduction at the end
        s = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, W, BLOCK):
            col = start + tl.arange(0, BLOCK)
            z = tl.load(Z + row * stride + col, mask=col < W, other=0.0).to(tl.float32)
            if SOFTCAP:  # cap * tanh(z / cap), tanh written with exp so it works everywhere
                z = softcap * (1.0 - 2.0 / (tl.exp(2.0 * z / softcap) + 1.0))
            z = tl.where(col < V, z, float("-inf"))  # padding, and past the row's end: no probability
            m_new = tl.maximum(m, z)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes that have seen only padding
            s = s * tl.exp(m - m_safe) + tl.exp(z - m_safe)
            m = m_new
        mx = tl.max(m, axis=0)
        lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), axis=0))
        valid = t != ignore_index
        zt = tl.load(Z + row * stride + tl.where(valid, t, 0)).to(tl.float32)
        if SOFTCAP:
            zt = softcap * (1.0 - 2.0 / (tl.exp(2.0 * zt / softcap) + 1.0))
        loss = tl.where(valid, lse - zt + z_loss * lse * lse, 0.0)
        tl.store(LOSS + row, loss)
        tl.store(LSE + row, lse)

    @triton.jit
    def _ce_bwd_kernel(Z, T, LSE, DLOSS, DZ, V, W, stride, ignore_index, softcap, z_loss,
                       SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        t = tl.load(T + row)
        lse = tl.load(LSE + row)
        dl = tl.where(t != ignore_index, tl.load(DLOSS + row), 0.0)
        for start in range(0, W, BLOCK):
            col = start + tl.arange(0, BLOCK)
            z = tl.load(Z + row * stride + col, mask=col < W, other=0.0).to(tl.float32)
            if SOFTCAP:
                z = softcap * (1.0 - 2.0 / (tl.exp(2.0 * z / softcap) + 1.0))
            # d(lse - z_t + zl*lse^2)/dz = softmax * (1 + 2*zl*lse) - onehot(t)
            g = tl.exp(z - lse) * (1.0 + 2.0 * z_loss * lse) - tl.where(col == t, 1.0, 0.0)
            if SOFTCAP:  # chain rule through cap*tanh(x/cap): 1 - tanh^2
                g = g * (1.0 - (z / softcap) * (z / softcap))
            # the padding columns get grad 0, written here: the padding rows of the head then get no gradient, with
            # no separate pass to zero them
            g = tl.where(col < V, g * dl, 0.0)
            tl.store(DZ + row * stride + col, g.to(DZ.dtype.element_ty), mask=col < W)


def _ce_block(W):
    return min(triton.next_power_of_2(W), 1024 if _interpret() else 4096)


def _ce_fwd(z, t, ignore_index, softcap, z_loss, classes=None):
    """Per-row loss and logsumexp (both fp32, (N,)) of (N, W) logits whose rows are contiguous; only the first
    `classes` columns (all by default) are classes, the rest padding."""
    N, W = z.shape
    V = W if classes is None else classes
    loss, lse = (torch.empty(N, device=z.device, dtype=torch.float32) for _ in range(2))
    _launch(_ce_fwd_kernel, (N,), z, t, loss, lse, V, W, z.stride(0), ignore_index, softcap, z_loss,
            SOFTCAP=softcap > 0, BLOCK=_ce_block(W), num_warps=8)
    return loss, lse


def _ce_bwd(z, t, lse, dloss, ignore_index, softcap, z_loss, classes=None, out=None):
    """dlogits (like z, 0 in the padding columns) for per-row upstream grads dloss (N,) fp32; out=z overwrites the
    logits (each program reads its row's logits before it writes their grads)."""
    N, W = z.shape
    V = W if classes is None else classes
    dz = torch.empty_like(z) if out is None else out
    _launch(_ce_bwd_kernel, (N,), z, t, lse, dloss, dz, V, W, z.stride(0), ignore_index, softcap, z_loss,
            SOFTCAP=softcap > 0, BLOCK=_ce_block(W), num_warps=8)
    return dz


@torch.library.custom_op("trainsuite::cross_entropy", mutates_args=())
def _ce_op(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, softcap: float,
           z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _ce_fwd(logits.contiguous(), targets.contiguous(), ignore_index, softcap, z_loss)


@_ce_op.register_fake
def _(logits, targets, ignore_index, softcap, z_loss):
    n = logits.shape[0]
    return logits.new_empty(n, dtype=torch.float32), logits.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("trainsuite::cross_entropy_bwd", mutates_args=())
def _ce_bwd_op(dloss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
               ignore_index: int, softcap: float, z_loss: float) -> torch.Tensor:
    return _ce_bwd(logits.contiguous(), targets.contiguous(), lse, dloss.float().contiguous(),
                   ignore_index, softcap, z_loss)


@_ce_bwd_op.register_fake
def _(dloss, logits, targets, lse, ignore_index, softcap, z_loss):
    return logits.new_empty(logits.shape)


def _ce_setup(ctx, inputs, output):
    logits, targets, ctx.ignore_index, ctx.softcap, ctx.z_loss = inputs
    ctx.save_for_backward(logits, targets, output[1])


def _ce_backward(ctx, dloss, dlse):
    logits, targets, lse = ctx.saved_tensors
    return _ce_bwd_op(dloss, logits, targets, lse, ctx.ignore_index, ctx.softcap, ctx.z_loss), None, None, None, None


_ce_op.register_autograd(_ce_backward, setup_context=_ce_setup)


def _ce_torch(logits, targets, ignore_index, softcap, z_loss, reduction):
    """cross_entropy through PyTorch's fused log-softmax and nll in fp32, plus the softcap and z-loss terms."""
    z = logits.float()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    valid = targets != ignore_index
    if z_loss:  # F.cross_entropy split in two, to reuse its log-softmax: log_softmax(z) = z - lse in every column
        lp = F.log_softmax(z, -1)
        ti = torch.where(valid, targets, 0)[:, None]  # the target's column, finite wherever the loss is
        lse = torch.where(valid, (z.gather(1, ti) - lp.gather(1, ti)).squeeze(1), 0.0)
        loss = F.nll_loss(lp, targets, ignore_index=ignore_index, reduction="none") + z_loss * lse * lse
    else:
        loss = F.cross_entropy(z, targets, ignore_index=ignore_index, reduction="none")  # 0 on ignored rows
    return _reduce(loss, valid, reduction).to(logits.dtype)


def cross_entropy(logits, targets, ignore_index=-100, softcap=None, z_loss=0.0, reduction="mean"):
    """Cross-entropy of (N, V) logits against (N,) targets; softcap, z-loss, ignore_index, mean|sum|none."""
    if not _use_triton(logits):
        return _ce_torch(logits, targets, ignore_index, softcap, z_loss, reduction)
    loss, _ = _ce_op(logits, targets, ignore_index, float(softcap or 0.0), float(z_loss))
    return _reduce(loss, targets != ignore_index, reduction).to(logits.dtype)


# -----------------------------------------------------------------------------
# Linear + cross-entropy, chunked over rows so the (N, V) logits never exist at once


def linear_cross_entropy_ref(x, weight, targets, ignore_index=-100, softcap=None, z_loss=0.0, reduction="mean",
                             classes=None):
    """cross_entropy_ref(x @ weight[:classes].T, ...) with the full logits materialised."""
    return cross_entropy_ref(x @ weight[:classes].T, targets, ignore_index, softcap, z_loss, reduction)


def _ce_rows_torch(z, t, ignore_index, softcap, z_loss, dloss, classes):
    """Per-row loss and dlogits of a chunk in plain PyTorch (the non-Triton path); mirrors _ce_fwd/_ce_bwd_kernel.
    The padding columns, from `classes` on, are set to -inf: no probability, no gradient. All in place in zf, the
    chunk's own (chunk, V) buffer: on a CPU a pass over it costs about a matmul's time (BENCHMARKS.md, issue 49)."""
    th = torch.tanh(z.float() / softcap) if softcap else None
    zf = softcap * th if softcap else z.float()  # z itself in fp32
    zf[:, classes:] = float("-inf")
    valid = t != ignore_index
    ti = torch.where(valid, t, 0)[:, None]  # the target's column, finite wherever the loss is
    zt = zf.gather(1, ti).squeeze(1)
    logp = torch.ops.aten._log_softmax.out(zf, -1, False, out=zf)  # zf - lse, row by row
    nll = -logp.gather(1, ti).squeeze(1)
    lse = zt + nll
    loss = torch.where(valid, nll + z_loss * lse * lse, 0.0)
    if dloss is None:
        return loss, None
    # d(lse - z_t + zl*lse^2)/dz = softmax * (1 + 2*zl*lse) - onehot(t), times the row's grad
    dl = torch.where(valid, dloss, 0.0)
    g = logp.exp_().mul_(((1 + 2 * z_loss * lse) * dl)[:, None])
    g.scatter_add_(1, ti, -dl[:, None])
    if softcap:  # chain rule through cap*tanh(x/cap): 1 - tanh^2, in place
        g.mul_(th.square_().neg_().add_(1))
    return loss, g.to(z.dtype)


CHUNK_LOGITS = 1 << 27  # logits per chunk of rows (256 MB in bf16): matmuls large enough to run at full speed


def _lce_chunks(x, w, t, ignore_index, softcap, z_loss, row_grad, V):
    """Per-row loss (N,) fp32 and, when row_grad (N,) is given, dx and dweight (w's dtype) of sum(row_grad * loss)
    over the first V rows of w, the classes. Each chunk's logits become their own grads in place; dweight accumulates
    in place (addmm_, as Liger's kernel). The matmuls keep w's padded width: on a CPU too a width of 4,353 runs
    1.35x slower than 4,416."""
    N, d = x.shape
    chunk = 1 << max(0, (CHUNK_LOGITS // w.shape[0]).bit_length() - 1)  # a power of two of rows
    use_triton = _use_triton(x)
    loss = torch.empty(N, device=x.device, dtype=torch.float32)
    dx, dw = (torch.empty_like(x), torch.zeros_like(w)) if row_grad is not None else (None, None)
    for i in range(0, N, chunk):
        xc, tc = x[i:i + chunk], t[i:i + chunk]
        z = xc @ w.T  # (chunk, rows of w)
        g = row_grad[i:i + chunk] if row_grad is not None else None
        if use_triton:  # the kernels stream whole rows, padding too, and mask the columns from V on
            loss[i:i + chunk], lse = _ce_fwd(z, tc, ignore_index, softcap, z_loss, V)
            if g is not None:  # the grads overwrite the logits, 0 in the padding columns
                _ce_bwd(z, tc, lse, g.contiguous(), ignore_index, softcap, z_loss, V, out=z)
            dz = z if g is not None else None
        else:
            loss[i:i + chunk], dz = _ce_rows_torch(z, tc, ignore_index, softcap, z_loss, g, V)
        if dz is not None:  # the padding columns of dz are 0: the padding rows of w get no gradient
            torch.mm(dz, w, out=dx[i:i + chunk])
            dw.addmm_(dz.T, xc)
    return loss, dx, dw


@torch.library.custom_op("trainsuite::linear_cross_entropy", mutates_args=())
def _lce_op(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, softcap: float,
            z_loss: float, reduction: str, need_grad: bool,
            classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, weight, targets = x.contiguous(), weight.contiguous(), targets.contiguous()
    # the mean's divisor stays on the device: reading it on the host would stall the GPU at every step
    count = ((targets != ignore_index).sum().clamp(min=1) if reduction == "mean" else targets.new_ones(())).float()
    if reduction == "none" or not need_grad:  # "none": dweight needs each row's upstream grad, so backward makes it
        loss, _, _ = _lce_chunks(x, weight, targets, ignore_index, softcap, z_loss, None, classes)
        loss = loss if reduction == "none" else loss.sum() / count
        return loss.to(x.dtype), x.new_empty(0), weight.new_empty(0)
    loss, dx, dw = _lce_chunks(x, weight, targets, ignore_index, softcap, z_loss, count.reciprocal().expand(len(x)),
                               classes)
    return (loss.sum() / count).to(x.dtype), dx, dw


@_lce_op.register_fake
def _(x, weight, targets, ignore_index, softcap, z_loss, reduction, need_grad, classes):
    loss = x.new_empty(x.shape[0] if reduction == "none" else ())
    if reduction == "none" or not need_grad:
        return loss, x.new_empty(0), weight.new_empty(0)
    return loss, x.new_empty(x.shape), weight.new_empty(weight.shape)


@torch.library.custom_op("trainsuite::linear_cross_entropy_bwd", mutates_args=())
def _lce_bwd_op(dloss: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                ignore_index: int, softcap: float, z_loss: float, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, dx, dw = _lce_chunks(x.contiguous(), weight.contiguous(), targets.contiguous(), ignore_index, softcap,
                            z_loss, dloss.float().contiguous(), classes)
    return dx, dw


@_lce_bwd_op.register_fake
def _(dloss, x, weight, targets, ignore_index, softcap, z_loss, classes):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _lce_setup(ctx, inputs, output):
    x, weight, targets, ctx.ignore_index, ctx.softcap, ctx.z_loss, ctx.reduction, _, ctx.classes = inputs
    if ctx.reduction == "none":
        ctx.save_for_backward(x, weight, targets)
    else:
        ctx.save_for_backward(output[1], output[2], weight)


def _lce_backward(ctx, dloss, ddx, ddw):
    if ctx.reduction == "none":
        x, weight, targets = ctx.saved_tensors
        dx, dw = _lce_bwd_op(dloss.contiguous(), x, weight, targets, ctx.ignore_index, ctx.softcap, ctx.z_loss,
                             ctx.classes)
        return dx, dw, None, None, None, None, None, None, None
    dx, dw, weight = ctx.saved_tensors
    return dx * dloss.to(dx.dtype), dw * dloss.to(dw.dtype), None, None, None, None, None, None, None


_lce_op.register_autograd(_lce_backward, setup_context=_lce_setup)


SMALL_LOGITS = 1 << 24  # below this many logits, PyTorch's path makes them whole: the chunks would only cost time


def linear_cross_entropy(x, weight, targets, ignore_index=-100, softcap=None, z_loss=0.0, reduction="mean",
                         classes=None):
    """cross_entropy(x @ weight.T, targets, ...) without materialising the (N, V) logits; grads made in forward. Only
    the first `classes` rows of weight are classes (all by default): the rest pad the matmul to a fast shape, and get
    neither probability nor gradient (a vocabulary of 50,257 padded to 50,304: zero rows would take logit 0, far
    above a trained model's)."""
    classes = weight.shape[0] if classes is None else classes
    if not _use_triton(x) and classes == weight.shape[0] and x.shape[0] * weight.shape[0] <= SMALL_LOGITS:
        return _ce_torch(x @ weight.T, targets, ignore_index, softcap, z_loss, reduction)  # padding: the chunks mask it
    need_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)  # eval: loss only
    return _lce_op(x, weight, targets, ignore_index, float(softcap or 0.0), float(z_loss), reduction, need_grad,
                   classes)[0]


# -----------------------------------------------------------------------------
# Attention


def attention_ref(q, k, v, causal=True, scale=None, window=None):
    """softmax(q k^T * scale) v in fp32; q (B, Hq, T, D), k and v (B, Hkv, T, D), a kv head per Hq/Hkv q heads. With a
    window W, query i sees key j if and only if i - W < j <= i (sliding-window attention, Beltagy et al. 2020)."""
    B, Hq, T, D = q.shape
    Tk, G = k.shape[2], Hq // k.shape[1]
    qf, kf, vf = q.float(), k.float().repeat_interleave(G, 1), v.float().repeat_interleave(G, 1)
    s = (qf @ kf.transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(D))  # (B, Hq, T, Tk)
    if causal:  # aligned bottom-right when T < Tk (queries are the last T positions, as with a KV cache)
        s = s.masked_fill(torch.ones(T, Tk, dtype=torch.bool, device=q.device).triu(Tk - T + 1), float("-inf"))
    if window:  # query i is key position Tk - T + i: keys at or before that minus W are out of its window
        s = s.masked_fill(torch.ones(T, Tk, dtype=torch.bool, device=q.device).tril(Tk - T - window), float("-inf"))
    return (torch.softmax(s, dim=-1) @ vf).to(q.dtype)


def _attn_autotune(configs):
    """Tile shapes to try on GPU, (BLOCK_M, BLOCK_N, warps, stages); the interpreter bypasses the autotuner and takes
    _attn_meta's blocks. Every block divides 128, so EVEN_T (T % 128 == 0) means no tile crosses the end."""
    cfgs = [triton.Config(dict(BLOCK_M=m, BLOCK_N=n), num_warps=w, num_stages=s) for m, n, w, s in configs]
    return lambda fn: triton.autotune(cfgs, key=["T", "BLOCK_D", "CAUSAL", "EVEN_T"])(triton.jit(fn))


# forward and dq walk keys for a block of queries (BLOCK_M a multiple of BLOCK_N); dk/dv walk queries for a block of
# keys (BLOCK_N a multiple of BLOCK_M), so each diagonal tile starts where a block starts
_ROWS_CFGS = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 4)]
_COLS_CFGS = [(32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 3), (64, 64, 4, 3), (32, 64, 4, 3)]

if triton is not None:
    @triton.jit
    def _attn_tile(base, rows, offs_d, T, D, MASK: tl.constexpr, EVEN_D: tl.constexpr):
        """The (rows, BLOCK_D) tile of a (T, D) matrix: masked past T only if MASK, past D only if not EVEN_D."""
        ptrs = base + rows[:, None] * D + offs_d[None, :]
        if MASK:
            x = tl.load(ptrs, mask=(rows[:, None] < T) & (offs_d[None, :] < D), other=0.0)
        elif EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
        return x

    @triton.jit
    def _attn_keep(rows, cols, T, CAUSAL: tl.constexpr):
        """Which scores count: keys inside T and (causal) none after its query. Rows past T load zeros and are never
        stored, so they need no mask."""
        keep = cols[None, :] < T
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        return keep

    @triton.jit
    def _attn_fwd_inner(acc, l_i, m_i, q, Kb, Vb, offs_m, offs_d, lo, hi, qk_scale, T, D, CAUSAL: tl.constexpr,
                        MASK: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr):
        # the online softmax over key blocks lo..hi; only tiles that touch the diagonal or the end need MASK
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            k = _attn_tile(Kb, cols, offs_d, T, D, MASK, EVEN_D)
            v = _attn_tile(Vb, cols, offs_d, T, D, MASK, EVEN_D)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
            if MASK:
                s = tl.where(_attn_keep(offs_m, cols, T, CAUSAL), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: column 0 is in the first block of every row
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return acc, l_i, m_i

    @_attn_autotune(_ROWS_CFGS)
    def _attn_fwd_kernel(Q, K, V, O, LSE, qk_scale, T, D, Hq, G, CAUSAL: tl.constexpr, EVEN_T: tl.constexpr,
                         EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        # one program per (block of BLOCK_M queries, batch * q head); q head h reads kv head h // G
        start_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        bkv = (bh // Hq) * (Hq // G) + (bh % Hq) // G
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)  # head dim padded to a power of two, masked past D
        q = _attn_tile(Q + bh * T * D, offs_m, offs_d, T, D, True, EVEN_D)
        Kb, Vb = K + bkv * T * D, V + bkv * T * D
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        if CAUSAL:  # blocks left of the diagonal need no mask, the diagonal ones do, those right of it are skipped
            diag = start_m * BLOCK_M
            acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, Kb, Vb, offs_m, offs_d, 0, diag, qk_scale, T, D,
                                            CAUSAL, False, EVEN_D, BLOCK_N)
            acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, Kb, Vb, offs_m, offs_d, diag,
                                            tl.minimum(diag + BLOCK_M, T), qk_scale, T, D, CAUSAL, True, EVEN_D,
                                            BLOCK_N)
        else:
            acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, Kb, Vb, offs_m, offs_d, 0, T, qk_scale, T, D,
                                            CAUSAL, not EVEN_T, EVEN_D, BLOCK_N)
        acc = acc / l_i[:, None]
        rmask = offs_m < T
        tl.store(O + bh * T * D + offs_m[:, None] * D + offs_d[None, :], acc.to(O.dtype.element_ty),
                 mask=rmask[:, None] & (offs_d[None, :] < D))
        tl.store(LSE + bh * T + offs_m, m_i + tl.log2(l_i), mask=rmask)  # base-2 logsumexp of the scaled scores

    @triton.jit
    def _attn_dkdv_inner(dk, dv, k, v, Qb, DOb, LSEb, DELTAb, offs_n, offs_d, lo, hi, qk_scale, T, D,
                         CAUSAL: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr):
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            q = _attn_tile(Qb, rows, offs_d, T, D, MASK, EVEN_D)
            do = _attn_tile(DOb, rows, offs_d, T, D, MASK, EVEN_D)
            if MASK:
                lse = tl.load(LSEb + rows, mask=rows < T, other=0.0)
                delta = tl.load(DELTAb + rows, mask=rows < T, other=0.0)
            else:
                lse = tl.load(LSEb + rows)
                delta = tl.load(DELTAb + rows)
            sT = tl.dot(k, tl.trans(q)) * qk_scale  # (BLOCK_N, BLOCK_M): scores transposed
            if MASK:  # _attn_keep's mask, transposed
                keep = offs_n[:, None] < T
                if CAUSAL:
                    keep = keep & (offs_n[:, None] <= rows[None, :])
                sT = tl.where(keep, sT, float("-inf"))
            pT = tl.exp2(sT - lse[None, :])
            dv += tl.dot(pT.to(do.dtype), do)
            dsT = pT * (tl.dot(v, tl.trans(do)) - delta[None, :])  # softmax backward: p * (dp - rowsum(p * dp))
            dk += tl.dot(dsT.to(q.dtype), q)
        return dk, dv

    @_attn_autotune(_COLS_CFGS)
    def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, qk_scale, sm_scale, T, D, Hq, G, CAUSAL: tl.constexpr,
                              EVEN_T: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_D: tl.constexpr):
        # one program per (block of BLOCK_N keys, batch * kv head): dk, dv summed over the G q heads that share it
        start_n = tl.program_id(0)
        bkv = tl.program_id(1).to(tl.int64)
        Hkv = Hq // G
        offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        k = _attn_tile(K + bkv * T * D, offs_n, offs_d, T, D, True, EVEN_D)
        v = _attn_tile(V + bkv * T * D, offs_n, offs_d, T, D, True, EVEN_D)
        dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        for g in range(G):
            bh = (bkv // Hkv) * Hq + (bkv % Hkv) * G + g
            Qb, DOb, LSEb, DELTAb = Q + bh * T * D, DO + bh * T * D, LSE + bh * T, DELTA + bh * T
            if CAUSAL:  # queries before this key block never see it; the diagonal tiles need the mask
                diag = start_n * BLOCK_N
                dk, dv = _attn_dkdv_inner(dk, dv, k, v, Qb, DOb, LSEb, DELTAb, offs_n, offs_d, diag,
                                          tl.minimum(diag + BLOCK_N, T), qk_scale, T, D, CAUSAL, True, EVEN_D, BLOCK_M)
                dk, dv = _attn_dkdv_inner(dk, dv, k, v, Qb, DOb, LSEb, DELTAb, offs_n, offs_d, diag + BLOCK_N, T,
                                          qk_scale, T, D, CAUSAL, not EVEN_T, EVEN_D, BLOCK_M)
            else:
                dk, dv = _attn_dkdv_inner(dk, dv, k, v, Qb, DOb, LSEb, DELTAb, offs_n, offs_d, 0, T, qk_scale, T, D,
                                          CAUSAL, not EVEN_T, EVEN_D, BLOCK_M)
        out = bkv * T * D + offs_n[:, None] * D + offs_d[None, :]
        omask = (offs_n[:, None] < T) & (offs_d[None, :] < D)
        tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=omask)
        tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=omask)

    @triton.jit
    def _attn_dq_inner(dq, q, do, lse, delta, Kb, Vb, offs_m, offs_d, lo, hi, qk_scale, T, D, CAUSAL: tl.constexpr,
                       MASK: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr):
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            k = _attn_tile(Kb, cols, offs_d, T, D, MASK, EVEN_D)
            v = _attn_tile(Vb, cols, offs_d, T, D, MASK, EVEN_D)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            if MASK:
                s = tl.where(_attn_keep(offs_m, cols, T, CAUSAL), s, float("-inf"))
            p = tl.exp2(s - lse[:, None])
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        return dq

    @_attn_autotune(_ROWS_CFGS)
    def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, qk_scale, sm_scale, T, D, Hq, G, CAUSAL: tl.constexpr,
                            EVEN_T: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_D: tl.constexpr):
        # one program per (block of BLOCK_M queries, batch * q head), recomputing p from the saved logsumexp
        start_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        bkv = (bh // Hq) * (Hq // G) + (bh % Hq) // G
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        q = _attn_tile(Q + bh * T * D, offs_m, offs_d, T, D, True, EVEN_D)
        do = _attn_tile(DO + bh * T * D, offs_m, offs_d, T, D, True, EVEN_D)
        lse = tl.load(LSE + bh * T + offs_m, mask=offs_m < T, other=0.0)
        delta = tl.load(DELTA + bh * T + offs_m, mask=offs_m < T, other=0.0)
        Kb, Vb = K + bkv * T * D, V + bkv * T * D
        dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        if CAUSAL:
            diag = start_m * BLOCK_M
            dq = _attn_dq_inner(dq, q, do, lse, delta, Kb, Vb, offs_m, offs_d, 0, diag, qk_scale, T, D, CAUSAL,
                                False, EVEN_D, BLOCK_N)
            dq = _attn_dq_inner(dq, q, do, lse, delta, Kb, Vb, offs_m, offs_d, diag, tl.minimum(diag + BLOCK_M, T),
                                qk_scale, T, D, CAUSAL, True, EVEN_D, BLOCK_N)
        else:
            dq = _attn_dq_inner(dq, q, do, lse, delta, Kb, Vb, offs_m, offs_d, 0, T, qk_scale, T, D, CAUSAL,
                                not EVEN_T, EVEN_D, BLOCK_N)
        tl.store(DQ + bh * T * D + offs_m[:, None] * D + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
                 mask=(offs_m[:, None] < T) & (offs_d[None, :] < D))


def _attn_meta(T, D):
    """Head dim padded to a power of two, the evenness flags, and tiles under the interpreter (else autotuned)."""
    bd = max(16, triton.next_power_of_2(D))
    meta = dict(BLOCK_D=bd, EVEN_T=T % 128 == 0, EVEN_D=bd == D)
    return dict(meta, BLOCK_M=16, BLOCK_N=16) if _interpret() else meta


@torch.library.custom_op("trainsuite::attention", mutates_args=())
def _attn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, Hq, T, D = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(B, Hq, T, device=q.device, dtype=torch.float32)  # base 2
    _launch(_attn_fwd_kernel, lambda m: (triton.cdiv(T, m["BLOCK_M"]), B * Hq), q, k, v, o, lse,
            scale * 1.4426950408889634, T, D, Hq, Hq // k.shape[1], CAUSAL=causal, **_attn_meta(T, D))
    return o, lse


@_attn_op.register_fake
def _(q, k, v, causal, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("trainsuite::attention_bwd", mutates_args=())
def _attn_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    do, q, k, v = do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous()
    (B, Hq, T, D), Hkv = q.shape, k.shape[1]
    delta = (o.float() * do.float()).sum(-1).contiguous()  # (B, Hq, T): rowsum(p * dp) = rowsum(o * do)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # in the inputs' dtype
    meta, args = _attn_meta(T, D), (q, k, v, do, lse, delta)
    consts = (scale * 1.4426950408889634, scale, T, D, Hq, Hq // Hkv)
    _launch(_attn_bwd_dkdv_kernel, lambda m: (triton.cdiv(T, m["BLOCK_N"]), B * Hkv), *args, dk, dv, *consts,
            CAUSAL=causal, **meta)
    _launch(_attn_bwd_dq_kernel, lambda m: (triton.cdiv(T, m["BLOCK_M"]), B * Hq), *args, dq, *consts,
            CAUSAL=causal, **meta)
    return dq, dk, dv


@_attn_bwd_op.register_fake
def _(do, q, k, v, o, lse, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attn_setup(ctx, inputs, output):
    q, k, v, ctx.causal, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, *output)


def _attn_backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _attn_bwd_op(do.contiguous(), q, k, v, o, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


_attn_op.register_autograd(_attn_backward, setup_context=_attn_setup)


def _attn_torch(q, k, v, causal, scale, window=None):
    """F.scaled_dot_product_attention with the reference's conventions: the causal mask aligned bottom-right when
    there are fewer queries than keys (SDPA's is_causal aligns it top-left), and q's dtype out (SDPA under CPU
    autocast returns bf16 for fp32 inputs; the reference and the Triton op keep q's). A window is a boolean mask."""
    if q.device.type == "cpu" and (q.dtype != torch.float32 or torch.is_autocast_enabled("cpu")):
        with torch.autocast("cpu", enabled=False):  # fp32: the CPU's bf16 SDPA is 2.5x slower at T 128 (backward)
            return _attn_torch(q.float(), k.float(), v.float(), causal, scale, window).to(q.dtype)
    T, Tk = q.shape[2], k.shape[2]
    mask = torch.ones(T, Tk, dtype=torch.bool, device=q.device).tril(Tk - T) if causal and (T != Tk or window) else None
    if window:
        mask &= ~torch.ones(T, Tk, dtype=torch.bool, device=q.device).tril(Tk - T - window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1]).to(q.dtype)


# FlexAttention (torch.nn.attention.flex_attention, PyTorch 2.5+) takes the mask as a function of (batch, head,
# query, key) and, from it, a block mask: which (128 x 128) tiles of the scores are empty, full or partial. Its
# kernel, which torch.compile writes, skips the empty tiles, so a window W costs about T * W, not T^2. Only the
# compiled kernel skips anything: called eagerly, flex_attention computes every score and masks them, like the
# dense mask above. Its backward runs on CUDA only ("FlexAttention does not support backward on CPU", torch 2.13).
_masked = "sdpa"
_flex = {}  # "eager" and "compiled": flex_attention itself and compiled; (T, window, device): its block mask


def use_attention(name):
    """Pick how a windowed attention runs: "sdpa" (a dense boolean mask over SDPA, every tile computed; the
    reference) or "flex" (FlexAttention, which skips the tiles outside the window; compiled on CUDA, eager on a CPU,
    where it has no backward). Full causal attention and decode steps take attention()'s other paths either way."""
    global _masked
    if name not in ("sdpa", "flex"):
        raise ValueError(f"kernels.use_attention: must be 'sdpa' or 'flex', got {name!r}")
    _masked = name
    if name == "flex":  # imported here: importing kernels stays cheap, and needs no FlexAttention
        from torch.nn.attention.flex_attention import flex_attention
        _flex["eager"] = flex_attention  # off CUDA: every score computed, then masked; forward only
        # the kernel that skips tiles, for CUDA: wrapped here, not inside a forward that torch.compile traces, and
        # compiled on its first call, once per shape
        _flex["compiled"] = torch.compile(flex_attention, dynamic=False)


def _band(window):
    """FlexAttention's mask_mod: query i sees key j if and only if j <= i, and i - j < window if there is one."""
    def keep(b, h, i, j):
        seen = j <= i
        if window:
            seen = seen & (i - j < window)
        return seen
    return keep


def _block_mask(T, window, device):
    """The block mask of causal attention in a window over T positions, made once per (T, window, device).
    Under torch.compile the first call is traced with the model; the recompile after it reads the cache."""
    from torch.nn.attention.flex_attention import create_block_mask
    key = (T, window, device)
    if key not in _flex:
        _flex[key] = create_block_mask(_band(window), None, None, T, T, device=device)
    return _flex[key]


def _attn_flex(q, k, v, scale, window=None):
    """Causal attention, in a window if one is given, by FlexAttention: q (B, Hq, T, D), k and v (B, Hkv, T, D).
    On a CPU it runs forward only; kernels.use_attention("flex") must have run first."""
    kind = q.device.type
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if kind != "cuda" and grad:
        raise NotImplementedError(f"kernels.attention: FlexAttention has no backward on {kind} (CUDA only); use "
                                  "kernels.use_attention('sdpa') there (--attention=sdpa)")
    mask = _block_mask(q.shape[2], window, q.device)
    gqa = q.shape[1] != k.shape[1]
    if kind == "cuda":
        return _flex["compiled"](q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    # eager FlexAttention refuses inputs that require grad off CUDA, even under no_grad: detached, they do not
    q, k, v = q.detach(), k.detach(), v.detach()
    return _flex["eager"](q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)


def attention(q, k, v, causal=True, scale=None, window=None):
    """Scaled dot-product attention with GQA/MQA; q (B, Hq, T, D), k and v (B, Hkv, T, D) -> (B, Hq, T, D). With a
    window W (causal only), query i sees key j if and only if i - W < j <= i."""
    if window is not None and (window < 1 or not causal):
        raise ValueError(f"kernels.attention: a window must be >= 1 and causal, got window={window}, causal={causal}")
    # a window under use_attention("flex"), queries and keys of one length (a training step): FlexAttention
    if window and _masked == "flex" and q.shape[2] == k.shape[2]:
        return _attn_flex(q, k, v, scale, window)
    # decode steps and other windows: PyTorch's path. SDPA masks the tiles outside a window, so there a window
    # costs as much as full attention
    if window or not _use_triton(q, k, v, auto=False) or q.shape[-1] > 256 or q.shape[2] != k.shape[2]:
        return _attn_torch(q, k, v, causal, scale, window)
    return _attn_op(q, k, v, causal, float(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])))[0]


# -----------------------------------------------------------------------------
# Benchmark


def _peak_bw(name):
    """HBM bandwidth in bytes/s by device name (H200 4.8 TB/s, H100 SXM 3.35 TB/s, A100 2.0 TB/s), else None."""
    return next((bw for key, bw in (("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.0e12)) if key in name), None)


def bench_columns():
    """The bench's columns, {op: {label: fn}}, labelled by the path each runs: ours on Triton, then PyTorch's ops."""
    def ours(fn):  # fn with use("triton") in force, the caller's choice restored after: "auto" gives attention SDPA
        def run(*args):
            prev = _backend
            use("triton")
            try:
                return fn(*args)
            finally:
                use(prev)
        return run
    sdpa = lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c)
    rms = lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6)
    ce, lce = F.cross_entropy, lambda x, W, t: F.cross_entropy(x @ W.T, t)
    fused = {"F.linear_ce": F.linear_cross_entropy} if hasattr(F, "linear_cross_entropy") else {}
    return {"attention": {"triton": ours(attention), "sdpa": sdpa},
            "rms_norm": {"triton": ours(rms_norm), "torch": rms, "compiled": torch.compile(rms)},
            "cross_entropy": {"triton": ours(cross_entropy), "torch": ce, "compiled": torch.compile(ce)},
            "linear_ce": {"triton": ours(linear_cross_entropy), "torch": lce, "compiled": torch.compile(lce), **fused}}


def bench():
    """Print throughput of each kernel, on Triton whatever use() says, against PyTorch's ops on the current GPU."""
    if not torch.cuda.is_available() or triton is None:
        sys.exit("kernels.py: error: --bench needs a CUDA GPU and triton; none found here, so run it on a GPU machine")
    from triton.testing import do_bench
    dev, dt, name = "cuda", torch.bfloat16, torch.cuda.get_device_name()
    print(f"# {name}, bf16; each column is named for the path it times (ours: triton)")
    attn, norm, ce, lce = bench_columns().values()  # {label: fn} each
    heads = lambda fns, w, units=("",), sep=" ": sep.join(f"{c + u:>{w}}" for u in units for c in fns)

    def timed(fn):
        """(ms, peak GiB) of fn() after a warm-up."""
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = do_bench(fn)
        return ms, (torch.cuda.max_memory_allocated() - base) / 2 ** 30

    def fwd_bwd(f, *xs):
        out = f(*xs)
        out.backward(torch.ones_like(out) if out.dim() else None)

    print(f"attention           B  H     T    D causal | {heads(attn, 10, (' fwd', ' f+b'))}  (TFLOP/s)")
    for D in (64, 128):
        for T in (1024, 4096, 16384):
            B, H = max(1, 16384 // T), 2048 // D
            q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
            for causal in (False, True):
                flops = 4 * B * H * T * T * D / (2 if causal else 1)  # two matmuls forward
                r = [flops / timed(lambda: f(q, k, v, causal))[0] / 1e9 for f in attn.values()]
                r += [3.5 * flops / timed(lambda: fwd_bwd(f, q, k, v, causal))[0] / 1e9 for f in attn.values()]
                print(f"{'':18}{B:3d}{H:3d}{T:6d}{D:5d} {causal!s:>6} | " + " ".join(f"{x:10.0f}" for x in r))
    peak = _peak_bw(name)
    print(f"rms_norm fwd+bwd   rows  width | {heads(norm, 13)}  (GB/s: x, y, dy, dx once each; % of peak)")
    for M, N in ((393216, 64), (16384, 768), (16384, 2048), (16384, 4096), (16384, 8192)):  # QK-norm, then widths
        x = torch.randn(M, N, device=dev, dtype=dt, requires_grad=True)
        w, dy = torch.randn(N, device=dev, dtype=dt, requires_grad=True), torch.randn(M, N, device=dev, dtype=dt)
        gbs = [4 * x.numel() * x.element_size() / timed(lambda: f(x, w).backward(dy))[0] / 1e6 for f in norm.values()]
        pct = [f"{g:6.0f} ({100 * g * 1e9 / peak:3.0f}%)" if peak else f"{g:13.0f}" for g in gbs]
        print(f"{'':15}{M:8d}{N:7d} | " + " ".join(pct))
        x.grad = w.grad = None
    print(f"losses, fwd+bwd     N     d       V | {heads(lce, 14, sep=' | ')}  (ms, peak GiB)")
    for N, d, V in ((8192, 2048, 50304), (8192, 2048, 128256), (32768, 768, 50304)):  # the last: GPT-2 124M's step
        z = torch.randn(N, V, device=dev, dtype=dt, requires_grad=True)
        t, x = torch.randint(0, V, (N,), device=dev), torch.randn(N, d, device=dev, dtype=dt, requires_grad=True)
        W = (torch.randn(V, d, device=dev, dtype=dt) / 40).requires_grad_()
        for op, fns, args in (("cross_entropy", ce, (z, t)), ("linear_ce", lce, (x, W, t))):
            r = [timed(lambda: fwd_bwd(f, *args)) for f in fns.values()]
            print(f"{op:15}{N:6d}{d:6d}{V:8d} | " + " | ".join(f"{ms:8.2f} {gb:5.1f}" for ms, gb in r))
            z.grad = x.grad = W.grad = None
        del z


def _ms(fn, cuda):
    """Milliseconds a call of fn takes, after a warm-up call (which compiles): triton's do_bench on a GPU, one call
    on a CPU."""
    fn()
    if cuda:
        from triton.testing import do_bench
        return do_bench(fn)
    t0 = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - t0)


def bench_window():
    """Print the ms of sliding-window attention, a window of T/4, forward and forward + backward, at T 1,024 and
    4,096 on a GPU, in bf16 at GPT-2 124M's 12 heads of 64 and its 32 x 1,024 tokens a micro-step: the masked SDPA
    (its mask made in each call, as a step makes it), FlexAttention (its block mask made once, before) and, beside
    them, SDPA's causal attention with no window. On a CPU: T 256 and 512 in fp32 and 1,024 tokens, FlexAttention
    forward only, which checks that the code runs; those are not figures."""
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dt = torch.bfloat16 if cuda else torch.float32
    sizes = (1024, 4096) if cuda else (256, 512)
    tokens = 32768 if cuda else 1024
    where = torch.cuda.get_device_name() if cuda else "a CPU (to check the code runs; not figures)"
    use_attention("flex")
    print(f"# sliding-window attention, window T/4, {str(dt)[6:]}, on {where}: ms forward / forward + backward")
    print("| T | window | B x H x D | causal SDPA, no window | masked SDPA | FlexAttention | flex / masked, f+b |")
    print("|---|---|---|---|---|---|---|")
    for T in sizes:
        W = T // 4
        B = tokens // T
        q, k, v = (torch.randn(B, 12, T, 64, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
        g = torch.randn_like(q)
        paths = {"causal": lambda: _attn_torch(q, k, v, True, None),
                 "masked": lambda: _attn_torch(q, k, v, True, None, W),
                 "flex": lambda: _attn_flex(q, k, v, None, W)}
        cells, both = [], {}
        for name, f in paths.items():
            with torch.no_grad():
                fwd = _ms(f, cuda)
            cell = f"{fwd:.2f} / no backward on a CPU"
            if cuda or name != "flex":
                both[name] = _ms(lambda: f().backward(g), cuda)
                cell = f"{fwd:.2f} / {both[name]:.2f}"
            cells.append(cell)
        ratio = f"{both['flex'] / both['masked']:.2f}x" if "flex" in both else "-"
        print(f"| {T:,} | {W:,} | {B} x 12 x 64 | " + " | ".join(cells) + f" | {ratio} |")
        q.grad = k.grad = v.grad = None
    use_attention("sdpa")


if __name__ == "__main__":
    if sys.argv[1:] == ["--bench"]:
        sys.exit(bench())  # exit 0, or a one-line error where there is no GPU
    if sys.argv[1:] == ["--bench_window"]:
        sys.exit(bench_window())  # a GPU's figures; on a CPU, the same code at small sizes
    if sys.argv[1:] not in ([], ["-h"], ["--help"]):  # a typo such as --bnech must not pass for a bench that ran
        sys.exit(f"kernels.py: error: unknown argument {sys.argv[1]!r}; its flags are --bench and --bench_window "
                 "(a GPU's timings)")
    print(__doc__)
