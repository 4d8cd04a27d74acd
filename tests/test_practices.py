"""The practices docs/map.md marks done that no other test showed: each test here fails if its practice is taken out of
the code (each says how). Small, CPU-only, on data made here; the map names, row by row, the test that shows each."""
import json
import math
import os
import sys
import threading
import time
import types
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import faults
import kernels
import predict_vit as pv
import prepare_data
import scaling as sc
import train_diffusion as td
import train_gpt as tg
import train_vit as tv
from conftest import write_corpus

CPU = torch.device("cpu")
TINY = dict(n_layer=2, n_head=4, n_embd=64, seq_len=32, batch_size=4, time_budget=0.0, warmup_steps=3, eval_every=0,
            log_every=1, sample_tokens=0, device="cpu", compile="false", dtype="float32")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A byte corpus with a val split of 2 documents, so the final eval of a run here takes a few forwards."""
    return write_corpus(tmp_path_factory.mktemp("practices"), n_train=60, n_val=2)


def tiny(corpus, out, **kw):
    return tg.Config(**{**TINY, "data_dir": str(corpus), "out_dir": str(out), **kw})


def losses(out_dir):
    """[(step, record)] of a run's log lines in metrics.jsonl."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [(r["step"], r) for r in map(json.loads, f) if "loss" in r]


def nontrivial(model, std=0.1):
    """Every matrix drawn at random: zero-init projections would hide what attention and the MLP do."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def training_forwards(monkeypatch, on_call):
    """Call on_call(model) at each forward of a GPT with autograd on (the training forwards, not evals)."""
    forward = tg.GPT.forward

    def wrapped(model, *args, **kw):
        if torch.is_grad_enabled():
            on_call(model)
        return forward(model, *args, **kw)
    monkeypatch.setattr(tg.GPT, "forward", wrapped)

# ----------------------------------------------------------------------------- attention


def saved_shapes(fn, *xs):
    """The shapes of the tensors autograd keeps for the backward of fn(*xs)."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*xs)
    return shapes


@pytest.mark.parametrize("path", ["auto", "triton"])
def test_attention_is_fused_and_keeps_no_t_by_t_scores(path, monkeypatch):
    """Causal attention reaches SDPA without a mask, the call for which it may pick a flash kernel (FlashAttention-2
    or cuDNN on a GPU); our Triton kernel (opt-in, use("triton")) recomputes the scores in the backward from the saved
    log-sum-exp. Neither keeps a T x T matrix for the backward: memory grows with T, not T^2. The reference, which
    materialises the scores, is the control. A --window is a dense (T, T) mask over SDPA: its cost stays T^2."""
    if path == "triton":
        pytest.importorskip("triton")
        from test_kernels import interpreter_error
        if torch.cuda.is_available() or interpreter_error():
            pytest.skip("the interpreter patches triton for the process (GPU), or cannot run these kernels")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(kernels, "_backend", "triton")
    calls, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append((kw.get("attn_mask"), kw.get("is_causal"))) or sdpa(*a, **kw))
    T = 64
    q, k, v = (torch.randn(1, h, T, 16, requires_grad=True) for h in (4, 2, 2))
    tt = lambda shapes: [s for s in shapes if s[-2:] == (T, T)]  # noqa: E731
    assert not tt(saved_shapes(lambda *a: kernels.attention(*a, causal=True), q, k, v))
    assert calls == ([(None, True)] if path == "auto" else [])  # no mask: SDPA may take its flash kernel
    assert tt(saved_shapes(lambda *a: kernels.attention_ref(*a, causal=True), q, k, v))  # the check can fail
    calls.clear()
    assert tt(saved_shapes(lambda *a: kernels.attention(*a, causal=True, window=8), q, k, v))  # the window's mask
    assert len(calls) == 1 and calls[0][0].shape == (T, T)


def test_qk_norm_makes_attention_blind_to_the_size_of_q_and_k():
    """With QK-norm (the default) queries and keys are normalised before their dot product, so scaling them up 50x
    leaves attention as it was: the logits stay bounded. Without it (the control) the same change alters the output."""
    for qk_norm in (True, False):
        model = nontrivial(tg.build_model(tg.Config(**{**TINY, "qk_norm": qk_norm}), 257, CPU))
        attn, x = model.blocks[0].attn, torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            before = attn(x, model.cos[:8], model.sin[:8])
            attn.qkv.weight[:2 * 64] *= 50  # the query and key rows (MHA: 4 heads of 16 each)
            after = attn(x, model.cos[:8], model.sin[:8])
        assert torch.allclose(before, after, atol=1e-4) == qk_norm


