"""train_gpt.py: units, in-process CPU training runs, exact resume, bad input, and two-rank torchrun parity."""
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import prepare_data
import train_gpt as tg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(n_layer=2, n_head=4, n_embd=64, seq_len=32, batch_size=4, time_budget=0.0, warmup_steps=3,
            eval_every=0, log_every=1, sample_tokens=0, device="cpu", compile="false")


def tiny(corpus, out, **kw):
    return tg.Config(**{**TINY, "data_dir": str(corpus), "out_dir": str(out), **kw})


def losses(out_dir):
    """{step: train loss} from a run's metrics.jsonl."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def run_script(*args, env=None, torchrun=False):
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun
           else [sys.executable]) + [os.path.join(ROOT, "train_gpt.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, env={**os.environ, **(env or {})})

# ----------------------------------------------------------------------------- units


def test_cli_forms_bools_presets_and_unknown_flag():
    cfg = tg.parse_args(tg.Config, ["--n_layer=3", "--lr", "0.01", "--qk_norm=false", "--resume", "--tokens=auto"])
    assert (cfg.n_layer, cfg.lr, cfg.qk_norm, cfg.resume, cfg.tokens) == (3, 0.01, False, True, "auto")
    cfg = tg.parse_args(tg.Config, ["--preset=gpt2_124m", "--n_layer=2"])
    assert (cfg.n_embd, cfg.n_layer, cfg.seq_len) == (768, 2, 1024)  # preset applied, explicit flag wins
    with pytest.raises(SystemExit, match="did you mean --n_embd"):
        tg.parse_args(tg.Config, ["--n_emdb=64"])
    with pytest.raises(SystemExit, match="expected true/false"):
        tg.parse_args(tg.Config, ["--qk_norm=maybe"])
    with pytest.raises(SystemExit, match="unknown --preset"):
        tg.parse_args(tg.Config, ["--preset=gpt5"])


@pytest.mark.parametrize("kw", [dict(), dict(n_kv_head=2), dict(n_kv_head=1, mlp="relu2"),
                                dict(mlp="gelu", norm="layernorm", qk_norm=False, tie_embeddings=True, logit_softcap=30.0)])
def test_model_shapes_and_initial_loss(kw):
    cfg = tg.Config(**{**TINY, **kw})
    model = tg.build_model(cfg, 320, torch.device("cpu"))
    x = torch.randint(0, 257, (2, cfg.seq_len))
    assert model(x).shape == (2, cfg.seq_len, 320)
    loss = model(x, x).item()
    if not cfg.tie_embeddings:  # zero-init head: uniform prediction, loss = ln(vocab)
        assert loss == pytest.approx(math.log(320), abs=1e-4)
    n_kv = cfg.n_kv_head or cfg.n_head
    assert model.blocks[0].attn.qkv.weight.shape[0] == (cfg.n_head + 2 * n_kv) * (cfg.n_embd // cfg.n_head)
    assert all(b.attn.proj.weight.abs().sum() == 0 and b.mlp.proj.weight.abs().sum() == 0 for b in model.blocks)


def test_kv_cache_matches_full_forward():
    cfg = tg.Config(**{**TINY, "n_kv_head": 2})
    model = tg.build_model(cfg, 320, torch.device("cpu"))
    for p in model.parameters():  # make every weight non-trivial, so the check means something
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randint(0, 257, (2, 20))
    full = model(x)
    cache = tg.KVCache(cfg.n_layer, cfg.seq_len)
    steps = [model(x[:, :8], cache=cache)[:, -1]] + [model(x[:, t:t + 1], cache=cache)[:, -1] for t in range(8, 20)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 7:], rtol=1e-4, atol=1e-4)
    out = model.generate(x[:, :5], 40, temperature=0.0)  # runs past seq_len=32: the cache refills
    assert out.shape == (2, 45) and torch.equal(out[:, :5], x[:, :5])


def test_lr_schedules():
    cfg = tg.Config(warmup_steps=10, final_lr_frac=0.1, schedule="cosine")
    assert tg.lr_mult(cfg, 0, 0.0) == pytest.approx(0.1)
    assert tg.lr_mult(cfg, 50, 0.5) == pytest.approx(0.55)
    assert tg.lr_mult(cfg, 100, 1.0) == pytest.approx(0.1)
    wsd = tg.Config(warmup_steps=0, schedule="wsd", cooldown_frac=0.2, final_lr_frac=0.0)
    assert tg.lr_mult(wsd, 70, 0.7) == 1.0 and tg.lr_mult(wsd, 90, 0.9) == pytest.approx(0.5)
    assert tg.lr_mult(tg.Config(warmup_steps=0, schedule="constant"), 99, 0.99) == 1.0


def test_loader_ranks_partition_the_global_batch_and_resume(tmp_path):
    tokens = np.arange(5000) % 1000
    tokens[::17] = 1000  # a document every 17 tokens: a row of 16 ends 1 token before the next document
    prepare_data.write_shard(tmp_path / "train_000000.bin", tokens)
    prepare_data.write_shard(tmp_path / "train_000001.bin", tokens[:800])
    files, dev = tg.find_shards(str(tmp_path), "train"), torch.device("cpu")
    one = tg.TokenLoader(files, 6, 16, 0, 1, dev, eot=1000, lanes=6)
    two = [tg.TokenLoader(files, 3, 16, r, 2, dev, eot=1000, lanes=6) for r in range(2)]
    starts, seen = [], set()
    for _ in range(80):  # crosses into the second shard and wraps around (a new epoch)
        x, y = one.next()
        x0, y0 = two[0].next()
        x1, y1 = two[1].next()
        assert torch.equal(x, torch.cat([x0, x1])) and torch.equal(y[:, :-1], x[:, 1:])
        starts.append((x[:, 0] == 1000).float().mean().item())
        seen.update(x.flatten().tolist())
    assert one.epoch >= 1 and len(seen) == 1001  # every token value was read
    assert np.mean(starts) > 0.9  # rows move up to the document start just ahead of them
    first = x[:, :4].tolist()
    assert len({tuple(r) for r in first}) == 6  # the rows of a batch come from different lanes
    state = one.state()
    a = one.next()[0]
    again = tg.TokenLoader(files, 6, 16, 0, 1, dev, eot=1000, lanes=6)
    again.load_state(state)
    assert torch.equal(again.next()[0], a)


def test_nanogpt_raw_bins_and_meta_pkl(tmp_path):
    import pickle
    for split in ("train", "val"):
        (np.arange(3000) % 65).astype(np.uint16).tofile(tmp_path / f"{split}.bin")
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 65, "itos": {i: chr(ord("A") + i % 26) for i in range(65)}}, f)
    meta = tg.load_meta(str(tmp_path))
    assert meta["vocab_size"] == 65
    r = tg.main(tiny(tmp_path, tmp_path / "out", max_steps=3))
    assert r["steps"] == 3 and "val_bpb" not in r and math.isfinite(r["val_loss"])

# ----------------------------------------------------------------------------- training runs


def test_overfit_one_batch():
    cfg = tg.Config(**TINY)
    torch.manual_seed(0)
    model = tg.build_model(cfg, 320, torch.device("cpu"))
    opt = tg.build_optimizers(tg.Config(**{**TINY, "lr": 1e-2}), model, torch.device("cpu"))[0]
    x = torch.randint(0, 257, (4, cfg.seq_len + 1))
    for _ in range(150):
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.05


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_loss_falls_and_run_writes_its_files(corpus, tmp_path, optimizer):
    r = tg.main(tiny(corpus, tmp_path / "out", max_steps=40, optimizer=optimizer, lr=1e-2, eval_every=20,
                     sample_tokens=20, z_loss=1e-4))
    first = losses(tmp_path / "out")[1]
    assert r["steps"] == 40 and r["val_loss"] < first - 2.0, (first, r["val_loss"])
    assert r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2) * r["val_tokens_per_byte"], rel=1e-6)
    for f in ("config.json", "metrics.jsonl", "loss.png", "ckpt_0000040.pt", "ckpt_0000040.pt.done"):
        assert (tmp_path / "out" / f).exists(), f
    rows = (tmp_path / "results.tsv").read_text().splitlines()
    assert rows[0].startswith("run_id") and "val_bpb" in rows[1]


def test_resume_is_exact(corpus, tmp_path):
    """Stop at step 6 (by keeping only that checkpoint), resume: steps 7..12 must equal the uninterrupted run's."""
    a, b = tmp_path / "a", tmp_path / "b"
    ra = tg.main(tiny(corpus, a, max_steps=12, save_every=6, keep_last=5, optimizer="muon"))
    b.mkdir()
    for ext in ("", ".done"):
        shutil.copy(a / f"ckpt_0000006.pt{ext}", b)
    rb = tg.main(tiny(corpus, b, max_steps=12, resume=True, optimizer="muon"))
    la, lb = losses(a), losses(b)
    assert sorted(lb) == list(range(7, 13))
    assert all(la[s] == lb[s] for s in lb), (la, lb)  # bit-exact, not approximately equal
    assert ra["val_loss"] == rb["val_loss"]


