"""docs/map.md's rule, checked: a row is "done" only if the test in its last column fails when the practice is taken
out of the code. For each done row this file holds a removal: an exact snippet of one file, and the text that takes
the practice out (the clip made a no-op, the GradScaler's scale call dropped, QK-norm's normalisation skipped), with
the tests the row names. The runner copies the repository (its files as they stand, tracked or not ignored) to a
temporary directory, applies one removal at a time there, runs the row's tests, and prints a line per removal:

    caught       a named test failed, on an assertion (not at import or collection)
    NOT CAUGHT   every named test passed with the practice gone: the row overstates
    broken       pytest could not run the tests (exit 2-5), or they died of a SyntaxError, ImportError or NameError:
                 the removal broke the file, not the practice; fix the removal
    stale        the snippet is no longer in the file (exactly once): the code moved on; rewrite the removal
    skipped      every named test skipped itself on this machine (a GPU test, no Triton interpreter): not checked

Run it from the repository's root (it is not a test: pytest does not collect it):

    python tests/map_removals.py              # every removal (slow: a pytest run each)
    python tests/map_removals.py 122 226      # the removals of those rows
    python tests/map_removals.py --stale      # only check that every snippet is still where it was (no tests run)
    python tests/map_removals.py --baseline   # run each removal's tests on the unmodified code: they must pass

It exits 1 if any removal is not caught, broken or stale. What it proves: that for each row, the one removal written
here is caught; a test can still miss another way of breaking the same practice.
"""
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Removal:
    row: int      # the row of docs/map.md
    file: str     # relative to the repository's root
    old: str      # an exact snippet of file, found exactly once
    new: str      # what replaces it: the code without the practice
    tests: tuple  # the node ids the row names


# The tests rows name, by the short names used below.
P = "tests/test_practices.py::"
GPT = "tests/test_train_gpt.py::"
VIT = "tests/test_train_vit.py::"
K = "tests/test_kernels.py::"
SC = "tests/test_scaling.py::"
FT = "tests/test_finetune.py::"

REMOVALS = []



def R(row, file, old, new, *tests):
    """A removal: rows that share a practice share one; a row whose practice is in several scripts has one a script."""
    REMOVALS.append(Removal(row, file, old, new, tests))


G = "train_gpt.py"
KP = "kernels.py"

# --- attention
FUSED = (KP, "        return _attn_torch(q, k, v, causal, scale, window)\n",
         "        return attention_ref(q, k, v, causal, scale, window)  # the scores materialised\n")
for row in (3, 96, 139, 140, 141, 182, 305):
    R(row, *FUSED, P + "test_attention_is_fused_and_keeps_no_t_by_t_scores", K + "test_auto_takes_each_ops_faster_path")
R(5, KP, "    return _attn_op(q, k, v, causal, float(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])))[0]",
  "    return attention_ref(q, k, v, causal, scale)  # autograd keeps the (T, T) probabilities",
  P + "test_attention_is_fused_and_keeps_no_t_by_t_scores")
R(9, KP, "        keep = cols[None, :] < T\n", "        keep = cols[None, :] >= 0  # keys past T count\n",
  K + "test_attention_triton")
R(180, *FUSED, P + "test_attention_is_fused_and_keeps_no_t_by_t_scores", GPT + "test_kv_cache_matches_full_forward")
R(242, *FUSED, P + "test_gpt2_presets_follow_the_2025_recipe", P + "test_attention_is_fused_and_keeps_no_t_by_t_scores")
R(242, G, '    norm="rmsnorm",\n    value_embeds', "    value_embeds", P + "test_gpt2_presets_follow_the_2025_recipe",
  P + "test_attention_is_fused_and_keeps_no_t_by_t_scores")
R(181, G, '    norm="rmsnorm",\n    value_embeds', "    value_embeds", P + "test_gpt2_presets_follow_the_2025_recipe",
  K + "test_rms_norm_triton")
R(252, G, "        q = self.q_norm(q)\n        k = self.k_norm(k)\n", "",
  P + "test_qk_norm_makes_attention_blind_to_the_size_of_q_and_k")
R(55, G, "        self.scale = 1 / math.sqrt(hd * width_mult(cfg))", "        self.scale = 1.0",
  FT + "test_gpt2_logits_match_the_reference", SC + "test_mup_scales_init_lr_and_attention_with_width")
GQA = (G, "        self.n_kv = cfg.n_kv_head or cfg.n_head\n", "        self.n_kv = cfg.n_head\n")
for row in (115, 116, 161, 162):
    R(row, *GQA, P + "test_gqa_shares_key_value_heads_and_shrinks_the_cache")
R(118, G, "    return (xf * cos + rolled * sin).type_as(x)", "    return x",
  P + "test_rope_scores_depend_only_on_the_distance")
R(142, G, "    return (xf * cos + rolled * sin).type_as(x)", "    return x",
  P + "test_rope_scores_depend_only_on_the_distance")
R(143, G, "    freqs = torch.outer(torch.arange(seq_len, **f32), inv_freq)",
  "    freqs = torch.outer(torch.ones(seq_len, **f32), inv_freq)  # one angle at every position",
  P + "test_rope_scores_depend_only_on_the_distance")

