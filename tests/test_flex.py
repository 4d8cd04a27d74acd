"""FlexAttention for --window (issue 82): kernels.use_attention("flex") against the masked SDPA it replaces, which
stays the reference. On a CPU: the forward (eager FlexAttention, which masks every score as the reference does), the
block mask that decides which tiles the compiled kernel skips, a compiled GPT's trace of it, the one-line errors
where it cannot run, and the GPU timing's code. On CUDA: the compiled kernel's forward and gradients in bf16, alone
and inside a compiled GPT."""
import pytest
import torch

import kernels
import train_gpt as tg

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="FlexAttention does not support backward on CPU: this runs on a CUDA GPU")
# eager FlexAttention warns, once, that it is not the fused kernel: on a CPU that is the point of the check
unfused = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture
def flex():
    """kernels.use_attention("flex") for one test, and the reference ("sdpa") after it."""
    kernels.use_attention("flex")
    yield
    kernels.use_attention("sdpa")


def qkv(B, hq, hkv, T, D, device="cpu", dtype=torch.float32):
    """Random queries (B, hq, T, D), keys and values (B, hkv, T, D)."""
    g = torch.Generator(device).manual_seed(T * 31 + hq)
    return [torch.randn(B, h, T, D, device=device, generator=g).to(dtype) for h in (hq, hkv, hkv)]


# T below, at and past one 128-position tile, and ragged ones; windows of one key, inside a tile, across tiles, and
# wider than T (full causal attention)
SHAPES = [(37, 4, 2, 5), (128, 2, 2, 128), (200, 4, 2, 16), (300, 3, 1, 64), (300, 2, 2, 1), (257, 4, 4, 400)]


@unfused
@pytest.mark.parametrize("T,hq,hkv,window", SHAPES)
def test_flex_forward_matches_the_masked_sdpa(flex, T, hq, hkv, window):
    """attention(..., window=W) under use_attention("flex") gives the masked SDPA's output, GQA and ragged T
    included; with no window, FlexAttention's causal mask gives SDPA's causal attention."""
    q, k, v = qkv(2, hq, hkv, T, 32)
    with torch.no_grad():
        out = kernels.attention(q, k, v, scale=0.2, window=window)
        ref = kernels._attn_torch(q, k, v, True, 0.2, window)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        causal = kernels._attn_flex(q, k, v, None)
        torch.testing.assert_close(causal, kernels._attn_torch(q, k, v, True, None), atol=1e-5, rtol=1e-5)


@unfused
def test_flex_takes_only_the_windows_of_a_training_step(flex, monkeypatch):
    """Under "flex", a windowed call with as many queries as keys goes to FlexAttention; full causal attention and
    a decode step against a longer KV cache stay on their own paths; under "sdpa" nothing does."""
    calls = []
    flex_fn = kernels._attn_flex
    monkeypatch.setattr(kernels, "_attn_flex", lambda *a, **kw: calls.append(a[0].shape[2]) or flex_fn(*a, **kw))
    q, k, v = qkv(1, 2, 2, 40, 16)
    with torch.no_grad():
        kernels.attention(q, k, v, window=8)
        kernels.attention(q, k, v)
        decode = kernels.attention(q[:, :, -3:], k, v, window=8)
        kernels.use_attention("sdpa")
        kernels.attention(q, k, v, window=8)
    assert calls == [40]
    torch.testing.assert_close(decode, kernels.attention_ref(q[:, :, -3:], k, v, window=8), atol=1e-5, rtol=1e-5)