def test_rope_scores_depend_only_on_the_distance():
    """RoPE rotates queries and keys by their position, so a query-key score depends on how far apart they are, not
    on where they are: score(i, j) = score(i + 1, j + 1), while scores at other distances differ."""
    cos, sin = tg.rope_tables(16, 8, 10000.0, None)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, 1, 8, generator=g).expand(1, 1, 16, 8) for _ in range(2))  # one vector at every position
    s = (tg.apply_rope(q, cos, sin) @ tg.apply_rope(k, cos, sin).transpose(-1, -2))[0, 0]  # (16, 16)
    torch.testing.assert_close(s[1:, 1:], s[:-1, :-1], rtol=1e-5, atol=1e-5)
    assert (s[0] - s[0, 0]).abs()[1:].min() > 1e-3  # and the distance matters


def test_gqa_shares_key_value_heads_and_shrinks_the_cache():
    """--n_kv_head: each key/value head serves n_head / n_kv_head query heads (1: multi-query), so the projection and
    the KV cache hold n_kv_head heads only; the default, 0, is one per query head (MHA)."""
    assert tg.Config().n_kv_head == 0
    x = torch.randint(0, 257, (2, 10))
    for kv in (4, 2, 1):
        cfg = tg.Config(**{**TINY, "n_kv_head": kv})
        model = tg.build_model(cfg, 257, CPU)
        assert model.blocks[0].attn.qkv.weight.shape[0] == (4 + 2 * kv) * 16
        cache = tg.KVCache(cfg.n_layer, cfg.seq_len)
        model(x, cache=cache)
        assert cache.k[0].shape == (2, kv, cfg.seq_len, 16)


# ----------------------------------------------------------------------------- model


def test_blocks_start_as_the_identity():
    """Zero-init output projections on pre-norm residual blocks: every block of the three models starts as the
    identity, and the GPT's first loss is ln(vocab). It fails without the skip connections (the block would give 0),
    with post-norm (it would give norm(x)), or with random output projections."""
    x = torch.randn(2, 8, 64)
    gpt = tg.build_model(tg.Config(**TINY), 257, CPU)
    assert all(torch.equal(b(x, gpt.cos[:8], gpt.sin[:8]), x) for b in gpt.blocks)
    idx = torch.randint(0, 257, (2, 9))
    assert gpt(idx[:, :-1], idx[:, 1:]).item() == pytest.approx(math.log(257), abs=1e-4)
    meta = {"classes": list("abc"), "num_classes": 3, "image_size": [16, 16], "channels": 3, "mean": [0.5] * 3,
            "std": [0.25] * 3}
    vit = tv.build_model(tv.Config(n_layer=2, n_head=4, n_embd=64, patch_size=4), meta, CPU)
    assert all(torch.equal(b(x), x) for b in vit.blocks)
    dit = td.build_model(td.Config(n_layer=2, n_head=4, n_embd=64, patch_size=4), 16, 3, 3, CPU)
    assert all(torch.equal(b(x, torch.randn(2, 64)), x) for b in dit.blocks)  # adaLN-Zero: the gates start at 0


def test_norm_gains_start_at_one_biases_at_zero_and_no_batchnorm():
    """Every norm gain starts at 1 and every norm bias at 0 (--bias); by default the GPT has no bias anywhere; no
    model of the suite has a BatchNorm (LayerNorm or RMSNorm only)."""
    for bias in (True, False):
        model = tg.build_model(tg.Config(**{**TINY, "bias": bias}), 257, CPU)
        norms = [m for m in model.modules() if isinstance(m, tg.Norm)]
        assert norms and all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)
        assert all(not m.bias.any() for m in norms if m.bias is not None) and (norms[0].bias is not None) == bias
        assert any(n.endswith("bias") for n, _ in model.named_parameters()) == bias
    assert tg.Config().bias is False
    meta = {"classes": list("abc"), "num_classes": 3, "image_size": [16, 16], "channels": 3, "mean": [0.5] * 3,
            "std": [0.25] * 3}
    models = [tg.build_model(tg.Config(**TINY), 257, CPU), td.build_model(td.Config(patch_size=4), 16, 3, 3, CPU),
              tv.build_model(tv.Config(n_embd=64, patch_size=4), meta, CPU)]
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for model in models for m in model.modules())


def test_swiglu_is_a_silu_gate_and_the_default():
    """The GPT's default MLP is SwiGLU: proj(silu(a) * b) of the two halves of one projection, its hidden width 2/3 of
    4d (rounded up to 64) so that its three matrices hold about the parameters of GELU's two."""
    assert tg.Config().mlp == "swiglu"
    mlp = tg.MLP(tg.Config(n_embd=96))
    x = torch.randn(3, 96)
    a, b = mlp.fc(x).chunk(2, dim=-1)
    torch.testing.assert_close(mlp(x), mlp.proj(F.silu(a) * b))
    gelu = tg.MLP(tg.Config(n_embd=96, mlp="gelu"))
    n = [sum(p.numel() for p in m.parameters()) for m in (mlp, gelu)]
    assert mlp.proj.in_features == 256 and abs(n[0] / n[1] - 1) < 0.05