# --- the model
ZERO_INIT = (G, "                nn.init.zeros_(p)\n", "                nn.init.normal_(p, std=c.init_std)\n")
R(56, *ZERO_INIT, P + "test_blocks_start_as_the_identity", GPT + "test_model_shapes_and_initial_loss")
R(253, *ZERO_INIT, P + "test_blocks_start_as_the_identity")
R(87, G, "        x = x + self.attn(self.norm1(x), cos, sin, cache, ve)",
  "        x = self.attn(self.norm1(x), cos, sin, cache, ve)  # no skip", P + "test_blocks_start_as_the_identity")
R(110, G, "        x = x + self.attn(self.norm1(x), cos, sin, cache, ve)",
  "        x = self.norm1(x + self.attn(x, cos, sin, cache, ve))  # post-norm", P + "test_blocks_start_as_the_identity")
NORMS = P + "test_norm_gains_start_at_one_biases_at_zero_and_no_batchnorm"
for row in (80, 99):
    R(row, G, '                nn.init.constant_(p, 0.0 if name.endswith("bias") else 1.0)',
      '                nn.init.constant_(p, 0.0 if name.endswith("bias") else 0.5)', NORMS)
R(81, G, '                nn.init.constant_(p, 0.0 if name.endswith("bias") else 1.0)',
  '                nn.init.constant_(p, 0.1 if name.endswith("bias") else 1.0)', NORMS)
R(76, G, "        self.norm2 = Norm(cfg.n_embd, cfg)\n", "        self.norm2 = nn.BatchNorm1d(cfg.n_embd, affine=False)\n",
  NORMS)
R(130, G, "    bias: bool = False  #", "    bias: bool = True  #", NORMS)
R(117, G, '    mlp: Literal["swiglu", "relu2", "gelu"] = "swiglu"',
  '    mlp: Literal["swiglu", "relu2", "gelu"] = "gelu"',
  P + "test_swiglu_is_a_silu_gate_and_the_default")
R(145, G, "            h = F.silu(a) * b\n", "            h = F.silu(a + b)  # no gate\n",
  P + "test_swiglu_is_a_silu_gate_and_the_default")
R(146, G, "            h = F.silu(a) * b\n", "            h = F.gelu(a) * b  # not SiLU\n",
  P + "test_swiglu_is_a_silu_gate_and_the_default")
R(147, G, '    mlp: Literal["swiglu", "relu2", "gelu"] = "swiglu"',
  '    mlp: Literal["swiglu", "relu2", "gelu"] = "relu2"',
  P + "test_swiglu_is_a_silu_gate_and_the_default")
TIED = (G, "        self.head = None if cfg.tie_embeddings else nn.Linear(d, rows, bias=False)",
        "        self.head = nn.Linear(d, rows, bias=False)")
for row in (167, 168):
    R(row, *TIED, P + "test_tied_embeddings_share_one_matrix")
PAD = (G, "        rows = 64 * math.ceil(vocab_size / 64)\n", "        rows = vocab_size\n")
for row in (52, 208, 260):
    R(row, *PAD, "tests/test_real_sizes.py::test_gpt2_loss_at_its_real_vocabulary_is_its_own")
R(124, G, "        out = kernels.linear_cross_entropy(x[keep], w, y[keep], softcap=cap, z_loss=z_loss,",
  "        out = kernels.linear_cross_entropy(x[keep], w, y[keep], softcap=cap, z_loss=0.0,",
  P + "test_z_loss_and_softcap_reach_the_loss")
R(251, G, "        cap = self.cfg.logit_softcap or None\n", "        cap = None  # the loss ignores the cap\n",
  P + "test_z_loss_and_softcap_reach_the_loss")
R(200, G, "    torch.manual_seed(cfg.seed)\n    model.init_weights()", "    model.init_weights()",
  P + "test_the_seed_sets_the_init")
META = (G, '    with torch.device("meta"):\n        model = cls(cfg, vocab_size)',
        '    with torch.device("cpu"):\n        model = cls(cfg, vocab_size)')
for row in (229, 234):
    R(row, *META, P + "test_models_are_built_on_the_meta_device")
CKPT = (G, "            return recompute(self.sublayers, x, cos, sin, cache, ve, use_reentrant=False)",
        "            return self.sublayers(x, cos, sin, cache, ve)")
for row in (148, 171, 183, 235):
    R(row, *CKPT, P + "test_activation_checkpointing_keeps_less_for_the_backward")
WIDTH = (G, "    return cfg.n_embd / cfg.base_width if cfg.mup else 1.0", "    return 1.0")
R(120, *WIDTH, SC + "test_coord_check_flat_under_mup_drifts_under_standard",
  SC + "test_mup_scales_init_lr_and_attention_with_width")
R(295, *WIDTH, SC + "test_coord_check_flat_under_mup_drifts_under_standard")
R(294, G, "        lr = cfg.lr / width_mult(cfg)\n", "        lr = cfg.lr\n",
  SC + "test_mup_scales_init_lr_and_attention_with_width")