def test_time_budget_and_token_budget(corpus, tmp_path):
    r = tg.main(tiny(corpus, tmp_path / "t", time_budget=2.0))
    assert r["train_time"] >= 2.0 and r["steps"] > 1
    r = tg.main(tiny(corpus, tmp_path / "n", tokens="2000"))  # 128 tokens per step
    assert r["steps"] == math.ceil(2000 / 128)


def test_sample_from_checkpoint(corpus, tmp_path):
    tg.main(tiny(corpus, tmp_path / "out", max_steps=5))
    r = tg.main(tg.Config(sample=True, ckpt=str(tmp_path / "out"), prompt="def ", max_new_tokens=30, device="cpu"))
    assert r["text"].startswith("def ") and len(r["ids"]) == 1 + 4 + 30


def test_benchmark_needs_no_data(tmp_path):
    r = tg.main(tg.Config(**{**TINY, "benchmark": True, "bench_steps": 3, "out_dir": str(tmp_path)}))
    assert r["tok_s"] > 0 and r["ms_per_step"] > 0 and r["mfu"] is None and r["params"] > 0


@pytest.mark.slow
def test_compile_on_cpu(corpus, tmp_path):
    r = tg.main(tiny(corpus, tmp_path / "c", max_steps=2, compile="true"))
    assert r["steps"] == 2 and math.isfinite(r["val_loss"])

# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args, message", [
    (["--data_dir=/nonexistent/x", "--max_steps=1"], "does not exist"),
    (["--n_embd=65", "--max_steps=1"], "must split into"),
    (["--n_head=4", "--n_kv_head=3", "--max_steps=1"], "multiple of --n_kv_head"),
    (["--mlp=tanh", "--max_steps=1"], "not one of swiglu|relu2|gelu"),
    (["--time_budget=0"], "no training budget"),
    (["--lrr=0.1"], "did you mean --lr"),
    (["--batch_size=abc"], "invalid int value"),
])
def test_bad_flags_give_one_line_errors(args, message, tmp_path):
    p = run_script(*args, f"--out_dir={tmp_path}/o", "--device=cpu")
    assert p.returncode != 0 and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr  # one line, no traceback
    assert not os.path.exists(tmp_path / "o")


def test_bad_data(corpus, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="no meta.json or train.bin"):
        tg.main(tiny(empty, tmp_path / "o", max_steps=1))
    bad = tmp_path / "bad"
    shutil.copytree(corpus, bad)
    with open(bad / "train_000000.bin", "r+b") as f:  # truncate: header promises more tokens than the file holds
        f.truncate(2000)
    with pytest.raises(SystemExit, match="corrupt shard"):
        tg.main(tiny(bad, tmp_path / "o", max_steps=1))
    with pytest.raises(SystemExit, match="the data has 257 tokens but --vocab_size=100"):
        tg.main(tiny(corpus, tmp_path / "o", max_steps=1, vocab_size=100))
    with pytest.raises(SystemExit, match="shorter than --seq_len"):
        tg.main(tiny(corpus, tmp_path / "o", max_steps=1, seq_len=1 << 20))


def test_resume_with_other_config_is_refused(corpus, tmp_path):
    tg.main(tiny(corpus, tmp_path / "o", max_steps=2))
    before = sorted(os.listdir(tmp_path / "o"))
    with pytest.raises(SystemExit, match=r"n_embd=64 \(now 128\)"):
        tg.main(tiny(corpus, tmp_path / "o", max_steps=4, n_embd=128, resume=True))
    assert sorted(os.listdir(tmp_path / "o")) == before  # nothing overwritten