def test_tied_embeddings_share_one_matrix():
    """--tie_embeddings: the output head is the input embedding, one (vocab, d) matrix fewer."""
    untied = tg.build_model(tg.Config(**TINY), 320, CPU)
    tied = tg.build_model(tg.Config(**{**TINY, "tie_embeddings": True}), 320, CPU)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert tied.head is None and tied.hidden(torch.zeros(1, 4, dtype=torch.long))[1] is tied.wte.weight
    assert count(untied) - count(tied) == 320 * 64


def test_z_loss_and_softcap_reach_the_loss():
    """--z_loss adds z_loss x mean(logsumexp(logits)^2) to the loss; --logit_softcap bounds every logit by the cap, in
    the loss as in the logits. Each fails if the model stops passing its flag to the loss."""
    idx = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(0))
    x, y = idx[:, :-1], idx[:, 1:]
    model = nontrivial(tg.build_model(tg.Config(**TINY), 257, CPU), std=0.3)
    with torch.no_grad():
        logits, plain, z = model(x), model(x, y), model(x, y, z_loss=0.1)
        assert z - plain == pytest.approx(0.1 * logits.logsumexp(-1).square().mean().item(), rel=1e-4)
        assert logits.abs().max() > 3
        capped = nontrivial(tg.build_model(tg.Config(**{**TINY, "logit_softcap": 3.0}), 257, CPU), std=0.3)
        logits = capped(x)
        assert logits.abs().max() <= 3.0
        assert capped(x, y).item() == pytest.approx(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item(), rel=1e-5)


def test_qat_rounds_the_forward_and_passes_gradients_straight_through():
    """finetune_gpt.py --qat=BITS: each hidden matrix is used, in the forward, on --export's grid of that many bits,
    while its gradient is the float weight's (the straight-through estimator)."""
    import finetune_gpt as ft
    cfg = ft.Config(**{**TINY, "qat": 4})
    same, init = ft.start_from(cfg, {"vocab_size": 257}, None, 0, 1)  # no --init_from: a fresh GPT
    assert same == cfg and init == {"tokenizer": None}
    raw = ft.build_student(cfg, 257, CPU, init)
    hidden = [m for b in raw.blocks for m in (b.attn.qkv, b.attn.proj, b.mlp.fc, b.mlp.proj)]
    assert all(isinstance(m, ft.QATLinear) and m.bits == 4 for m in hidden)
    lin = ft.QATLinear(torch.nn.Linear(16, 8, bias=False), 4)
    x = torch.randn(5, 16)
    q, scale = ft.quantize(lin.weight.detach(), 4)
    out = lin(x)
    torch.testing.assert_close(out, F.linear(x, q * scale))
    assert (out - F.linear(x, lin.weight)).abs().max() > 1e-3  # 4 bits round visibly
    out.square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, 2 * out.detach().T @ x)  # d/dW of sum((x Wq^T)^2), Wq -> W


def test_the_seed_sets_the_init():
    """--seed: the same seed builds the same weights, another seed other weights."""
    a, b, c = (tg.build_model(tg.Config(**{**TINY, "seed": s}), 257, CPU) for s in (1, 1, 2))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_models_are_built_on_the_meta_device(monkeypatch):
    """build_model makes the GPT on the meta device (no memory, no init cost), then materialises and initialises it."""
    seen, init = [], tg.GPT.__init__

    def recording(self, *args, **kw):
        init(self, *args, **kw)
        seen.append(self.wte.weight.device.type)
    monkeypatch.setattr(tg.GPT, "__init__", recording)
    model = tg.build_model(tg.Config(**TINY), 257, CPU)
    assert seen == ["meta"] and model.wte.weight.device == CPU
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.1)


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("how, bar", [("blocks", 0.25), ("selective", 0.6)])
def test_activation_checkpointing_keeps_less_for_the_backward(how, bar):
    """--activation_checkpointing: autograd keeps far fewer bytes for the backward (measured: blocks 17%, selective
    49% of none), which it makes up by recomputing the blocks (or their MLPs) then."""
    x = torch.randint(0, 257, (2, 33))

    def saved_bytes(mode):
        model = tg.build_model(tg.Config(**{**TINY, "activation_checkpointing": mode}), 257, CPU)
        n = [0]

        def pack(t):
            n[0] += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x[:, :-1], x[:, 1:])
        return n[0]
    assert saved_bytes(how) < bar * saved_bytes("none")