def band_tiles(T, window, n):
    """(tiles with a score the band keeps, tiles whose every score in range it keeps), each (T/n, T/n) rounded up,
    written from the definition: query i sees key j if and only if i - window < j <= i."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    keep = j <= i
    if window:
        keep &= i - j < window
    nb = -(-T // n)
    padded = torch.zeros(nb * n, nb * n, dtype=torch.bool)
    padded[:T, :T] = keep
    outside = torch.ones(nb * n, nb * n, dtype=torch.bool)
    outside[:T, :T] = False  # past T: no score to keep
    tiles = padded.view(nb, n, nb, n)
    return tiles.any(3).any(1), (padded | outside).view(nb, n, nb, n).all(3).all(1)


@pytest.mark.parametrize("T,window", [(37, 5), (200, 16), (300, 64), (300, None), (1024, 256), (1000, 1)])
def test_the_block_mask_skips_exactly_the_tiles_outside_the_band(T, window):
    """The compiled kernel computes the tiles the block mask lists and skips the rest; it skips the mask itself in
    the tiles listed as full. Every tile with a kept score is listed, no other is, and none listed as full holds a
    masked score. (Eager FlexAttention, above, masks every score and ignores the tiles, so only this sees them.)"""
    mask = kernels._block_mask(T, window, torch.device("cpu"))
    n = mask.BLOCK_SIZE[0]
    some, every = band_tiles(T, window, n)
    assert torch.equal(mask.to_dense()[0, 0], some)
    full = torch.zeros_like(every)
    for row in range(len(full)):
        full[row, mask.full_kv_indices[0, 0, row, :mask.full_kv_num_blocks[0, 0, row]]] = True
    assert not (full & ~every).any(), "a tile marked full holds a masked score"
    if window and window + 2 * n <= T:  # a tile wholly past the band: causal attention computes it, this skips it
        assert some.sum() < band_tiles(T, None, n)[0].sum()
    assert kernels._block_mask(T, window, torch.device("cpu")) is mask  # made once per shape


def test_flex_backward_off_cuda_stops_in_one_line(flex):
    """FlexAttention has no backward on a CPU (torch 2.13): a call that would need one says so and names the fix,
    before any work; the trainer refuses --attention=flex without a CUDA GPU, before any work too."""
    q, k, v = qkv(1, 2, 2, 16, 8)
    q.requires_grad_()
    with pytest.raises(NotImplementedError, match=r"no backward on cpu .*use_attention\('sdpa'\)"):
        kernels.attention(q, k, v, window=4)
    with pytest.raises(ValueError, match="must be 'sdpa' or 'flex'"):
        kernels.use_attention("flash")
    devices = ["cpu", "mps"] + ([] if torch.cuda.is_available() else ["auto", "cuda"])
    for device in devices:
        with pytest.raises(SystemExit) as e:
            tg.check_config(tg.Config(attention="flex", window=8, device=device))
        msg = str(e.value.code)
        assert "--attention=flex needs a CUDA GPU" in msg and "--attention=sdpa" in msg and "\n" not in msg, msg


@unfused
def test_a_compiled_gpt_traces_its_flex_windows_in_one_graph(flex, monkeypatch):
    """torch.compile traces the model's FlexAttention calls as on CUDA, forward only (aot_eager: no backward here):
    through the compiled flex_attention that use_attention made, with the block mask cached by the first call, in
    graphs without a break, and the loss of the masked SDPA."""
    from torch._dynamo.utils import counters
    monkeypatch.setitem(kernels._flex, "eager", kernels._flex["compiled"])  # CUDA's path, on the CPU
    cfg = tg.Config(n_layer=3, n_head=2, n_embd=32, seq_len=256, window=40, window_pattern=3, value_embeds=False)
    raw = tg.build_model(cfg, 300, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every weight random: the zero-init head would give every model the same loss
        for p in raw.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    x = torch.randint(0, 300, (2, 201), generator=g)
    torch._dynamo.reset()
    counters.clear()
    model = torch.compile(raw, backend="aot_eager")
    with torch.no_grad():
        losses = [model(x[:, :-1], x[:, 1:]) for _ in range(2)]
        kernels.use_attention("sdpa")
        ref = raw(x[:, :-1], x[:, 1:])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert (200, 40, torch.device("cpu")) in kernels._flex
    for loss in losses:
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)


def err(a, b):
    return (a.float() - b.float()).abs().max().item()


def grads(fn, q, k, v, g):
    """fn's output and the gradients of (output * g).sum() for q, k and v."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(g)
    return [out.detach(), q.grad, k.grad, v.grad]