# --- the presets
PRESET = P + "test_gpt2_presets_follow_the_2025_recipe"
BATCH = (G, "    total_batch=1 << 19,  # 0.5M tokens a step, GPT-3's batch at this size", "    total_batch=0,")
R(121, *BATCH, PRESET)
R(309, *BATCH, PRESET)
R(241, G, 'optimizer="adamw", lr=3e-4,', 'optimizer="adamw", lr=6e-4,', PRESET)
R(247, G, "    lr=4e-3,  # Muon's, which beat AdamW at 124M (BENCHMARKS.md)\n", "", PRESET)
R(129, G, "    beta2: float = 0.95  #", "    beta2: float = 0.999  #", P + "test_optimizer_groups_follow_the_recipe")

# --- optimizer and schedule
R(211, G, '    if cfg.optimizer == "muon":\n        # muP: Muon', '    if False:\n        # muP: Muon',
  P + "test_optimizer_groups_follow_the_recipe", GPT + "test_muon_matches_torch_muon_in_bf16")
R(215, G, '        if p.ndim == 2 and n.startswith("blocks."):  # a matrix inside a block',
  "        if p.ndim == 2:  # every matrix, the embedding too", P + "test_optimizer_groups_follow_the_recipe")
R(213, G, "        embed = [dict(params=params, lr=embed_lr, weight_decay=0.0)]",
  "        embed = [dict(params=params, weight_decay=0.0)]  # the group's LR: --lr",
  GPT + "test_embed_lr_gives_the_embedding_its_own_group")
R(108, G, '                bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in ps]\n'
  "                g = torch.stack([p.grad for p in ps])  # (n, rows, cols)\n                b = torch.stack(bufs)",
  '                bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p, dtype=torch.bfloat16))'
  " for p in ps]\n                g = torch.stack([p.grad for p in ps])  # (n, rows, cols)\n"
  "                b = torch.stack(bufs).float()",
  P + "test_weights_grads_and_optimizer_state_stay_fp32_under_autocast")
COSINE = (G, "        return warm * (f + (1 - f) * 0.5 * (1 + math.cos(math.pi * p)))", "        return warm")
for row in (63, 219, 293):
    R(row, *COSINE, GPT + "test_lr_schedules")
R(86, G, "    f = cfg.final_lr_frac\n", "    f = 0.0\n", GPT + "test_lr_schedules")
R(223, G, "    f = cfg.final_lr_frac\n", "    f = 0.0\n", GPT + "test_lr_schedules")
R(220, G, '    if cfg.schedule == "wsd" and p >= 1 - cfg.cooldown_frac:', "    if False:", GPT + "test_lr_schedules")
WARM = ("        warm = min(1.0, (step + 1) / cfg.warmup_steps)\n", "        warm = 1.0\n")
R(68, G, *WARM, P + "test_every_trainer_warms_up_linearly", GPT + "test_lr_schedules")
R(68, "train_vit.py", *WARM, P + "test_every_trainer_warms_up_linearly")
R(68, "train_diffusion.py", "    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0",
  "    warm = 1.0", P + "test_every_trainer_warms_up_linearly")
CLOCK = (G, "            progress = (train_time + len(trace) * step_time) / time_budget\n",
         "            progress = 0.0  # the LR ignores the clock\n")
R(209, *CLOCK, P + "test_the_lr_follows_the_clock_and_every_log_line_has_it", GPT + "test_time_budget_and_token_budget")
R(218, *CLOCK, P + "test_the_lr_follows_the_clock_and_every_log_line_has_it")
LOGGED_LR = (G, "loss=lossf, lr=cfg.lr * mult, gnorm=gnormf)", "loss=lossf, lr=cfg.lr, gnorm=gnormf)")
R(264, *LOGGED_LR, P + "test_the_lr_follows_the_clock_and_every_log_line_has_it")
R(274, *LOGGED_LR, P + "test_the_lr_follows_the_clock_and_every_log_line_has_it")
R(271, G, "        self.record(step=step, loss=loss, lr=lr, gnorm=gnorm, ms=dt * 1e3,",
  "        self.record(step=step, loss=loss, lr=lr, ms=dt * 1e3,",
  P + "test_the_lr_follows_the_clock_and_every_log_line_has_it",
  GPT + "test_guard_flags_nonfinite_spikes_and_asks_for_rollback")
R(271, G, "        verdict = torch.where(spike[1], GNORM_SPIKE, GOOD)",
  "        verdict = torch.where(spike[1], GOOD, GOOD)",
  P + "test_the_lr_follows_the_clock_and_every_log_line_has_it",
  GPT + "test_guard_flags_nonfinite_spikes_and_asks_for_rollback")

# --- clipping (a no-op clip, and a loop that stops asking for one)
CLIP_CALL = (G, "        gnorm = clip_grads(raw.parameters(), guard.clip(cfg.grad_clip))",
             '        gnorm = clip_grads(raw.parameters(), float("inf"))  # no clip')
NOOP_CLIP = (G, "    torch._foreach_mul_(grads, scale)\n", "")
EVERY_CLIP = P + "test_every_trainer_clips_at_its_grad_clip"
for row in (90, 102, 207, 249):
    R(row, *CLIP_CALL, EVERY_CLIP)
    R(row, *NOOP_CLIP, EVERY_CLIP)