def test_the_loss_never_holds_all_the_logits(monkeypatch):
    """Past kernels.SMALL_LOGITS (16M logits: a batch of 8 x 1,024 tokens at GPT-2's vocabulary) the head and the
    loss run in chunks of rows, so the (tokens, vocab) logits never exist at once: 64 tokens in chunks of 8 here."""
    monkeypatch.setattr(kernels, "SMALL_LOGITS", 0)
    monkeypatch.setattr(kernels, "CHUNK_LOGITS", 8 * 320)
    chunks, rows = [], kernels._ce_rows_torch
    monkeypatch.setattr(kernels, "_ce_rows_torch", lambda z, *a: chunks.append(tuple(z.shape)) or rows(z, *a))
    model = nontrivial(tg.build_model(tg.Config(**TINY), 300, CPU))  # 300 classes pad to 320 rows
    idx = torch.randint(0, 300, (2, 33))
    model(idx[:, :-1], idx[:, 1:]).backward()
    assert chunks == [(8, 320)] * 8


# ----------------------------------------------------------------------------- precision


def test_fp16_has_a_loss_scaler_that_doubles_every_2000_steps():
    """--dtype=float16: autocast in fp16 with a GradScaler, whose scale doubles after 2,000 steps without an overflow;
    bf16 needs none."""
    dtype, ctx, scaler = tg.setup_precision(CPU, "float16")
    assert dtype == torch.float16 and scaler.is_enabled()
    assert (scaler.get_growth_interval(), scaler.get_growth_factor()) == (2000, 2.0)
    with ctx:
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float16
    assert not tg.setup_precision(CPU, "bfloat16")[2].is_enabled()


def test_an_fp16_step_scales_the_loss_and_unscales_the_grads(corpus, tmp_path):
    """The loop's use of the GradScaler: an fp16 run (autocast on the CPU) multiplies each loss by the scale before
    its backward and divides the grads by it before the clip and the step, so the grad norm it logs is the size of
    the fp32 run's. Without the scale() call it would be 2^16 times smaller; without unscale_(), 2^16 times larger.
    (Here the first step, at the scaler's first scale of 2^16, overflows fp16 and is skipped, as GradScaler means it
    to be: the scale halves and the next step goes through.)"""
    for dtype in ("float32", "float16"):
        tg.main(tiny(corpus, tmp_path / dtype, max_steps=3, dtype=dtype))
    assert json.loads((tmp_path / "float16" / "config.json").read_text())["dtype"] == "float16"
    fp32 = losses(tmp_path / "float32")[0][1]["gnorm"]
    fp16 = next(r["gnorm"] for _, r in losses(tmp_path / "float16") if math.isfinite(r["gnorm"]))
    assert 0.5 < fp16 / fp32 < 2, (fp16, fp32)


def test_weights_grads_and_optimizer_state_stay_fp32_under_autocast():
    """Under bf16 autocast the parameters (the master weights), their gradients and every optimizer state (Muon's
    momentum, AdamW's moments) stay fp32; only the matmuls run in bf16."""
    cfg = tg.Config(**TINY)
    model = tg.build_model(cfg, 257, CPU)
    opts = tg.build_optimizers(cfg, model)
    idx = torch.randint(0, 257, (2, 17))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.blocks[0].mlp.fc(torch.randn(2, 64)).dtype == torch.bfloat16
        loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    for opt in opts:
        opt.step()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    states = [t for opt in opts for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    assert len(states) > len(list(model.parameters())) and all(t.dtype == torch.float32 for t in states)


def test_gpu_precision_is_bf16_else_fp16_and_tf32_for_the_rest(monkeypatch):
    """On CUDA, --dtype=auto takes bf16 where the GPU has it, fp16 (with loss scaling) where not (T4, V100), and any
    fp32 matmul that remains runs as TF32 (float32_matmul_precision "high"). CUDA is faked: only the choice is made."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        for bf16, want in ((True, torch.bfloat16), (False, torch.float16)):
            monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **kw: bf16)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # autocast and GradScaler warn that this machine has no CUDA
                dtype = tg.setup_precision(torch.device("cuda"))[0]
            assert dtype == want and torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


# ----------------------------------------------------------------------------- optimizer and schedule


def test_optimizer_groups_follow_the_recipe():
    """Muon on exactly the 2-D hidden matrices, AdamW (betas 0.9, 0.95) on the rest; with AdamW alone, weight decay on
    the hidden matrices only, never on the embedding, norms or head."""
    for optimizer in ("muon", "adamw"):
        cfg = tg.Config(**{**TINY, "optimizer": optimizer})
        model = tg.build_model(cfg, 4353, CPU)
        opts = tg.build_optimizers(cfg, model)
        hidden = {id(p) for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")}
        if optimizer == "muon":
            assert isinstance(opts[0], tg.Muon) and {id(p) for p in opts[0].param_groups[0]["params"]} == hidden
        adamw = opts[-1]
        assert isinstance(adamw, torch.optim.AdamW) and all(g["betas"] == (0.9, 0.95) for g in adamw.param_groups)
        for g in adamw.param_groups:
            ids = {id(p) for p in g["params"]}
            assert (g["weight_decay"] == 0.1) == bool(ids & hidden) and (not ids & hidden or ids <= hidden)
            if id(model.wte.weight) in ids:
                assert g["weight_decay"] == 0.0


@pytest.mark.parametrize("script", [tg, tv, td])
def test_every_trainer_warms_up_linearly(script):
    """Each trainer's LR rises linearly over --warmup_steps, from peak / warmup_steps at the first step."""
    cfg = script.Config(warmup_steps=10)
    assert [script.lr_mult(cfg, s, 0.0) for s in (0, 1, 4, 9, 50)] == pytest.approx([0.1, 0.2, 0.5, 1.0, 1.0])


@pytest.mark.parametrize("script", [tg, tv, td])
def test_every_trainer_clips_at_its_grad_clip(script, tmp_path, monkeypatch):
    """Every optimizer step of each trainer clips the global grad norm at --grad_clip, 1.0 by default (bench.py's
    steps: the loop of a run, on random data)."""
    import bench
    seen, clip = [], script.clip_grads
    monkeypatch.setattr(script, "clip_grads", lambda params, max_norm: seen.append(max_norm) or clip(params, max_norm))
    common = "--steps=3 --device=cpu --compile=false --dtype=float32 --n_layer=1 --n_head=2 --n_embd=32".split()
    extra = {tg: ["--seq_len=16", "--vocab_size=257"], tv: ["--patch_size=8"], td: ["--patch_size=8"]}[script]
    r = bench.main([script.__file__, *common, "--batch_size=4", *extra])
    assert script.Config().grad_clip == 1.0 and seen == [1.0] * r["steps"] and r["steps"] == 6
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 3.0)  # a grad norm of 6
    assert clip([p], 1.0).item() == pytest.approx(6.0) and p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)