@needs_cuda
@pytest.mark.parametrize("T,hq,hkv,window", [(1024, 12, 12, 256), (4096, 4, 2, 1024), (300, 4, 1, 64),
                                             (1000, 2, 2, 1), (512, 4, 4, None)])
def test_flex_backward_matches_the_masked_sdpa_in_bf16(flex, T, hq, hkv, window):
    """The compiled kernel in bf16, forward and the gradients of q, k and v: each within 2x (grads 3x) of the masked
    SDPA's own bf16 error against the fp32 reference, flash attention's rule (tests/test_kernels.py's)."""
    q, k, v = qkv(2, hq, hkv, T, 64, device="cuda")
    g = torch.randn(2, hq, T, 64, device="cuda")
    ref = grads(lambda *a: kernels.attention_ref(*a, window=window), q, k, v, g)
    low = [x.bfloat16() for x in (q, k, v)]
    ours = grads(lambda *a: kernels._attn_flex(*a, None, window), *low, g.bfloat16())
    sdpa = grads(lambda *a: kernels._attn_torch(*a, True, None, window), *low, g.bfloat16())
    for i, (o, s, r) in enumerate(zip(ours, sdpa, ref)):
        assert err(o, r) <= (2 if i == 0 else 3) * err(s, r) + 1e-3, f"output {i}: {err(o, r)} vs {err(s, r)}"


@needs_cuda
def test_a_compiled_gpt_with_flex_windows_trains_as_with_sdpa():
    """A compiled GPT with local and global layers, in bf16: its loss and every gradient under "flex" as under
    "sdpa", within bf16's tolerance, over two steps (the first traces the block mask; the second reads its cache)."""
    cfg = tg.Config(n_layer=3, n_head=4, n_embd=128, seq_len=512, window=96, window_pattern=3, value_embeds=False)
    x = torch.randint(0, 512, (4, 512), device="cuda")
    runs = []
    for name in ("sdpa", "flex"):
        kernels.use_attention(name)
        try:
            raw = tg.build_model(cfg, 512, torch.device("cuda"))
            g = torch.Generator("cuda").manual_seed(0)
            with torch.no_grad():  # every weight random: the zero-init outputs would leave most gradients zero
                for p in raw.parameters():
                    p.copy_(torch.randn(p.shape, device="cuda", generator=g) * 0.05)
            model = torch.compile(raw)
            for _ in range(2):
                raw.zero_grad()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x[:, :-1], x[:, 1:])
                loss.backward()
            runs.append([loss.detach()] + [p.grad.float() for p in raw.parameters() if p.grad is not None])
        finally:
            kernels.use_attention("sdpa")
    assert len(runs[0]) == len(runs[1]) > 10
    assert abs(runs[0][0] - runs[1][0]).item() < 1e-2, (runs[0][0], runs[1][0])  # the losses
    for a, b in zip(runs[0][1:], runs[1][1:]):
        assert (a - b).norm() <= 0.05 * a.norm(), ((a - b).norm(), a.norm())  # bf16's rounding, not a wrong mask


@unfused
def test_the_window_bench_runs_its_code(capsys):
    """python kernels.py --bench_window, the GPU run's attention timing: on a CPU it runs every path of its table at
    small sizes (FlexAttention forward only), prints a row a length, and leaves the reference in force."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU this is the timing itself: bench.sh runs it")
    kernels.bench_window()
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and r[2].isdigit()]
    assert [r.split(" | ")[:2] for r in rows] == [["| 256", "64"], ["| 512", "128"]], rows
    assert all(r.count(" / ") == 3 and "/ no backward on a CPU | - |" in r for r in rows), rows
    assert kernels._masked == "sdpa"