R(119, *CLIP_CALL, EVERY_CLIP)
for script in ("train_vit.py", "train_diffusion.py"):
    R(119, script, CLIP_CALL[1], CLIP_CALL[2], EVERY_CLIP)

# --- the guard
GUARD = GPT + "test_guard_flags_nonfinite_spikes_and_asks_for_rollback"
R(101, G, "        spike = (self.sigma > 0) & (n >= 10) & (v > mean + self.sigma * std)",
  "        spike = torch.zeros_like(v, dtype=torch.bool)  # never a spike", GUARD)
R(104, G, "        verdict = torch.where(spike[1], GNORM_SPIKE, GOOD)",
  "        verdict = torch.where(spike[1], GOOD, GOOD)",
  GUARD)
R(131, G, "        verdict = torch.where(spike[0], LOSS_SPIKE, verdict)",
  "        verdict = torch.where(spike[0], verdict, verdict)", GUARD)
R(113, G, "        if not self.clip_mult:\n            return limit", "        if True:\n            return limit",
  GUARD)
R(114, G, "        verdict = torch.where(v.isfinite().all(), verdict, nonfinite)\n", "",
  GPT + "test_injected_nan_is_skipped_and_training_continues")
ROLLBACK = GPT + "test_repeated_spikes_roll_back_and_skip_the_data"
R(67, G, "        if reason and guard.rollback_due():", "        if False:", ROLLBACK)
R(127, G, "        if reason and guard.rollback_due():", "        if False:", ROLLBACK)
R(126, G, "                first = step  # the batches read since are skipped, not read again",
  '                first = step\n                train_loader.load_state(ckpt["data"])  # read them again', ROLLBACK)

# --- precision
MIXED = (G, "        ctx = torch.autocast(device.type, dtype=dtype)\n", "        ctx = contextlib.nullcontext()\n")
for row in (49, 132, 188, 291):
    R(row, *MIXED, GPT + "test_auto_precision_on_a_cpu_is_fp32_whatever_the_load")
R(134, G, '        dtype_arg = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"',
  '        dtype_arg = "float32"',
  GPT + "test_auto_precision_on_a_cpu_is_fp32_whatever_the_load",
  P + "test_gpu_precision_is_bf16_else_fp16_and_tf32_for_the_rest")
BF16 = (G, '        dtype_arg = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"',
  '        dtype_arg = "float16"')
GPU_PREC = P + "test_gpu_precision_is_bf16_else_fp16_and_tf32_for_the_rest"
R(175, *BF16, GPU_PREC)
R(225, *BF16, GPU_PREC)
TF32 = (G, '        torch.set_float32_matmul_precision("high")  # TF32 for what stays fp32', "        pass")
R(201, *TF32, GPU_PREC)
R(256, *TF32, GPU_PREC)
FP16 = P + "test_fp16_has_a_loss_scaler_that_doubles_every_2000_steps"
NO_SCALER = (G, "    scaler = torch.amp.GradScaler(device.type, enabled=fp16, growth_interval=2000)",
             "    scaler = torch.amp.GradScaler(device.type, enabled=False, growth_interval=2000)")
for row in (106, 109, 135):
    R(row, *NO_SCALER, FP16)
R(226, G, "                scaler.scale(micro_loss).backward()", "                micro_loss.backward()", FP16,
  P + "test_an_fp16_step_scales_the_loss_and_unscales_the_grads")
R(107, G, "    model.to_empty(device=device)\n", "    model.to_empty(device=device).to(torch.bfloat16)\n",
  P + "test_weights_grads_and_optimizer_state_stay_fp32_under_autocast")
R(133, G, "    model.to_empty(device=device)\n", "    model.to_empty(device=device).to(torch.bfloat16)\n",
  P + "test_weights_grads_and_optimizer_state_stay_fp32_under_autocast")
R(123, G, "        precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)",
  "        precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)",
  P + "test_ddp_by_default_and_fsdp2_a_block_at_a_time", K + "test_rms_norm_and_losses_gpu_low_precision")

# --- accumulation
ACC = P + "test_accumulation_equals_one_big_batch"
DIVIDE = (G, "                    micro_loss = model(x, y, cfg.z_loss) / accum  #",
          "                    micro_loss = model(x, y, cfg.z_loss)  #")
R(203, *DIVIDE, ACC)
R(254, *DIVIDE, ACC)
R(254, "train_vit.py", "                    micro_loss = micro_loss / accum  #",
  "                    micro_loss = micro_loss  #",
  P + "test_the_image_trainers_divide_the_loss_by_the_micro_steps")
R(254, "train_diffusion.py", "ctx) / accum\n", "ctx)\n",
  P + "test_the_image_trainers_divide_the_loss_by_the_micro_steps")
FROM_TOTAL = (G, "    accum = cfg.total_batch // (B * T * world_size) if cfg.total_batch else cfg.grad_accum\n",
              "    accum = cfg.grad_accum\n")
R(156, *FROM_TOTAL, ACC)
R(202, *FROM_TOTAL, ACC)
NO_ACC = (G, "        for micro in range(accum):\n",
  "        for micro in range(accum):\n            raw.zero_grad(set_to_none=True)"
          "  # each micro-step's grads replace the last's\n")