def test_tokens_auto_trains_20_tokens_per_parameter(corpus, tmp_path, capsys):
    """--tokens=auto: Chinchilla's 20 tokens per parameter sets the number of steps (the start line says it, and
    whether torch.compile is on). The run is stopped after its first step."""
    cfg = tiny(corpus, tmp_path / "o", tokens="auto")
    with faults.inject(tg, "sigterm@1"):
        assert tg.main(cfg)["preempted"]
    out = capsys.readouterr().out
    n_params = sum(p.numel() for p in tg.build_model(cfg, 257, CPU).parameters())
    assert f"| {math.ceil(20 * n_params / (4 * 32))} steps |" in out and "| compile False |" in out


def test_gpt2_presets_follow_the_2025_recipe():
    """The GPU presets: betas (0.9, 0.95), weight decay 0.1, cosine, clip 1.0, RMSNorm pre-norm, SwiGLU, RoPE, a global
    batch of 0.5M tokens (2^19, under 4-8M), 20 tokens per parameter. 350M on AdamW at lr 3e-4; 124M on Muon at the
    CPU recipe's lr 4e-3, which beat AdamW and nanoGPT at equal time on an H100 (BENCHMARKS.md, 2026-11-25)."""
    got = []
    for name in ("gpt2_124m", "gpt2_350m"):
        c = tg.parse_args(tg.Config, [f"--preset={name}"])
        assert (c.beta1, c.beta2, c.weight_decay, c.schedule, c.grad_clip) == (0.9, 0.95, 0.1, "cosine", 1.0)
        assert (c.norm, c.mlp, c.pos_emb, c.total_batch, c.tokens, c.dtype) == ("rmsnorm", "swiglu", "rope", 1 << 19,
                                                                               "auto", "auto")
        got.append((c.optimizer, c.lr))
    assert got == [("muon", 4e-3), ("adamw", 3e-4)]


def test_the_lr_follows_the_clock_and_every_log_line_has_it(corpus, tmp_path, monkeypatch):
    """With --time_budget the schedule follows the seconds of training, not the steps: the LR of step s is the one
    lr_mult gives at the training time logged after step s - 1. Each log line has the LR in force and the grad norm.
    The clock is faked (0.1 s a reading), so the steps are the same on any machine."""
    clock = [0.0]

    def now():
        clock[0] += 0.1
        return clock[0]
    monkeypatch.setattr(tg, "time", types.SimpleNamespace(perf_counter=now, strftime=time.strftime))
    cfg = tiny(corpus, tmp_path / "o", time_budget=1.0, warmup_steps=2)
    tg.main(cfg)
    rows = losses(tmp_path / "o")
    assert len(rows) > 3 and all(math.isfinite(r["gnorm"]) for _, r in rows)
    spent = 0.0
    for step, r in rows:
        assert r["lr"] == pytest.approx(cfg.lr * tg.lr_mult(cfg, step - 1, spent / 1.0), rel=1e-12), step
        spent = r["train_time"]
    assert rows[-1][1]["lr"] < 0.5 * cfg.lr  # the cosine decayed with the clock