def test_corrupt_newest_checkpoint_falls_back(corpus, tmp_path):
    tg.main(tiny(corpus, tmp_path / "o", max_steps=4, save_every=2, keep_last=3))
    with open(tmp_path / "o" / "ckpt_0000004.pt", "r+b") as f:
        f.truncate(100)
    ckpt, path = tg.load_checkpoint(str(tmp_path / "o"))
    assert ckpt["step"] == 2 and path.endswith("ckpt_0000002.pt")

# ----------------------------------------------------------------------------- distributed (gloo, two ranks)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_match_one_process(corpus, tmp_path, parallel):
    """Two ranks with micro-batch 2 and accumulation 2 = one process with batch 8: same losses to fp32 tolerance."""
    common = [f"--data_dir={corpus}", "--n_layer=2", "--n_embd=64", "--n_head=4", "--seq_len=32", "--max_steps=5",
              "--time_budget=0", "--log_every=1", "--sample_tokens=0", "--device=cpu", "--warmup_steps=2"]
    one = run_script(*common, "--batch_size=8", f"--out_dir={tmp_path}/one")
    two = run_script(*common, "--batch_size=2", "--grad_accum=2", f"--parallel={parallel}", f"--out_dir={tmp_path}/two",
                     "--save_every=3", torchrun=True)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    l1, l2 = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(l1) == sorted(l2) == [1, 2, 3, 4, 5]
    for s in l1:
        assert l2[s] == pytest.approx(l1[s], rel=1e-5, abs=1e-5), (s, l1[s], l2[s])
    ckpt = torch.load(tmp_path / "two" / "ckpt_0000005.pt", weights_only=False)
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in ckpt["model"])  # plain keys, loadable anywhere
    (tmp_path / "again").mkdir()  # resume the two-rank run from step 3: steps 4 and 5 must come out the same
    for ext in ("", ".done"):
        shutil.copy(tmp_path / "two" / f"ckpt_0000003.pt{ext}", tmp_path / "again")
    again = run_script(*common, "--batch_size=2", "--grad_accum=2", f"--parallel={parallel}",
                       f"--out_dir={tmp_path}/again", "--resume", torchrun=True)
    assert again.returncode == 0, again.stderr[-3000:]
    l3 = losses(tmp_path / "again")
    assert sorted(l3) == [4, 5] and all(l3[s] == pytest.approx(l2[s], rel=1e-6, abs=1e-6) for s in l3)


def test_existing_run_is_never_overwritten(corpus, tmp_path):
    out = tmp_path / "o"
    tg.main(tiny(corpus, out, max_steps=2))
    snapshot = lambda: {f: (out / f).read_bytes() for f in os.listdir(out)}  # noqa: E731
    before = snapshot()
    with pytest.raises(SystemExit, match="continue it with --resume or pick a new --out_dir"):
        tg.main(tiny(corpus, out, max_steps=2))
    assert snapshot() == before
    with open(out / "ckpt_0000002.pt", "r+b") as f:  # every checkpoint unreadable: --resume refuses to start over
        f.truncate(10)
    before = snapshot()
    with pytest.raises(SystemExit, match="no checkpoint in .* is readable"):
        tg.main(tiny(corpus, out, max_steps=4, resume=True))
    assert snapshot() == before


def test_model_through_triton_kernels_matches_pytorch_path(monkeypatch):
    """The same tiny GPT with the Triton kernels (interpreted on CPU) and with the references: same loss and grads."""
    pytest.importorskip("triton")
    cfg = tg.Config(**{**TINY, "n_layer": 1, "n_embd": 32, "n_head": 2, "n_kv_head": 1, "seq_len": 17,
                       "logit_softcap": 30.0})
    x = torch.randint(0, 257, (2, 18))
    results = []
    for interpret in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        model = tg.build_model(cfg, 320, torch.device("cpu"))
        for p in model.parameters():  # non-trivial weights (zero-init projections would hide attention)
            torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(p.numel()))
        loss = model(x[:, :-1], x[:, 1:], z_loss=1e-3)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-5)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