R(155, *NO_ACC, ACC, GPT + "test_two_ranks_match_one_process")
for row in (172, 189, 292):
    R(row, *NO_ACC, ACC)
R(204, G, "            opt.zero_grad(set_to_none=True)", "            opt.zero_grad(set_to_none=False)",
  P + "test_grads_are_freed_before_each_step")
R(233, G, "            opt.zero_grad(set_to_none=True)", "            opt.zero_grad(set_to_none=False)",
  P + "test_grads_are_freed_before_each_step")
R(93, G, '    n_tokens = 20 * n_params if cfg.tokens == "auto" else float(cfg.tokens or 0)',
  '    n_tokens = 10 * n_params if cfg.tokens == "auto" else float(cfg.tokens or 0)  # 10, not 20',
  P + "test_tokens_auto_trains_20_tokens_per_parameter")
R(197, G, '    n_tokens = 20 * n_params if cfg.tokens == "auto" else float(cfg.tokens or 0)',
  '    n_tokens = 10 * n_params if cfg.tokens == "auto" else float(cfg.tokens or 0)  # 10, not 20',
  P + "test_tokens_auto_trains_20_tokens_per_parameter")
R(255, G, 'f"compile {compiled} | kernels', 'f"kernels', P + "test_tokens_auto_trains_20_tokens_per_parameter")
R(159, G, "    if step >= cfg.seq_len_warmup:\n        return cfg.seq_len", "    if True:\n        return cfg.seq_len",
  GPT + "test_seq_len_warmup_keeps_tokens_per_step_and_resumes_exactly")
R(184, G, "    if step >= cfg.seq_len_warmup:\n        return cfg.seq_len", "    if True:\n        return cfg.seq_len",
  GPT + "test_seq_len_warmup_keeps_tokens_per_step_and_resumes_exactly")
R(60, G, "            opt.step(skip=verdict != GOOD)", "            pass  # no update",
  GPT + "test_loss_falls_and_run_writes_its_files")

# --- data
R(22, G, "        return np.memmap(path, dtype=np.uint16, mode=\"r\", offset=HEADER_BYTES, shape=(n,))",
  "        return np.fromfile(path, dtype=np.uint16, offset=HEADER_BYTES, count=n)",
  P + "test_token_shards_are_memory_mapped")
PIN = (G, "            buf = buf.pin_memory().to(self.device, non_blocking=True)",
  "            buf = buf.to(self.device)")
R(24, *PIN, P + "test_batches_cross_to_the_gpu_pinned_and_non_blocking")
R(257, *PIN, P + "test_batches_cross_to_the_gpu_pinned_and_non_blocking")
R(28, G,
  "                at = train_loader.state()\n                x, y = train_loader.next(seq_len_at(cfg, next_step))"
  "  # (B', T') tokens, their next tokens\n                scaler.scale(micro_loss).backward()\n",
  "                scaler.scale(micro_loss).backward()\n                at = train_loader.state()\n"
  "                x, y = train_loader.next(seq_len_at(cfg, next_step))\n",
  P + "test_the_next_batch_is_read_before_the_backward")
R(269, "train_vit.py", "            self.order = torch.randperm(n, generator=g).to(self.y.device)",
  "            self.order = torch.arange(n).to(self.y.device)  # no shuffle",
  VIT + "test_loader_ranks_partition_the_global_batch_and_resume",
  GPT + "test_loader_ranks_partition_the_global_batch_and_resume")
R(269, G, "        self.order = rng.permutation(rows)", "        self.order = np.arange(rows)  # no shuffle",
  VIT + "test_loader_ranks_partition_the_global_batch_and_resume",
  GPT + "test_loader_ranks_partition_the_global_batch_and_resume")

# --- checkpoints
R(15, G,
  '    set_state_dict(model, opts, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"], options=options)',
  '    set_model_state_dict(model, ckpt["model"], options=options)  # the optimizers start afresh',
  GPT + "test_resume_is_exact")
R(16, G, "            self.pending = ThreadPoolExecutor(1).submit(write_checkpoint, *args)",
  "            write_checkpoint(*args)",
  P + "test_async_save_lets_training_go_on_while_it_writes")
R(17, G, "        prune(out_dir, lambda s: s not in newest and not (milestone_every and s % milestone_every == 0))",
  "        prune(out_dir, lambda s: s not in newest)", P + "test_the_newest_checkpoints_and_milestones_are_kept")
R(154, G, '    sharded = world_size > 1 and cfg.parallel == "fsdp"  # a folder of shards', "    sharded = False",
  GPT + "test_sharded_checkpoints_resume_on_other_ranks_fall_back_and_consolidate")

# --- system
R(18, G, "        model = torch.compile(raw)\n", "        model = raw\n",
  P + "test_compile_is_on_for_cuda_and_wraps_the_model",
  K + "test_auto_takes_each_ops_faster_path")
R(297, G, "        model = torch.compile(raw)\n", "        model = raw\n",
  P + "test_compile_is_on_for_cuda_and_wraps_the_model")