def test_benchmark_leaves_out_the_warm_up_steps(tmp_path, monkeypatch):
    """bench.py times --steps steps after as many warm-up steps (compilation, the allocator): a first step that takes
    100 s (the clock is faked: 100 s for the first forward, 1 s for each after) does not show in the 1 s per step."""
    import bench
    clock, n = [0.0], [0]
    monkeypatch.setattr(tg, "time", types.SimpleNamespace(perf_counter=lambda: clock[0], strftime=time.strftime))

    def tick(model):
        n[0] += 1
        clock[0] += 100.0 if n[0] == 1 else 1.0
    training_forwards(monkeypatch, tick)
    flags = [f"--{k}={v}" for k, v in TINY.items() if k not in ("eval_every", "log_every")]
    r = bench.main([tg.__file__, "--steps=3", "--vocab_size=257", f"--out_dir={tmp_path}", *flags])
    assert r["steps"] == 6 and r["ms_per_step"] == pytest.approx(1000.0)


def test_accumulation_equals_one_big_batch(corpus, tmp_path):
    """--total_batch sets the micro-steps: a micro-batch of 4 with 2 micro-steps (each loss divided by 2, the grads
    synced once) trains as one batch of 8 does, step for step."""
    tg.main(tiny(corpus, tmp_path / "big", batch_size=8, max_steps=3))
    tg.main(tiny(corpus, tmp_path / "acc", batch_size=4, total_batch=8 * 32, max_steps=3))
    big, acc = losses(tmp_path / "big"), losses(tmp_path / "acc")
    assert json.loads((tmp_path / "acc" / "config.json").read_text())["grad_accum"] == 1  # the flag; 2 was derived
    assert [s for s, _ in acc] == [1, 2, 3]
    for (_, a), (_, b) in zip(big, acc):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["gnorm"] == pytest.approx(a["gnorm"], rel=1e-4)



@pytest.mark.parametrize("script", [tv, td])
def test_the_image_trainers_divide_the_loss_by_the_micro_steps(script, tmp_path):
    """--grad_accum in the ViT and the DiT: each micro-step's loss is divided by their number, so a step's loss (and
    its grads) is the mean over its micro-batches, not their sum. Read at the first step, where the ViT's zero head
    gives ln(classes) on any batch and the DiT's zero output the mean square of its target, near the same on any
    batch of 16: two micro-steps log what one does, where their sum would log twice as much."""
    splits = {"train": prepare_data.make_shapes(64, 16, 0), "val": prepare_data.make_shapes(40, 16, 1)}
    prepare_data.write_images(tmp_path / "data", splits, list(prepare_data.SHAPES), "shapes")
    tiny = dict(data_dir=str(tmp_path / "data"), n_layer=1, n_head=2, n_embd=32, patch_size=4, batch_size=16,
                max_steps=1, time_budget=0.0, log_every=1, device="cpu", compile="false", dtype="float32",
                eval_images=40)
    if script is td:
        tiny |= dict(sample_steps=2, per_class=1, eval_samples=10, final_samples=10)
    first = []
    for accum in (1, 2):
        script.main(script.Config(**tiny, grad_accum=accum, out_dir=str(tmp_path / f"accum{accum}")))
        first.append(losses(tmp_path / f"accum{accum}")[0][1]["loss"])
    assert first[1] == pytest.approx(first[0], rel=0.3 if script is td else 1e-5)  # DiT, measured: 0.70 and 0.81

def test_grads_are_freed_before_each_step(corpus, tmp_path, monkeypatch):
    """zero_grad(set_to_none=True): each step's forward runs with no gradient tensors held (zeroing them would keep
    one tensor of every parameter's size alive through the forward)."""
    held = []
    training_forwards(monkeypatch, lambda model: held.append(any(p.grad is not None for p in model.parameters())))
    tg.main(tiny(corpus, tmp_path / "o", max_steps=3))
    assert held == [False] * 3


# ----------------------------------------------------------------------------- data


def test_token_shards_are_memory_mapped(tmp_path):
    """Token files are memory-mapped, llm.c's shards and nanoGPT's raw .bin alike: the OS pages in what is read."""
    prepare_data.write_shard(tmp_path / "train_000000.bin", np.arange(1000))
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    for name in ("train_000000.bin", "train.bin"):
        s = tg.open_shard(str(tmp_path / name))
        assert isinstance(s, np.memmap) and s.dtype == np.uint16 and len(s) == 1000
    loader = tg.TokenLoader(tg.find_shards(str(tmp_path), "train"), 2, 16, 0, 1, CPU)
    assert all(isinstance(m, np.memmap) for m in loader.maps)


