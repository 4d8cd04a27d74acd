"""Kernel parity: each *_ref against plain PyTorch; the PyTorch path (no Triton, or kernels.use("torch")) and each
Triton kernel (TRITON_INTERPRET=1 on CPU) against its ref."""
import contextlib
import functools
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels

needs_triton = pytest.mark.skipif(kernels.triton is None, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU present: bf16/fp16 parity needs one")


ON_GPU = ("the Triton interpreter patches triton.language for the whole process and would break the compiled "
          "kernels tested after it; test_interpreter_tests_in_a_subprocess runs these with CUDA hidden")


@functools.cache
def interpreter_error():
    """None if this triton's interpreter runs our kernels, else why not (triton 3.6's cannot run a loop whose bounds
    are tensors: 'only 0-dimensional arrays can be converted to Python scalars')."""
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        run_every_kernel()
    except Exception as e:  # noqa: BLE001 - any failure of the interpreter itself
        return f"{type(e).__name__}: {e}".splitlines()[0][:200]
    finally:
        os.environ.pop("TRITON_INTERPRET")
    return None


def use_interpreter(monkeypatch):
    """Route CPU tensors through the Triton kernels (dispatch reads the variable at call time), or skip with why."""
    if kernels.triton is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        pytest.skip(ON_GPU)
    if interpreter_error():
        pytest.skip(f"triton {kernels.triton.__version__}'s interpreter cannot run these kernels: {interpreter_error()}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernels, "_backend", "triton")  # every op on Triton, attention too


@pytest.fixture
def interpret(monkeypatch):
    use_interpreter(monkeypatch)


def grads(fn, *xs, g=None):
    """Output of fn(*xs) and grads of (out * g).sum() for every floating x; g defaults to a non-contiguous randn."""
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
    out = fn(*xs)
    torch.manual_seed(123)
    if g is None:
        g = torch.randn(out.shape + (2,), dtype=out.dtype, device=out.device)[..., 0] if out.dim() else \
            torch.tensor(0.7, dtype=out.dtype, device=out.device)
    out.backward(g)
    return [out.detach()] + [x.grad for x in xs if x.requires_grad]


def close(a, b, atol, rtol=None):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.float(), y.float(), atol=atol, rtol=atol if rtol is None else rtol)


# ----------------------------------------------------------------------------- references against PyTorch


def test_import_is_silent():
    """Importing kernels prints nothing and needs neither a GPU nor triton."""
    for pre in ("", "import sys; sys.modules['triton'] = None; "):
        code = pre + "import kernels, torch; print(round(kernels.rms_norm(torch.ones(2, 3)).sum().item()))"
        p = subprocess.run([sys.executable, "-c", code], cwd=Path(kernels.__file__).parent, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0 and p.stdout == "6\n", p.stderr


def test_rms_norm_ref_matches_torch():
    x, w = torch.randn(3, 5, 123), torch.randn(123)
    close(grads(lambda x, w: kernels.rms_norm_ref(x, w, 1e-6), x, w),
          grads(lambda x, w: F.rms_norm(x, (123,), w, 1e-6), x, w), 1e-5)


@pytest.mark.parametrize("softcap,z_loss", [(None, 0.0), (5.0, 1e-2)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_ref_matches_formula(softcap, z_loss, reduction):
    z, t = torch.randn(37, 50) * 4, torch.randint(0, 50, (37,))
    t[::5] = -100

    def hand(z):
        zc = softcap * torch.tanh(z / softcap) if softcap else z
        lse = torch.logsumexp(zc, -1)
        ce = F.cross_entropy(zc, t, ignore_index=-100, reduction="none")
        per_row = (ce + z_loss * lse ** 2) * (t != -100)
        return {"mean": per_row.sum() / (t != -100).sum(), "sum": per_row.sum(), "none": per_row}[reduction]

    close(grads(lambda z: kernels.cross_entropy_ref(z, t, softcap=softcap, z_loss=z_loss, reduction=reduction), z),
          grads(hand, z), 1e-5)
    if softcap is None and reduction == "mean":
        close(grads(lambda z: kernels.cross_entropy_ref(z, t), z), grads(lambda z: F.cross_entropy(z, t), z), 1e-5)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_ref_matches_sdpa(hq, hkv, causal):
    q, k, v = torch.randn(2, hq, 9, 16), torch.randn(2, hkv, 9, 16), torch.randn(2, hkv, 9, 16)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
    close(grads(lambda q, k, v: kernels.attention_ref(q, k, v, causal), q, k, v), grads(sdpa, q, k, v), 1e-5)


def test_attention_ref_kv_cache_shapes():
    """One query against a longer cache (decode), and a causal prefix of queries, as SDPA does them."""
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)
    close([kernels.attention(q, k, v, causal=False)],
          [F.scaled_dot_product_attention(q, k, v, enable_gqa=True)], 1e-5)
    q = torch.randn(1, 4, 3, 16)
    mask = torch.ones(3, 7, dtype=torch.bool).tril(4)
    close([kernels.attention_ref(q, k, v, causal=True)],
          [F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)], 1e-5)


def test_refs_keep_dtype():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert kernels.rms_norm_ref(x).dtype == torch.bfloat16
    assert kernels.cross_entropy_ref(x, torch.zeros(4, dtype=torch.long)).dtype == torch.bfloat16
    q = torch.randn(1, 2, 5, 32, dtype=torch.float16)
    assert kernels.attention_ref(q, q, q).dtype == torch.float16


# ----------------------------------------------------------------------------- PyTorch's ops (the non-Triton path)


@pytest.fixture
def torch_path(monkeypatch):
    """kernels.use("torch") under TRITON_INTERPRET=1, where only the switch keeps Triton out; a launch fails."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kernels, "_launch", lambda *a, **k: pytest.fail("a Triton kernel ran under use('torch')"))
    kernels.use("torch")
    yield
    kernels.use("auto")


def run_every_kernel():
    """Each public function once, forward and backward, on small CPU tensors."""
    x, W = torch.randn(4, 32, requires_grad=True), torch.randn(32, 32, requires_grad=True)
    q, t = torch.randn(1, 2, 5, 32, requires_grad=True), torch.randint(0, 32, (4,))
    loss = kernels.attention(q, q, q).sum() + kernels.rms_norm(x).sum() + kernels.cross_entropy(x, t)
    (loss + kernels.linear_cross_entropy(x, W, t)).backward()


def test_use_and_backend(monkeypatch):
    """backend(device) names the choice in force: use()'s where Triton runs (CUDA, or the CPU under TRITON_INTERPRET=1),
    "torch" elsewhere; "auto" by default."""
    on = kernels.triton is not None
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert (kernels.backend("cpu"), kernels.backend(torch.device("cuda", 0))) == ("torch", "auto" if on else "torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        for name in ("triton", "torch", "auto"):
            kernels.use(name)
            want = name if on else "torch"
            assert (kernels.backend("cpu"), kernels.backend("cuda"), kernels.backend("meta")) == (want, want, "torch")
        with pytest.raises(ValueError, match="'auto', 'triton' or 'torch'"):
            kernels.use("cuda")
    finally:
        kernels.use("auto")


def test_auto_takes_each_ops_faster_path(monkeypatch):
    """use("auto"), as measured on an H100: SDPA for attention; Triton for the losses, and for RMSNorm in eager, but
    PyTorch's op under torch.compile, which Inductor fuses with its neighbours."""
    use_interpreter(monkeypatch)
    kernels.use("auto")
    calls = []
    for name in ("_attn_torch", "_rms_torch", "_ce_torch", "_launch"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
    q, x, t = torch.randn(1, 2, 5, 32), torch.randn(4, 32), torch.randint(0, 32, (4,))
    for fn, args, want in ((kernels.attention, (q, q, q), "_attn_torch"), (kernels.rms_norm, (x,), "_launch"),
                           (kernels.cross_entropy, (x, t), "_launch"), (kernels.linear_cross_entropy, (x, x, t), "_launch"),
                           (torch.compile(kernels.rms_norm, backend="aot_eager", fullgraph=True), (x,), "_rms_torch")):
        calls.clear()
        fn(*args)
        assert set(calls) == {want}, fn


def test_use_torch_forces_the_torch_path_under_the_interpreter(torch_path):
    assert kernels.backend("cpu") == "torch"
    run_every_kernel()  # the fixture fails the test if any Triton kernel launches


@pytest.mark.parametrize("T,Tk,hq,hkv,causal", [(1, 1, 2, 2, True), (17, 17, 4, 2, True), (37, 37, 3, 1, False),
                                                (5, 23, 4, 2, True), (1, 23, 4, 1, True), (7, 19, 2, 2, False)])
def test_attention_torch(torch_path, T, Tk, hq, hkv, causal):
    """SDPA matches the reference, forward and grads: GQA, odd lengths and head dim, and with fewer queries than keys
    (a KV cache) the causal mask aligned bottom-right as the reference's is, not top-left as SDPA's is_causal."""
    q, k, v = torch.randn(2, hq, T, 24), torch.randn(2, hkv, Tk, 24), torch.randn(2, hkv, Tk, 24)
    close(grads(lambda *a: kernels.attention(*a, causal=causal), q, k, v),
          grads(lambda *a: kernels.attention_ref(*a, causal=causal), q, k, v), 1e-5)


def test_attention_window_ref_is_the_band():
    """The reference's window, against a loop over queries written from the definition: i - W < j <= i."""
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    out = kernels.attention_ref(q, k, v, causal=True, window=3)
    for i in range(6):  # query i is position 3 + i of the 9 keys
        p = 3 + i
        s = (q[:, :, i:i + 1] @ k[:, :, p - 2:p + 1].transpose(-1, -2)) / 8 ** 0.5
        close([out[:, :, i:i + 1]], [s.softmax(-1) @ v[:, :, p - 2:p + 1]], 1e-5)


@pytest.mark.parametrize("T,Tk,hq,hkv", [(17, 17, 4, 2), (37, 37, 3, 1), (1, 23, 4, 2), (5, 23, 2, 2)])
@pytest.mark.parametrize("window", [1, 2, 7, 16, 40])
def test_attention_window(T, Tk, hq, hkv, window):
    """Sliding windows from 1 key to more than T, forward and grads, GQA, odd lengths, decode against a cache; on
    every backend (a window always takes PyTorch's path) and the same as the reference."""
    q, k, v = torch.randn(2, hq, T, 24), torch.randn(2, hkv, Tk, 24), torch.randn(2, hkv, Tk, 24)
    close(grads(lambda *a: kernels.attention(*a, window=window), q, k, v),
          grads(lambda *a: kernels.attention_ref(*a, window=window), q, k, v), 1e-5)
    if window >= Tk:  # a window past the first key is full causal attention
        close([kernels.attention(q, k, v, window=window)], [kernels.attention_ref(q, k, v)], 1e-6)
    with pytest.raises(ValueError, match="a window must be >= 1 and causal"):
        kernels.attention(q, k, v, causal=False, window=window)


def test_attention_torch_scale_non_contiguous(torch_path):
    q = torch.randn(2, 19, 3, 40).transpose(1, 2)  # (B, H, T, D) views, as the models make them
    k, v = torch.randn(2, 19, 1, 40).transpose(1, 2), torch.randn(2, 19, 1, 40).transpose(1, 2)
    close(grads(lambda *a: kernels.attention(*a, scale=0.3), q, k, v),
          grads(lambda *a: kernels.attention_ref(*a, scale=0.3), q, k, v), 1e-5)


def test_rms_norm_torch(torch_path):
    x, w = torch.randn(3, 5, 123), torch.randn(123)
    close(grads(kernels.rms_norm, x, w), grads(kernels.rms_norm_ref, x, w), 1e-5)
    close(grads(lambda x: kernels.rms_norm(x, eps=0.1), x), grads(lambda x: kernels.rms_norm_ref(x, eps=0.1), x), 1e-5)
    xt = torch.randn(123, 6).T  # non-contiguous rows
    close(grads(kernels.rms_norm, xt, w), grads(kernels.rms_norm_ref, xt, w), 1e-5)


@pytest.mark.parametrize("softcap,z_loss", [(None, 0.0), (5.0, 0.0), (None, 1e-2), (5.0, 1e-2)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_torch(torch_path, softcap, z_loss, reduction):
    z, t = torch.randn(37, 51) * 4, torch.randint(0, 51, (37,))
    t[::5] = -100
    kw = dict(softcap=softcap, z_loss=z_loss, reduction=reduction)
    close(grads(lambda z: kernels.cross_entropy(z, t, **kw), z),
          grads(lambda z: kernels.cross_entropy_ref(z, t, **kw), z), 1e-5)


def test_cross_entropy_torch_edge_cases(torch_path):
    """Every row ignored (mean 0, not nan, and zero grads), another ignore_index, and -inf logits (a masked vocab)
    off the target, also in an ignored row's column 0, where the z-loss reads the target's column."""
    z, t = torch.randn(6, 40), torch.randint(0, 40, (6,))
    for kw in (dict(), dict(z_loss=1e-2)):
        out, dz = grads(lambda z: kernels.cross_entropy(z, torch.full((6,), -100), **kw), z)
        assert out.item() == 0 and not dz.any()
        t7 = t.clone()
        t7[1] = 7
        close(grads(lambda z: kernels.cross_entropy(z, t7, ignore_index=7, **kw), z),
              grads(lambda z: kernels.cross_entropy_ref(z, t7, ignore_index=7, **kw), z), 1e-5)
        zm, tm = z.clone(), t.clone()
        zm[0, (t[0] + 1) % 40], zm[2, 0], tm[2] = float("-inf"), float("-inf"), -100
        for reduction in ("mean", "none"):
            ours = grads(lambda z: kernels.cross_entropy(z, tm, reduction=reduction, **kw), zm)
            close(ours, grads(lambda z: kernels.cross_entropy_ref(z, tm, reduction=reduction, **kw), zm), 1e-5)
            assert all(o.isfinite().all() for o in ours)


@pytest.mark.parametrize("small", [0, kernels.SMALL_LOGITS])
@pytest.mark.parametrize("kw", [dict(), dict(softcap=3.0, z_loss=1e-3, reduction="sum"),
                                dict(softcap=3.0, z_loss=1e-3, reduction="none")])
def test_linear_cross_entropy_torch(torch_path, kw, small, monkeypatch):
    """PyTorch's path, in chunks (many here, with small=0) or on the whole logits, matches the materialised
    reference, forward and grads."""
    monkeypatch.setattr(kernels, "SMALL_LOGITS", small)
    monkeypatch.setattr(kernels, "CHUNK_LOGITS", 16 * 300)  # chunks of 16 rows: 4 whole and a part
    x, w, t = torch.randn(70, 16), torch.randn(300, 16), torch.randint(0, 300, (70,))
    t[3] = -100
    close(grads(lambda x, w: kernels.linear_cross_entropy(x, w, t, **kw), x, w),
          grads(lambda x, w: kernels.linear_cross_entropy_ref(x, w, t, **kw), x, w), 1e-5)
    with torch.no_grad():  # eval skips the gradients but gives the same loss
        close([kernels.linear_cross_entropy(x, w, t, **kw)], [kernels.linear_cross_entropy_ref(x, w, t, **kw)], 1e-5)


def test_torch_path_dtypes_match_the_refs(torch_path):
    """bf16 activations with an fp32 gain (QK-norm under autocast) take F.rms_norm's fused path without a mixed-dtype
    warning, and under CPU bf16 autocast every output has the reference's dtype, within bf16 rounding of it."""
    x, w = torch.randn(2, 4, 9, 32), torch.randn(32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = kernels.rms_norm(x.bfloat16(), w)
    assert y.dtype == torch.bfloat16
    close([y], [kernels.rms_norm_ref(x.bfloat16(), w)], 2e-2)
    z, t = torch.randn(9, 50), torch.randint(0, 50, (9,))
    cases = [(kernels.attention, kernels.attention_ref, (x, x[:, :2], x[:, :2])),
             (kernels.rms_norm, kernels.rms_norm_ref, (x, w)),
             (kernels.cross_entropy, kernels.cross_entropy_ref, (z, t)),
             (kernels.cross_entropy, kernels.cross_entropy_ref, (z.bfloat16(), t))]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for fn, ref, args in cases:
            ours, want = fn(*args), ref(*args)
            assert ours.dtype == want.dtype, fn.__name__
            close([ours], [want], 3e-2)


# ----------------------------------------------------------------------------- Triton under the interpreter


def test_dispatch_reads_env_at_call_time(monkeypatch):
    """Under TRITON_INTERPRET=1 every public function launches Triton and none runs PyTorch's path; without it, each
    runs PyTorch's path, and no reference runs in either (they are oracles only)."""
    use_interpreter(monkeypatch)  # first: its one-off probe of the interpreter runs under "auto" and is not counted
    calls = []
    for name in ("_attn_torch", "_rms_torch", "_ce_torch", "_ce_rows_torch", "_launch",
                 "attention_ref", "rms_norm_ref", "cross_entropy_ref", "linear_cross_entropy_ref"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
    run_every_kernel()
    assert set(calls) == {"_launch"}
    calls.clear()
    monkeypatch.delenv("TRITON_INTERPRET")
    run_every_kernel()
    assert sorted(set(calls)) == ["_attn_torch", "_ce_torch", "_rms_torch"]  # small logits: linear CE whole


@needs_triton
@pytest.mark.parametrize("shape,weight", [((5, 123), True), ((2, 3, 768), True), ((4, 64), False),
                                          ((333, 64), True), ((3, 5, 40), False)])  # many tiles, a part tile
def test_rms_norm_triton(interpret, shape, weight):
    x = torch.randn(*shape)
    w = torch.randn(shape[-1]) if weight else None
    args = (x, w) if weight else (x,)
    close(grads(lambda *a: kernels.rms_norm(*a), *args), grads(lambda *a: kernels.rms_norm_ref(*a), *args), 1e-5)


@needs_triton
def test_rms_norm_triton_non_contiguous(interpret):
    x = torch.randn(6, 200)[:, ::2]  # (6, 100), stride 2
    w = torch.randn(100)
    close(grads(kernels.rms_norm, x, w), grads(kernels.rms_norm_ref, x, w), 1e-5)


@needs_triton
@pytest.mark.parametrize("softcap,z_loss", [(None, 0.0), (10.0, 1e-3)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("V", [1000, 1001, 37])  # even; odd, as GPT-2's 50,257 (rows of no width divisible by 16)
def test_cross_entropy_triton(interpret, softcap, z_loss, reduction, V):
    z, t = torch.randn(9, V) * 3, torch.randint(0, V, (9,))
    t[2] = -100
    kw = dict(softcap=softcap, z_loss=z_loss, reduction=reduction)
    close(grads(lambda z: kernels.cross_entropy(z, t, **kw), z),
          grads(lambda z: kernels.cross_entropy_ref(z, t, **kw), z), 1e-5)


@needs_triton
def test_cross_entropy_triton_large_vocab_non_contiguous(interpret):
    z, t = torch.randn(50304, 2).T * 2, torch.tensor([7, 50303])  # (2, 50304), column-major
    close(grads(lambda z: kernels.cross_entropy(z, t, z_loss=1e-4), z),
          grads(lambda z: kernels.cross_entropy_ref(z, t, z_loss=1e-4), z), 1e-5)


@pytest.mark.parametrize("path", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("V", [1000, 1001])
def test_linear_cross_entropy_padding_rows_are_never_classes(path, V, monkeypatch):
    """A vocabulary of 1000 or 1001 padded to 1024 rows (GPT-2's 50,257 pads to 50,304): the padding rows take
    neither probability nor gradient, though their logits of 0 would dominate real logits far below zero, as a
    trained model's are. Compared with the reference on the first V rows alone, in chunks of 8 rows."""
    if path == "triton":
        use_interpreter(monkeypatch)
    else:
        monkeypatch.setattr(kernels, "SMALL_LOGITS", 0)  # the chunked path, not the whole logits at once
    kernels.use(path)
    monkeypatch.setattr(kernels, "CHUNK_LOGITS", 8 * 1024)
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(40, 32, generator=g), torch.randint(0, V, (40,), generator=g)
    x[:, 0] = 8.0
    w = torch.cat([torch.randn(V, 32, generator=g) / 4 - 7.5 * torch.eye(32)[0], torch.zeros(1024 - V, 32)])  # ~-60
    try:
        for kw in (dict(), dict(softcap=80.0, z_loss=1e-4, reduction="none")):
            ours = grads(lambda x, w: kernels.linear_cross_entropy(x, w, t, classes=V, **kw), x, w)
            close(ours, grads(lambda x, w: kernels.linear_cross_entropy_ref(x, w[:V], t, **kw), x, w), 1e-4)
            assert ours[2][V:].abs().max() == 0 and ours[0].mean() < 30  # with the padding in the softmax: ~60
    finally:
        kernels.use("auto")


@needs_triton
@pytest.mark.parametrize("V,W", [(37, 48), (1001, 1024), (50257, 50304)])
def test_ce_kernels_take_only_the_first_V_columns(interpret, V, W):
    """The CE kernels stream all W columns of a row, so that Triton can prove its accesses aligned, and take only the
    first V as classes (issue 64): an odd V in a tile's masked tail (48 of 64), in 1,024, and GPT-2's 50,257 in 50,304.
    The padding columns hold logits far above every class's, yet get no probability, and the backward, writing the
    grads over the logits as linear_cross_entropy does, leaves exactly 0 there. Against the reference on the first V
    columns, with softcap and z-loss, an ignored row and a target in the last class."""
    g = torch.Generator().manual_seed(0)
    N = 3 if V > 5000 else 9
    z, t = torch.randn(N, W, generator=g) * 3, torch.randint(0, V, (N,), generator=g)
    dloss = torch.randn(N, generator=g)  # (N,) upstream grads
    z[:, V:], t[0], t[1] = 1e4, V - 1, -100
    for softcap, z_loss in ((0.0, 0.0), (30.0, 1e-3)):
        loss, lse = kernels._ce_fwd(z, t, -100, softcap, z_loss, V)
        dz = kernels._ce_bwd(z.clone(), t, lse, dloss, -100, softcap, z_loss, V, out=z.clone())
        ref = lambda z: kernels.cross_entropy_ref(z, t, softcap=softcap or None, z_loss=z_loss, reduction="none")
        close([loss, dz[:, :V]], grads(ref, z[:, :V], g=dloss), 1e-5)
        assert (dz[:, V:] == 0).all() and lse.isfinite().all()


@needs_triton
def test_linear_cross_entropy_triton_gpt2_vocab(interpret):
    """GPT-2's head at a few rows: 50,257 classes in 50,304 rows, the padding rows' logits far above the classes', an
    ignored row, without and with softcap and z-loss; loss and grads as the reference's on the first 50,257 rows,
    none for the padding rows."""
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(3, 8, generator=g).abs(), torch.tensor([50256, -100, 7])
    w = torch.cat([torch.randn(50257, 8, generator=g), torch.ones(47, 8) * 50])  # padding logits ~ 300, classes' ~ 3
    for kw in (dict(), dict(softcap=30.0, z_loss=1e-4, reduction="none")):  # the cap saturates the padding's grads
        ours = grads(lambda x, w: kernels.linear_cross_entropy(x, w, t, classes=50257, **kw), x, w)
        close(ours, grads(lambda x, w: kernels.linear_cross_entropy_ref(x, w[:50257], t, **kw), x, w), 1e-4)
        assert ours[2][50257:].abs().max() == 0


@needs_triton
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("chunk", [8, 64])  # 5 chunks; one
def test_linear_cross_entropy_triton(interpret, reduction, chunk, monkeypatch):
    monkeypatch.setattr(kernels, "CHUNK_LOGITS", chunk * 1000)
    x, w, t = torch.randn(40, 32), torch.randn(1000, 32) / 4, torch.randint(0, 1000, (40,))
    t[:3] = -100
    kw = dict(softcap=15.0, z_loss=1e-4, reduction=reduction)
    close(grads(lambda x, w: kernels.linear_cross_entropy(x, w, t, **kw), x, w),
          grads(lambda x, w: kernels.linear_cross_entropy_ref(x, w, t, **kw), x, w), 1e-4)


@needs_triton
@pytest.mark.parametrize("T,D,hq,hkv,causal", [(1, 32, 2, 2, True), (17, 32, 4, 2, True), (17, 64, 4, 1, False),
                                               (123, 32, 4, 4, True), (123, 32, 4, 1, False), (40, 48, 4, 2, True),
                                               (257, 64, 2, 1, True), (128, 32, 4, 2, True), (256, 64, 2, 1, False),
                                               (256, 16, 2, 2, True)])  # T % 128 == 0: the unmasked tiles
def test_attention_triton(interpret, T, D, hq, hkv, causal):
    q, k, v = torch.randn(1, hq, T, D), torch.randn(1, hkv, T, D), torch.randn(1, hkv, T, D)
    close(grads(lambda *a: kernels.attention(*a, causal=causal), q, k, v),
          grads(lambda *a: kernels.attention_ref(*a, causal=causal), q, k, v), 2e-4)


@needs_triton
def test_attention_triton_non_contiguous_scale(interpret):
    q = torch.randn(2, 19, 3, 32).transpose(1, 2)  # (B, H, T, D) with T and H strides swapped
    k, v = torch.randn(2, 19, 1, 32).transpose(1, 2), torch.randn(2, 19, 1, 32).transpose(1, 2)
    close(grads(lambda *a: kernels.attention(*a, scale=0.3), q, k, v),
          grads(lambda *a: kernels.attention_ref(*a, scale=0.3), q, k, v), 2e-4)


@needs_triton
def test_fp16_through_the_interpreter(interpret):
    """Half inputs keep their dtype through every kernel, and land within fp16 rounding of the fp32 reference."""
    x, w, t = torch.randn(6, 100), torch.randn(100), torch.randint(0, 100, (6,))
    q, k = torch.randn(1, 4, 20, 32), torch.randn(1, 2, 20, 32)
    cases = [(kernels.rms_norm, kernels.rms_norm_ref, (x, w)),
             (kernels.cross_entropy, kernels.cross_entropy_ref, (x, t)),
             (kernels.linear_cross_entropy, kernels.linear_cross_entropy_ref, (x, w.view(4, 25).repeat(1, 4), t % 4)),
             (kernels.attention, kernels.attention_ref, (q, k, k))]
    for fn, ref, args in cases:
        half = [a.half() if a.is_floating_point() else a for a in args]
        ours, want = grads(fn, *half), grads(ref, *args)
        assert all(o.dtype == torch.float16 for o in ours)
        close(ours, want, 2e-2)


# ----------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("mode", ["torch", "interpret"])
def test_compile_fullgraph(monkeypatch, mode):
    """Every public function traces with fullgraph=True (custom ops, no graph breaks) and matches eager."""
    if mode == "interpret":
        use_interpreter(monkeypatch)
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch._dynamo.reset()

    def f(x, w, W, q, k, v, t):
        h = kernels.rms_norm(x, w)
        a = kernels.attention(q, k, v, causal=True)
        return kernels.cross_entropy(h, t, z_loss=1e-4) + kernels.linear_cross_entropy(h, W, t) + a.square().mean()

    x, w, W, t = torch.randn(8, 64), torch.randn(64), torch.randn(50, 64) / 8, torch.randint(0, 50, (8,))
    q, k, v = torch.randn(1, 2, 8, 32), torch.randn(1, 1, 8, 32), torch.randn(1, 1, 8, 32)
    args = (x, w, W, q, k, v, t)
    close(grads(torch.compile(f, fullgraph=True, backend="aot_eager"), *args), grads(f, *args), 1e-4)


# ----------------------------------------------------------------------------- GPU: bf16/fp16 (flash-attention rule)


@needs_cuda
@needs_triton
def test_interpreter_tests_in_a_subprocess():
    """On a GPU machine the interpreter's tests run apart, with CUDA hidden, so their patching cannot leak here."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "not gpu and not subprocess"], capture_output=True, text=True, cwd=Path(__file__).parent.parent,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    print(r.stdout.splitlines()[-1])


def err(a, b):
    return (a.float() - b.float()).abs().max().item()


@contextlib.contextmanager
def on_triton():
    """kernels.use("triton") inside the block, the caller's choice restored after: "auto" gives attention to SDPA (and
    RMSNorm under compile to PyTorch's op), so a test of our kernel under it would compare PyTorch with itself."""
    prev = kernels._backend
    kernels.use("triton")
    try:
        yield
    finally:
        kernels.use(prev)


def attention_low_precision(device, dtype, B, T, D, hq, hkv, causal):
    """Our Triton attention in dtype: error against the fp32 reference at most 2x SDPA's own in the same dtype (3x for
    grads), flash-attention's rule. The GPU test's body; a CPU test runs it tiny to check which kernels it launches."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, h, T, D, device=device) for h in (hq, hkv, hkv))
    g = torch.randn(B, hq, T, D, device=device)
    low = [x.to(dtype) for x in (q, k, v)]
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
    ref = grads(lambda *a: kernels.attention_ref(*a, causal=causal), q, k, v, g=g)
    with on_triton():
        ours = grads(lambda *a: kernels.attention(*a, causal=causal), *low, g=g.to(dtype))
    torch_ = grads(sdpa, *low, g=g.to(dtype))
    for i, (o, t, r) in enumerate(zip(ours, torch_, ref)):
        assert err(o, r) <= (2 if i == 0 else 3) * err(t, r) + 1e-5, f"output {i}: {err(o, r)} vs {err(t, r)}"


def norm_and_losses_low_precision(device, dtype, rows, width, vocab):
    """Our Triton RMSNorm, CE and linear + CE in dtype: error against the fp32 reference at most 3x that of PyTorch's
    own op in the same dtype (F.rms_norm, F.cross_entropy; the reference's matmul in dtype for linear + CE)."""
    torch.manual_seed(0)
    x, w = torch.randn(rows, width, device=device), torch.randn(width, device=device)
    g = torch.randn(rows, width, device=device)  # one upstream grad for all three: randn in fp16 draws other numbers
    z, t = torch.randn(64, vocab, device=device) * 3, torch.randint(0, vocab, (64,), device=device)
    h, W = torch.randn(256, 128, device=device), torch.randn(vocab, 128, device=device) / 10
    lce = lambda f: lambda h, W: f(h, W, t.repeat(4), softcap=30.0)
    cases = [(kernels.rms_norm_ref, kernels.rms_norm, lambda x, w: F.rms_norm(x, (width,), w, 1e-6), (x, w), g, 1e-5),
             (lambda z: kernels.cross_entropy_ref(z, t), lambda z: kernels.cross_entropy(z, t),
              lambda z: F.cross_entropy(z, t), (z,), None, 1e-5),
             (lce(kernels.linear_cross_entropy_ref), lce(kernels.linear_cross_entropy),
              lce(kernels.linear_cross_entropy_ref), (h, W), None, 1e-4)]
    for ref_fn, ours_fn, torch_fn, args, g, atol in cases:
        ref = grads(ref_fn, *args, g=g)
        low = [a.to(dtype) for a in args]
        with on_triton():
            ours = grads(ours_fn, *low, g=None if g is None else g.to(dtype))
        torch_ = grads(torch_fn, *low, g=None if g is None else g.to(dtype))
        for i, (o, tt, r) in enumerate(zip(ours, torch_, ref)):
            assert err(o, r) <= 3 * err(tt, r) + atol, f"{ours_fn}, output {i}: {err(o, r)} vs {err(tt, r)}"


@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,D,hq,hkv,causal", [(1000, 64, 8, 2, True), (513, 128, 4, 4, False), (77, 32, 4, 1, True)])
def test_attention_gpu_low_precision(dtype, T, D, hq, hkv, causal):
    """Our attention kernel, not SDPA, against SDPA's error: bf16 and fp16, GQA and MQA, odd T."""
    attention_low_precision("cuda", dtype, 2, T, D, hq, hkv, causal)


@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_and_losses_gpu_low_precision(dtype):
    """Our RMSNorm and loss kernels against PyTorch's error, at a GPT-2 vocabulary."""
    norm_and_losses_low_precision("cuda", dtype, 300, 1000, 50304)


ATTN = {"_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"}
RMS, CE = {"_rms_fwd_kernel", "_rms_bwd_kernel"}, {"_ce_fwd_kernel", "_ce_bwd_kernel"}


def launched(monkeypatch):
    """The names of the Triton kernels launched from now on: kernels._launch, which every launch goes through,
    recorded and still run."""
    ran, launch = [], kernels._launch

    def record(kernel, *args, **meta):
        fn = kernel
        while hasattr(fn, "fn"):  # an Autotuner wraps a JITFunction, which wraps the Python function
            fn = fn.fn
        ran.append(fn.__name__)
        return launch(kernel, *args, **meta)

    monkeypatch.setattr(kernels, "_launch", record)
    return ran


def test_low_precision_tests_launch_our_triton_kernels(monkeypatch):
    """The GPU tests' bodies, run tiny on the CPU under the interpreter and the default "auto" (which gives attention
    to SDPA), launch our Triton kernels for every op, forward and backward, and leave "auto" in force after."""
    use_interpreter(monkeypatch)
    kernels.use("auto")
    ran = launched(monkeypatch)
    attention_low_precision("cpu", torch.float16, 1, 20, 32, 4, 2, True)
    assert set(ran) == ATTN and kernels.backend("cpu") == "auto"
    ran.clear()
    norm_and_losses_low_precision("cpu", torch.float16, 12, 100, 300)
    assert set(ran) == RMS | CE and kernels.backend("cpu") == "auto"


def test_bench_columns_run_the_path_they_are_named_for(monkeypatch):
    """python kernels.py --bench times our Triton kernels in its "triton" columns, even under "auto" (which gives
    attention to SDPA), and PyTorch's ops in the others: run tiny on the CPU under the interpreter, each column,
    forward and backward, launches exactly its op's Triton kernels, or none. torch.compile is stubbed to return its
    function, so the compiled columns run, eagerly, the PyTorch op they compile: Inductor is not what this checks."""
    use_interpreter(monkeypatch)
    monkeypatch.setattr(torch, "compile", lambda fn: fn)
    kernels.use("auto")
    ran = launched(monkeypatch)
    q, x, W, t = torch.randn(1, 2, 20, 32), torch.randn(12, 100), torch.randn(100, 100), torch.randint(0, 100, (12,))
    calls = {"attention": ((q, q, q), lambda f: lambda q, k, v: f(q, k, v, True), ATTN),
             "rms_norm": ((x, W[0]), lambda f: f, RMS),
             "cross_entropy": ((x,), lambda f: lambda z: f(z, t), CE),
             "linear_ce": ((x, W), lambda f: lambda x, W: f(x, W, t), CE)}
    cols = kernels.bench_columns()
    assert set(cols) == set(calls) and all("triton" in fns for fns in cols.values())
    for op, fns in cols.items():
        args, call, want = calls[op]
        for label, fn in fns.items():
            ran.clear()
            grads(call(fn), *args)
            assert set(ran) == (want if label == "triton" else set()), (op, label, ran)
            assert kernels.backend("cpu") == "auto"


@needs_triton
def test_fake_kernels_match_real_strides(interpret):
    """torch.compile plans memory from each op's fake kernel: its output strides must be the real kernel's, also for
    the non-contiguous inputs that QK-norm and a fused qkv projection give (permuted views)."""
    qkv = torch.randn(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)  # (3, B, H, T, D) views, as the models make them
    q, k, v = qkv[0], qkv[1], qkv[2]
    checks = [(kernels._rms_norm_op, (q, torch.randn(8), 1e-6)), (kernels._rms_norm_op, (q, None, 1e-6)),
              (kernels._attn_op, (q, k, v, False, 0.35))]
    for op, args in checks:
        torch.library.opcheck(op, args, test_utils=("test_faketensor",))