R(51, KP,
  "    if not _use_triton(x, auto=not torch.compiler.is_compiling()):\n        return _rms_torch(x, weight, eps)",
  "    if True:\n        return _rms_torch(x, weight, eps)", K + "test_auto_takes_each_ops_faster_path",
  P + "test_compile_is_on_for_cuda_and_wraps_the_model")
R(20, KP,
  "    if not _use_triton(x, auto=not torch.compiler.is_compiling()):\n        return _rms_torch(x, weight, eps)",
  "    if True:\n        return _rms_torch(x, weight, eps)", K + "test_dispatch_reads_env_at_call_time")
R(298, KP, "    if not _use_triton(logits):\n        return _ce_torch(", "    if True:\n        return _ce_torch(",
  K + "test_dispatch_reads_env_at_call_time")
DDP = (G, "        model = nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)",
       "        pass  # no DDP")
WRAP = P + "test_ddp_by_default_and_fsdp2_a_block_at_a_time"
R(38, *DDP, WRAP)
R(39, G, "device_ids=ids, broadcast_buffers=False)", "device_ids=ids, broadcast_buffers=False, bucket_cap_mb=0)", WRAP)
R(71, G, '    parallel: Literal["ddp", "fsdp"] = "ddp"', '    parallel: Literal["ddp", "fsdp"] = "fsdp"', WRAP)
NO_FSDP = (G, '    if world_size > 1 and cfg.parallel == "fsdp":\n        # FSDP2', "    if False:\n        # FSDP2")
TWO = GPT + "test_two_ranks_match_one_process"
for row in (47, 153, 174, 303):  # the two-rank run alone trains the same unsharded: it passed without FSDP
    R(row, *NO_FSDP, WRAP, TWO)
R(300, G, '    if "RANK" not in os.environ:\n        return 0, 1, torch.device(device_arg)',
  "    if True:\n        return 0, 1, torch.device(device_arg)", TWO)
EXPAND = (G, '        os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")', "        pass")
R(224, *EXPAND, P + "test_expandable_segments_are_asked_for_before_cuda_starts")
R(232, *EXPAND, P + "test_expandable_segments_are_asked_for_before_cuda_starts")

# --- monitoring
R(112, G, '        stats["grad_ratio"] = torch.stack(ratios).tolist()\n', "", GPT + "test_monitoring_in_metrics")
R(111, G, '    rec = {"val_loss": loss, "val_ppl": math.exp(min(loss, 50))}',
  '    rec = {"val_loss": loss, "val_ppl": loss}',
  GPT + "test_monitoring_in_metrics")

# --- fine-tuning, distillation, quantization (finetune_gpt.py)
F_ = "finetune_gpt.py"
R(59, F_, '    if "model" in init:\n        raw.load_state_dict(init["model"])\n', "",
  FT + "test_init_from_checkpoint_starts_where_it_ended",
  "tests/test_real_sizes.py::test_fine_tuning_lora_distillation_and_export_start_from_gpt2s_loss")
R(136, F_, '                if is_hidden(k, v):\n                    q, out[k + "_scale"] = quantize(v.float())\n'
  "                    out[k] = q.to(torch.int8)", "                pass  # kept in float",
  FT + "test_export_int8_keeps_the_loss_and_samples")
R(138, F_, '                if is_hidden(k, v):\n                    q, out[k + "_scale"]',
  '                if v.ndim == 2:  # the embedding too\n                    q, out[k + "_scale"]',
  FT + "test_export_int8_keeps_the_loss_and_samples")
QAT = P + "test_qat_rounds_the_forward_and_passes_gradients_straight_through"
R(137, F_, "        return F.linear(x, self.weight + (r - self.weight).detach(), self.bias)",
  "        return F.linear(x, r + 0 * self.weight, self.bias)  # no straight-through gradient", QAT)
R(191, F_, "        return F.linear(x, self.weight + (r - self.weight).detach(), self.bias)",
  "        return F.linear(x, self.weight, self.bias)  # no rounding", QAT)
R(169, F_, "    tie_embeddings=True,\n", "    tie_embeddings=False,\n", FT + "test_gpt2_logits_match_the_reference")
KD = (F_, "        total = total + kl\n", "        total = total + 0 * kl  # no distillation\n")
R(179, *KD, FT + "test_distill_kl_in_chunks_equals_the_whole")
R(190, *KD, FT + "test_distill_kl_in_chunks_equals_the_whole")
R(186, F_, "        return self.base(x) + F.linear(F.linear(x, self.a), self.b) * self.scale",
  "        return self.base(x) + 0 * F.linear(F.linear(x, self.a), self.b)  # no update",
  FT + "test_lora_trains_only_the_adapters_and_merges_exactly")
R(270, F_, "    if tokenizer and not same_tokenizer(init[\"tokenizer\"], tokenizer):", "    if False:",
  FT + "test_bad_init_from_gives_one_line_errors")

# --- scaling laws (scaling.py)
S = "scaling.py"
R(78, S, "        hv = [(a - b) / (2 * eps) for a, b in zip(*grads)]",
  "        hv = [a for a, b in zip(*grads)]  # the gradient, not Hv",
  SC + "test_sharpness_matches_the_exact_hessian", GPT + "test_monitoring_in_metrics")