def test_batches_cross_to_the_gpu_pinned_and_non_blocking(tmp_path, monkeypatch):
    """On CUDA each batch is copied from pinned host memory with non_blocking=True, so the copy overlaps the GPU's
    work. CUDA is faked: pin_memory and the copy are recorded, not done."""
    prepare_data.write_shard(tmp_path / "train_000000.bin", np.arange(1000))
    loader = tg.TokenLoader(tg.find_shards(str(tmp_path), "train"), 2, 16, 0, 1, torch.device("cuda"))
    calls, to = [], torch.Tensor.to

    def fake_to(t, *args, **kw):
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            calls.append(("copy", kw.get("non_blocking", False)))
            return t
        return to(t, *args, **kw)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: calls.append("pin") or t)
    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    x, y = loader.next()
    monkeypatch.undo()
    assert calls == ["pin", ("copy", True)] and x.shape == y.shape == (2, 16)


def test_the_next_batch_is_read_before_the_backward(corpus, tmp_path, monkeypatch):
    """The loop reads each micro-step's next batch after its forward and before its backward, while the GPU works
    through the queued kernels: the copy overlaps compute. 3 steps of 2 micro-steps."""
    events, next_, backward = [], tg.TokenLoader.next, torch.Tensor.backward

    def recorded(t, *a, **kw):
        events.append("backward")
        return backward(t, *a, **kw)
    monkeypatch.setattr(tg.TokenLoader, "next", lambda self, *a: events.append("next") or next_(self, *a))
    monkeypatch.setattr(torch.Tensor, "backward", recorded)
    training_forwards(monkeypatch, lambda model: events.append("forward"))
    tg.main(tiny(corpus, tmp_path / "o", max_steps=3, grad_accum=2))
    last = len(events) - events[::-1].index("backward")  # the final eval's reads come after
    assert events[:last] == ["next"] + ["forward", "next", "backward"] * 6


# ----------------------------------------------------------------------------- checkpoints and wrapping


def test_async_save_lets_training_go_on_while_it_writes(corpus, tmp_path, monkeypatch):
    """--async_save: the checkpoint of step 2 is written in a thread while step 3 trains. Its write waits here until
    step 3's forward has begun, which a blocking save would never let happen (it would time out and fail)."""
    events, stepped, save, n = [], threading.Event(), torch.save, [0]

    def slow_save(obj, f, *a, **kw):
        if isinstance(obj, dict) and obj.get("step") == 2:
            stepped.wait(60)
            events.append("step 2 written")
        return save(obj, f, *a, **kw)

    def forward(model):
        n[0] += 1
        if n[0] == 3:
            events.append("step 3 forward")
            stepped.set()
    monkeypatch.setattr(torch, "save", slow_save)
    training_forwards(monkeypatch, forward)
    tg.main(tiny(corpus, tmp_path / "o", max_steps=4, save_every=2, async_save=True))
    assert events == ["step 3 forward", "step 2 written"]
    assert [s for s, _ in tg.list_checkpoints(str(tmp_path / "o"))] == [2, 4]


def test_the_newest_checkpoints_and_milestones_are_kept(corpus, tmp_path):
    """Two levels of checkpoints: the newest --keep_last, and every multiple of --milestone_every, kept for good."""
    tg.main(tiny(corpus, tmp_path / "o", max_steps=7, save_every=1, keep_last=2, milestone_every=3))
    assert [s for s, _ in tg.list_checkpoints(str(tmp_path / "o"))] == [3, 6, 7]


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank in this process, so wrap_model's DDP and FSDP2 paths can be built."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_by_default_and_fsdp2_a_block_at_a_time(one_rank_group, monkeypatch):
    """Under torchrun the model is in DDP by default, whose all-reduce runs bucket by bucket during the backward,
    overlapping it; --parallel=fsdp shards each block on its own (so FSDP2 can prefetch the next block's weights) and
    then the root, averaging gradients in fp32."""
    from torch.distributed import fsdp
    cfg = tg.Config(**TINY)
    assert cfg.parallel == "ddp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DDP's broadcast_buffers deprecation
        model, _ = tg.wrap_model(tg.build_model(cfg, 257, CPU), cfg, CPU, torch.float32, 2)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel) and model.bucket_bytes_cap > 0
    sharded, shard, meshes, mesh = [], fsdp.fully_shard, [], dist.init_device_mesh
    monkeypatch.setattr(fsdp, "fully_shard", lambda m, **kw: sharded.append((m, kw["mp_policy"])) or shard(m, **kw))
    # the mesh is the run's device: FSDP2's default is CUDA's wherever CUDA exists, so on an H100 machine two
    # --device=cpu ranks failed ('CUDA error: invalid device ordinal' on rank 1); here one rank stands in for two
    monkeypatch.setattr(dist, "init_device_mesh", lambda kind, shape: meshes.append((kind, shape)) or mesh(kind, (1,)))
    cfg = tg.Config(**{**TINY, "parallel": "fsdp"})
    raw = tg.build_model(cfg, 257, CPU)
    model, _ = tg.wrap_model(raw, cfg, CPU, torch.bfloat16, 2)
    assert [m for m, _ in sharded] == [*raw.blocks, raw] and model is raw and meshes == [("cpu", (2,))]
    assert all(p.param_dtype == torch.bfloat16 and p.reduce_dtype == torch.float32 for _, p in sharded)
    idx = torch.randint(0, 257, (2, 9))
    model(idx[:, :-1], idx[:, 1:]).backward()  # it trains
    IMAGES = {"num_classes": 3, "image_size": [8, 8], "channels": 3, "mean": [0.5] * 3, "std": [0.25] * 3}
    for mod, make in ((tv, lambda c: tv.build_model(c, IMAGES, CPU)),
                      (td, lambda c: td.build_model(c, 8, 3, 3, CPU))):  # the image trainers shard alike
        meshes.clear()
        c = mod.Config(n_layer=1, n_head=2, n_embd=32, patch_size=4, device="cpu", compile="false", parallel="fsdp")
        mod.wrap_model(make(c), c, CPU, torch.bfloat16, 2)
        assert meshes == [("cpu", (2,))], mod.__name__