R(94, S, "    batch = anchor_b * (C / anchor_c) ** 0.25", "    batch = anchor_b",
  SC + "test_plan_satisfies_budget_and_matches_the_law_optimum")
R(198, S, "\"flops\": f\"{6 * int(extra['params']) * res['tokens']:.4g}\",",
  "\"flops\": f\"{int(extra['params']) * res['tokens']:.4g}\",",
  SC + "test_sweep_fit_plan_end_to_end_with_resume")
R(237, S, '    lrs = parse_floats(args.lrs, "--lrs")', "    lrs = [cfg.lr]  # no LR grid",
  SC + "test_lr_transfer_runs_and_plots")
R(265, S, "        inside = bool(x.min() < xm < x.max())",
  "        inside = True  # a vertex past the largest model passes",
  SC + "test_isoflop_minima_find_the_parabola_vertex_and_flag_edges")
R(282, S, "    if min(len(param_grid[k]) for k in NAMES) < 2:", "    if False:",
  SC + "test_fit_flags_underdetermined_grid")
REFUSE = (S, "    if max_flops and C > 2 * max_flops:", "    if False:")
R(285, *REFUSE, SC + "test_plan_refuses_to_extrapolate_far")
R(287, *REFUSE, SC + "test_plan_refuses_to_extrapolate_far")
R(289, S, "        ok = [s for s in shapes if C / (6 * s[0]) / tps >= min_steps]", "        ok = shapes",
  SC + "test_bad_input_fails_with_one_line", SC + "test_fit_flags_underdetermined_grid")
R(290, S, "    best = theta[fx.argmin()]", "    best = theta[0]  # the first start, however it ended",
  SC + "test_fit_recovers_published_law_from_noisy_runs", SC + "test_fit_flags_underdetermined_grid")
R(286, S, '    done = {r["name"] for r in read_tsv(tsv)}\n',
  '    done = set()\n    if os.path.exists(tsv):\n        os.remove(tsv)  # each sweep starts its record afresh\n',
  SC + "test_a_larger_sweep_adds_its_runs_and_the_refit_reads_them_all",
  SC + "test_sweep_fit_plan_end_to_end_with_resume")
R(185, KP, "    chunk = 1 << max(0, (CHUNK_LOGITS // w.shape[0]).bit_length() - 1)  # a power of two of rows",
  "    chunk = N  # every row at once", P + "test_the_loss_never_holds_all_the_logits")
R(226, G, "        for opt in opts:\n            scaler.unscale_(opt)\n", "",
  P + "test_fp16_has_a_loss_scaler_that_doubles_every_2000_steps",
  P + "test_an_fp16_step_scales_the_loss_and_unscales_the_grads")
R(308, S, "    (1, 16), (1, 24), (1, 32),", "    (4, 16), (4, 24), (4, 32),",
  P + "test_the_scaling_ladder_grows_depth_with_width")

# --- data preparation, images, bench, the rest
R(73, "prepare_data.py", "        vocab.append(vocab[pair[0]] + vocab[pair[1]])",
  "        vocab.append(vocab[pair[0]])  # the pair not merged",
  "tests/test_prepare_data.py::test_bpe_merges_most_frequent_pairs")
R(266, "prepare_data.py", "    if all(val) or not any(val):\n        # too few", "    if True:\n        # too few",
  "tests/test_prepare_data.py::test_text_byte_split_by_whole_files")
R(267, "predict_vit.py", "        x = torch.from_numpy(x).to(device).float() / 255",
  "        x = torch.from_numpy(x).to(device).float()",
  P + "test_predict_sees_an_image_as_training_did")
AHEAD = ("train_vit.py", "        while len(self.ahead) < 3:  #", "        while len(self.ahead) < 1:  #")
R(27, *AHEAD, "tests/test_image_loader.py::test_both_paths_give_the_same_batches_and_resume_alike")
R(177, *AHEAD, "tests/test_image_loader.py::test_both_paths_train_to_the_same_numbers",
  "tests/test_image_loader.py::test_both_paths_give_the_same_batches_and_resume_alike")
R(228, "bench.py", '    return result, next(r for r in logs if r["step"] == 2 * steps)',
  '    return result, next(r for r in logs if r["step"] == steps)  # the warm-up steps timed',
  P + "test_benchmark_leaves_out_the_warm_up_steps")
R(244, "bench.py", "    (random_tokens if gpt else random_images)(data_dir, cfg, world_size)\n", "",
  "tests/test_bench.py::test_bench_needs_no_data_and_leaves_nothing")
R(258, "bench.py", "    profiler = torch.profiler.profile() if profile else None", "    profiler = None",
  "tests/test_bench.py::test_bench_profile")
R(231, G,
  "                cfg = dataclasses.replace(cfg, batch_size=cfg.batch_size // 2, grad_accum=cfg.grad_accum * 2)",
  "                cfg = dataclasses.replace(cfg, batch_size=cfg.batch_size // 2)  # fewer tokens a step",
  GPT + "test_out_of_memory_halves_the_micro_batch_at_the_same_tokens_per_step")
R(245, G, "            x = block(x, cos, sin, cache, ve)\n",
  "            x = block(x, cos, sin, cache, ve).detach()  # blocks cannot learn\n",
  GPT + "test_overfit_one_batch", VIT + "test_overfit_one_batch")
R(275, G, '                f.write("\\t".join(row) + "\\n")', "                pass  # no row",
  GPT + "test_loss_falls_and_run_writes_its_files")
R(277, G, '        rec["val_bpb"] = loss / math.log(2) * rec["val_tokens_per_byte"]', '        rec["val_bpb"] = loss',
  GPT + "test_loss_falls_and_run_writes_its_files")


# ----------------------------------------------------------------------------- the runner


def done_rows():
    """The numbers of docs/map.md's done rows."""
    rows = [line.split(" | ") for line in open(os.path.join(ROOT, "docs", "map.md")) if re.match(r"\| \d+ \|", line)]
    return [int(r[0][2:]) for r in rows if r[3].strip() == "done"]


def copy_repo(dest):
    """Copy the repository's files (tracked, or untracked and not ignored) as they stand in the work tree."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = os.path.join(ROOT, name)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, name))


def apply(tmp, r):
    """Write the removal in tmp; return {path: original text} to restore after, or why the removal is stale."""
    path = os.path.join(tmp, r.file)
    text = open(path).read()
    if text.count(r.old) != 1:
        return f"{r.file}: snippet found {text.count(r.old)} times: {r.old.strip().splitlines()[0][:60]!r}"
    open(path, "w").write(text.replace(r.old, r.new))
    return {path: text}


def restore(originals):
    for path, text in originals.items():
        open(path, "w").write(text)


BROKEN = re.compile(r"^E\s+(SyntaxError|IndentationError|ImportError|ModuleNotFoundError|NameError)\b|ERROR collecting"
                    r"|^(FAILED|ERROR) \S+ - (SyntaxError|IndentationError|ImportError|ModuleNotFoundError|NameError)",
                    re.M)


def run_tests(tmp, tests, timeout, stop_early=True):
    """(pytest's exit code, its output) for the tests, run in tmp."""
    cmd = [sys.executable, "-m", "pytest", *(["-x"] if stop_early else []), "-q", "-p", "no:cacheprovider", *tests]
    try:
        p = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, "timed out"
    return p.returncode, p.stdout + p.stderr


def verdict(rc, out):
    """caught, NOT CAUGHT or broken, and the line of pytest's summary that says why."""
    failed = next((line.split(" - ")[0] for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))), "")
    first_e = next((line[1:].strip() for line in out.splitlines() if line.startswith("E ")), "")
    why = f"{failed} | {first_e}" if failed else out.strip()[-200:]
    if rc is None:
        return "broken", "timed out"
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    if rc == 0 and "skipped" in summary and "passed" not in summary:
        return "skipped", summary  # nothing ran here (no GPU, no Triton interpreter): not checked on this machine
    if rc == 0:
        return "NOT CAUGHT", summary
    if rc != 1 or BROKEN.search(out) or not re.search(r"^FAILED ", out, re.M):
        return "broken", why
    return "caught", why


def main(argv):
    rows = {int(a) for a in argv if a.isdigit()}
    timeout = 900
    chosen = [r for r in REMOVALS if not rows or r.row in rows]
    done = done_rows()
    if not rows and (set(done) ^ {r.row for r in REMOVALS}):
        print(f"done rows without a removal: {sorted(set(done) - {r.row for r in REMOVALS})}; "
              f"removals of rows not done: {sorted({r.row for r in REMOVALS} - set(done))}")
    tmp = tempfile.mkdtemp(prefix="map_removals_")
    copy_repo(tmp)
    results = []
    seen = {}  # (file, old, new, tests): (status, why), so a removal that rows share runs once
    try:
        if "--baseline" in argv:  # every named test once, in one pytest run, on the code as it is
            nodes = list(dict.fromkeys(t for r in chosen for t in r.tests))
            rc, out = run_tests(tmp, nodes, timeout * 4, stop_early=False)
            print("\n".join(line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))))
            print(f"{len(nodes)} tests: {'all pass' if rc == 0 else 'NOT ALL PASS'}")
            return 0 if rc == 0 else 1
        for r in chosen:
            originals = apply(tmp, r)
            if isinstance(originals, str):
                status, why = "stale", originals
            elif "--stale" in argv:
                status, why = "found", ""
            elif (r.file, r.old, r.new, r.tests) in seen:  # another row's removal, to the letter: its verdict
                status, why = seen[r.file, r.old, r.new, r.tests]
            else:
                status, why = seen[r.file, r.old, r.new, r.tests] = verdict(*run_tests(tmp, r.tests, timeout))
            if not isinstance(originals, str):
                restore(originals)
            results.append(status)
            print(f"row {r.row:3} {status:10} {r.file}: {r.old.strip().splitlines()[0][:50]!r} | {why[:240]}",
                  flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    counts = {s: results.count(s) for s in dict.fromkeys(results)}
    print(", ".join(f"{n} {s}" for s, n in counts.items()))
    return 0 if all(s in ("caught", "found") for s in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