def test_compile_is_on_for_cuda_and_wraps_the_model():
    """--compile=auto compiles on CUDA (on Linux) and not on a CPU; the compiled module wraps raw, whose state dict
    stays free of _orig_mod. prefixes."""
    for compile_, device, want in (("auto", torch.device("cuda"), True), ("auto", CPU, False), ("true", CPU, True)):
        cfg = tg.Config(**{**TINY, "compile": compile_})
        raw = tg.build_model(cfg, 257, CPU)
        model, compiled = tg.wrap_model(raw, cfg, device, torch.float32, 1)
        assert compiled == (want and (device.type == "cpu" or sys.platform == "linux"))
        assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule) == compiled
        assert not any(k.startswith("_orig_mod.") for k in raw.state_dict())


def test_expandable_segments_are_asked_for_before_cuda_starts(monkeypatch):
    """setup_dist, the first thing a run does, sets PYTORCH_ALLOC_CONF=expandable_segments:True unless the user set
    the allocator's config: the allocator reads it at the first CUDA allocation."""
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "RANK"):
        monkeypatch.setenv(var, "x")  # then deleted: the test leaves the environment as it found it
        monkeypatch.delenv(var)
    assert tg.setup_dist("cpu") == (0, 1, CPU)
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "backend:native")
    tg.setup_dist("cpu")
    assert os.environ["PYTORCH_ALLOC_CONF"] == "backend:native"


# ----------------------------------------------------------------------------- images and scaling


def test_predict_sees_an_image_as_training_did(tmp_path):
    """predict_vit.py reads a PNG as prepare_data.py stored it and the model normalises it as in training (the data's mean
    and std live in the model): its probabilities are the model's on the stored image."""
    from PIL import Image
    splits = {"train": prepare_data.make_shapes(64, 16, 0), "val": prepare_data.make_shapes(8, 16, 1)}
    prepare_data.write_images(tmp_path / "data", splits, list(prepare_data.SHAPES), "shapes")
    out = tmp_path / "run"
    tv.main(tv.Config(data_dir=str(tmp_path / "data"), out_dir=str(out), n_layer=1, n_head=2, n_embd=32, patch_size=4,
                      batch_size=16, max_steps=2, time_budget=0.0, ema=0.0, device="cpu", compile="false",
                      dtype="float32", warmup_steps=1))
    image = splits["val"][0][0]
    Image.fromarray(image).save(tmp_path / "x.png")
    probs = pv.main(pv.Config(images=str(tmp_path / "x.png"), ckpt=str(out), device="cpu", show=10))
    probs = probs[str(tmp_path / "x.png")]
    ckpt, _ = tv.load_checkpoint(str(out))
    known = {k: v for k, v in ckpt["config"].items() if k in tv.Config.__dataclass_fields__}
    model = tv.build_model(tv.Config(**known), ckpt["data_meta"], CPU)
    model.load_state_dict(ckpt["model"])
    with torch.no_grad():
        want = model.eval()(torch.from_numpy(image)[None].float() / 255).softmax(-1)[0]
    names = list(prepare_data.SHAPES)
    assert len(probs) == 10 and all(p == pytest.approx(want[names.index(c)].item(), abs=1e-6) for c, p in probs.items())


def test_the_scaling_ladder_grows_depth_with_width():
    """The models of a sweep grow deeper as they grow wider, from 1 layer to 12, never shallower."""
    depths, widths = zip(*sc.LADDER)  # smallest model first
    assert list(widths) == sorted(widths) and list(depths) == sorted(depths) and (depths[0], depths[-1]) == (1, 12)
