"""finetune_gpt.py: GPT-2's weights in (logits against the published equations and, where installed, Hugging Face's
own model) and out (--export=hf), fine-tuning from GPT-2 or from a checkpoint, LoRA, distillation, INT8 and QAT, and
the bad input around them."""
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
from typing import get_args

import pytest
import torch
import torch.nn.functional as F

import finetune_gpt as ft
import sample_gpt
import train_gpt as tg
from test_train_gpt import TINY, losses, tiny

GPT2 = dict(vocab_size=320, n_positions=40, n_embd=48, n_layer=2, n_head=4, layer_norm_epsilon=1e-5)


def ft_tiny(corpus, out, **kw):
    """test_train_gpt's tiny run, as a finetune_gpt.py config."""
    return ft.Config(**{**TINY, "data_dir": str(corpus), "out_dir": str(out), **kw})


def write_safetensors(path, tensors):
    """The safetensors layout, written by hand: header size (8 bytes, little-endian), JSON header, raw fp32 data."""
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        blobs.append(t.contiguous().numpy().tobytes())
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(blobs[-1])]}
        offset += len(blobs[-1])
    head = json.dumps(header).encode()
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def gpt2_folder(path, bin_file=False, seed=0, conf=GPT2, far_below_zero=False):
    """A small random GPT-2 in Hugging Face's layout (Conv1D weights are (in, out)); returns its tensors. With
    far_below_zero every logit sits near -60, as a trained GPT-2's do (-55 to -70): the final norm's output keeps a
    constant +8 along one axis on which every token's embedding has -7.5."""
    g, d, (V, T, L) = torch.Generator().manual_seed(seed), conf["n_embd"], (conf[k] for k in ("vocab_size", "n_positions", "n_layer"))
    r = lambda *shape, s=0.2: torch.randn(*shape, generator=g) * s  # noqa: E731
    w = {"wte.weight": r(V, d), "wpe.weight": r(T, d, s=0.05), "ln_f.weight": 1 + r(d, s=0.1), "ln_f.bias": r(d, s=0.1)}
    if far_below_zero:
        w["ln_f.weight"][0], w["ln_f.bias"][0], w["wte.weight"][:, 0] = 0.0, 8.0, -7.5
    for i in range(L):
        for name, (n_in, n_out) in {"attn.c_attn": (d, 3 * d), "attn.c_proj": (d, d), "mlp.c_fc": (d, 4 * d),
                                    "mlp.c_proj": (4 * d, d)}.items():
            w[f"h.{i}.{name}.weight"], w[f"h.{i}.{name}.bias"] = r(n_in, n_out), r(n_out, s=0.05)
        for ln in ("ln_1", "ln_2"):
            w[f"h.{i}.{ln}.weight"], w[f"h.{i}.{ln}.bias"] = 1 + r(d, s=0.1), r(d, s=0.1)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], **conf}))
    if bin_file:  # the older pickle layout, with transformer. prefixes and the attention-mask buffers
        torch.save({**{f"transformer.{k}": v for k, v in w.items()}, "transformer.h.0.attn.bias": torch.ones(1)},
                   path / "pytorch_model.bin")
    else:
        write_safetensors(path / "model.safetensors", w)
    return w


def gpt2_reference(w, idx, conf=GPT2):
    """GPT-2's forward written from its equations on Hugging Face's tensor names: (B, T, vocab) logits."""
    (B, T), d, H = idx.shape, conf["n_embd"], conf["n_head"]
    ln = lambda x, p: F.layer_norm(x, (d,), w[p + ".weight"], w[p + ".bias"], conf["layer_norm_epsilon"])  # noqa: E731
    heads = lambda t: t.view(B, T, H, d // H).transpose(1, 2)  # noqa: E731
    x = w["wte.weight"][idx] + w["wpe.weight"][:T]
    for i in range(conf["n_layer"]):
        h = f"h.{i}."
        q, k, v = (ln(x, h + "ln_1") @ w[h + "attn.c_attn.weight"] + w[h + "attn.c_attn.bias"]).split(d, dim=-1)
        att = heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(d // H)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf).softmax(-1)
        y = (att @ heads(v)).transpose(1, 2).reshape(B, T, d)
        x = x + y @ w[h + "attn.c_proj.weight"] + w[h + "attn.c_proj.bias"]
        m = F.gelu(ln(x, h + "ln_2") @ w[h + "mlp.c_fc.weight"] + w[h + "mlp.c_fc.bias"], approximate="tanh")
        x = x + m @ w[h + "mlp.c_proj.weight"] + w[h + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ w["wte.weight"].T


@pytest.mark.parametrize("bin_file", [False, True])
def test_gpt2_logits_match_the_reference(tmp_path, bin_file):
    w = gpt2_folder(tmp_path / "gpt2", bin_file)
    model = ft.from_pretrained(str(tmp_path / "gpt2"))
    assert not model.training and model.cfg.seq_len == GPT2["n_positions"]
    idx = torch.randint(0, GPT2["vocab_size"], (2, GPT2["n_positions"]), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, ref = model(idx), gpt2_reference(w, idx)
    assert logits.shape == (2, GPT2["n_positions"], 320)
    assert (logits - ref).abs().max() < 1e-4
    with torch.no_grad():  # the KV-cache sampler with learned positions: greedy continuation equals the full forward
        out = model.generate(idx[:1, :5], 6, temperature=0)
        assert torch.equal(out[0, 5:], torch.stack([model(out[:, :5 + j])[0, -1].argmax() for j in range(6)]))


def test_prepare_data_fetches_gpt2_from_the_hub(tmp_path, monkeypatch):
    import prepare_data
    w = gpt2_folder(tmp_path / "hub" / "gpt2" / "resolve" / "main")  # the hub's URL layout, as file:// URLs
    monkeypatch.setattr(prepare_data, "GPT2_URL", (tmp_path / "hub").as_uri() + "/")
    prepare_data.main(["gpt2", f"--data_dir={tmp_path / 'models' / 'gpt2'}"])
    assert ft.from_pretrained(str(tmp_path / "models" / "gpt2")).wte.weight[:320].equal(w["wte.weight"])


def test_gpt2_logits_match_transformers(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only oracle, not installed here")
    gpt2_folder(tmp_path / "gpt2")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "gpt2")).eval()
    idx = torch.randint(0, GPT2["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (ft.from_pretrained(str(tmp_path / "gpt2"))(idx)[..., :GPT2["vocab_size"]] - theirs(idx).logits)
    assert diff.abs().max() < 1e-4


@pytest.fixture
def gpt2_corpus(corpus, tmp_path, monkeypatch):
    """The byte corpus relabelled as GPT-2 tokens (every id < 320 is a GPT-2 token id too). tiktoken's GPT-2 files are
    not fetched: the trainer takes its offline path (samples show token ids)."""
    import tiktoken

    def offline(name):
        raise OSError("offline")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    data = shutil.copytree(corpus, tmp_path / "gpt2_data")
    meta = json.loads((data / "meta.json").read_text())
    (data / "meta.json").write_text(json.dumps({**meta, "tokenizer": "gpt2"}))
    return data


def test_init_from_gpt2_starts_from_its_loss(gpt2_corpus, tmp_path):
    gpt2_folder(tmp_path / "gpt2")
    cfg = tg.parse_args(ft.Config, ["--preset=finetune", f"--init_from={tmp_path / 'gpt2'}",
                                    f"--data_dir={gpt2_corpus}", f"--out_dir={tmp_path / 'out'}", "--max_steps=2",
                                    "--batch_size=2", "--seq_len=32", "--log_every=1", "--sample_tokens=0",
                                    "--device=cpu", "--compile=false",
                                    "--dtype=float32"])  # fp32, as the reference forward below
    assert (cfg.optimizer, cfg.lr) == ("adamw", 3e-5)  # the preset: a small AdamW step keeps what GPT-2 knows
    r = ft.main(cfg)
    positions_cut = (GPT2["n_positions"] - cfg.seq_len) * GPT2["n_embd"]  # --seq_len 32 of GPT-2's 40 positions
    gpt2 = ft.from_pretrained(str(tmp_path / "gpt2"))
    assert r["params"] == sum(p.numel() for p in gpt2.parameters()) - positions_cut
    loader = tg.TokenLoader(tg.find_shards(str(gpt2_corpus), "train"), 2, cfg.seq_len, 0, 1, torch.device("cpu"),
                            seed=cfg.seed)  # the trainer's loader, in the trainer's order
    with torch.no_grad():  # the first step's loss is GPT-2's own loss on the first batch
        first = ft.from_pretrained(str(tmp_path / "gpt2"))(*loader.next()[:2]).item()
    assert losses(tmp_path / "out")[1] == pytest.approx(first, abs=1e-4)


def test_init_from_checkpoint_starts_where_it_ended(corpus, tmp_path):
    tg.main(tiny(corpus, tmp_path / "a", max_steps=30, lr=1e-2, optimizer="adamw"))
    a = losses(tmp_path / "a")
    r = ft.main(ft_tiny(corpus, tmp_path / "b", max_steps=3, init_from=str(tmp_path / "a"), n_layer=1, n_embd=32))
    b = losses(tmp_path / "b")
    assert sorted(b) == [1, 2, 3] and r["steps"] == 3  # a fresh schedule: step 1 again
    assert b[1] < a[1] - 0.6 * (a[1] - a[30])  # the weights, not the flags: n_layer and n_embd came from the checkpoint


@pytest.mark.parametrize("case, message", [
    ("not_gpt2", "model_type is 'llama', not 'gpt2'"),
    ("missing", "no checkpoint there, nor a Hugging Face GPT-2 folder"),
    ("same_out_dir", "starts a new run from"),
    ("tokenizer", "reads gpt2 tokens but"),
    ("vocab", "prepare the data with its tokenizer"),
])
def test_bad_init_from_gives_one_line_errors(corpus, gpt2_corpus, tmp_path, case, message):
    data, init = gpt2_corpus, tmp_path / "gpt2"
    gpt2_folder(init)
    if case == "not_gpt2":
        (init / "config.json").write_text(json.dumps({**GPT2, "model_type": "llama"}))
    elif case == "missing":
        init = tmp_path / "nothing"
    elif case == "same_out_dir":
        tg.main(tiny(corpus, tmp_path / "a", max_steps=2))
        data, init = corpus, tmp_path / "a"
    elif case == "tokenizer":
        data = corpus
    elif case == "vocab":
        meta = json.loads((data / "meta.json").read_text())
        (data / "meta.json").write_text(json.dumps({**meta, "vocab_size": 50257}))
    with pytest.raises(SystemExit) as e:
        ft.main(ft_tiny(data, tmp_path / "a", max_steps=2, init_from=str(init)))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_lora_trains_only_the_adapters_and_merges_exactly(gpt2_corpus, tmp_path):
    gpt2_folder(tmp_path / "gpt2")
    base = ft.from_pretrained(str(tmp_path / "gpt2")).state_dict()
    out = tmp_path / "lora"
    r = ft.main(ft_tiny(gpt2_corpus, out, init_from=str(tmp_path / "gpt2"), lora_rank=4, lora_targets="attn,mlp",
                        max_steps=6, lr=1e-2, optimizer="adamw", batch_size=2))
    d, L = GPT2["n_embd"], GPT2["n_layer"]
    assert r["trained_params"] == L * 4 * ((d + 3 * d) + (d + d) + (d + 4 * d) + (4 * d + d))  # r x (in + out) each
    ckpt, _ = tg.load_checkpoint(str(out))
    sd = ckpt["model"]
    for k, v in sd.items():  # only the adapters moved: the base weights are GPT-2's
        if k.endswith((".a", ".b")):
            assert not k.endswith(".b") or v.abs().max() > 0  # B starts at zero: it trained
        else:
            theirs = base[k.replace(".base.", ".")]
            assert torch.equal(v, theirs[:v.size(0)] if k == "wpe.weight" else theirs), k
    merged = ft.main(ft.Config(merge_lora=True, ckpt=str(out), out_dir=str(tmp_path / "merged")))
    plain = tg.load_checkpoint(merged["path"])[0]
    assert plain["config"]["lora_rank"] == 0 and not any(k.endswith((".a", ".b")) for k in plain["model"])
    cfg = ft.Config(**{k: v for k, v in ckpt["config"].items() if k in ft.Config.__dataclass_fields__})
    adapted = ft.add_lora(tg.build_model(cfg, 320, torch.device("cpu")), cfg)
    adapted.load_state_dict(sd)
    flat = tg.build_model(ft.Config(**{**ckpt["config"], "lora_rank": 0}), 320, torch.device("cpu"))
    flat.load_state_dict(plain["model"])
    idx = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (adapted(idx) - flat(idx)).abs().max() < 1e-5
        assert (adapted(idx) - ft.from_pretrained(str(tmp_path / "gpt2"))(idx)).abs().max() > 1e-3  # it learned


def test_lora_resume_is_exact(gpt2_corpus, tmp_path):
    gpt2_folder(tmp_path / "gpt2")
    kw = dict(init_from=str(tmp_path / "gpt2"), lora_rank=2, lora_targets="attn", lr=1e-2, batch_size=2, keep_last=5)
    ra = ft.main(ft_tiny(gpt2_corpus, tmp_path / "a", max_steps=8, save_every=4, **kw))
    for _, p in tg.list_checkpoints(str(tmp_path / "a"))[-1:]:
        os.remove(p)  # back to step 4, then on to 8 again
    rb = ft.main(ft_tiny(gpt2_corpus, tmp_path / "a", max_steps=8, save_every=4, resume=True, **kw))
    assert rb["train_loss"] == ra["train_loss"] and rb["val_loss"] == ra["val_loss"]


@pytest.mark.parametrize("kw, message", [
    (dict(lora_rank=4), "LoRA needs a rank >= 0, --init_from=WEIGHTS"),
    (dict(lora_rank=4, init_from="x", lora_targets="attn,conv"), "targets among attn,mlp"),
    (dict(merge_lora=True, ckpt="nowhere"), "--merge_lora needs --ckpt=PATH, a checkpoint of a LoRA run"),
])
def test_bad_lora_flags_give_one_line_errors(corpus, tmp_path, kw, message):
    with pytest.raises(SystemExit) as e:
        ft.main(ft_tiny(corpus, tmp_path / "out", max_steps=2, **kw))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_distill_kl_in_chunks_equals_the_whole(monkeypatch):
    cfg = tg.Config(**{**dict(n_layer=1, n_head=2, n_embd=32, seq_len=16), "logit_softcap": 5.0})
    student, teacher = (tg.build_model(tg.Config(**{**vars(cfg), "seed": s}), 100, torch.device("cpu")) for s in (0, 1))
    for m in (student, teacher):  # zero-init heads would make every logit 0
        torch.nn.init.normal_(m.head.weight, std=0.5)
    idx = torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(0))
    x, w = student.hidden(idx)
    xt, wt = teacher.hidden(idx)
    s, t = student.logits(x, w)[..., :100] / 2.0, teacher.logits(xt, wt)[..., :100] / 2.0
    whole = (t.softmax(-1) * (t.log_softmax(-1) - s.log_softmax(-1))).sum(-1).mean()  # KL(teacher || student)
    gw, = torch.autograd.grad(whole, w, retain_graph=True)
    monkeypatch.setattr(tg.kernels, "SMALL_LOGITS", 7 * 128)  # chunks of 7 rows of 48 (the vocab pads to 128)
    chunked = ft.distill_kl(student, x, w, teacher, xt.detach(), wt.detach(), 2.0)
    gc, = torch.autograd.grad(chunked, w)
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-5) and whole.item() > 0.01
    assert torch.allclose(gc, gw, atol=1e-6)
    assert ft.distill_kl(student, x, w, student, x, w, 2.0).abs().item() < 1e-6  # a teacher equal to the student


def test_distillation_weight_zero_is_plain_training_and_a_copy_teaches_nothing(corpus, tmp_path):
    teacher = tg.main(tiny(corpus, tmp_path / "teacher", max_steps=6, n_layer=1))
    plain = tg.main(tiny(corpus, tmp_path / "plain", max_steps=4))
    w0 = ft.main(ft_tiny(corpus, tmp_path / "w0", max_steps=4, teacher=str(tmp_path / "teacher"), distill_weight=0.0))
    assert losses(tmp_path / "w0") == losses(tmp_path / "plain") and w0["val_loss"] == plain["val_loss"]
    same = ft_tiny(corpus, tmp_path / "same", max_steps=1, init_from=str(tmp_path / "teacher"),
                   teacher=str(tmp_path / "teacher"), distill_weight=1.0)
    r = ft.main(same)
    assert abs(losses(tmp_path / "same")[1]) < 1e-5  # all KL, and the KL of a model to itself is 0
    # the val loss is the student's CE, the teacher's own (its copy barely moved): not the training loss's KL, ~0
    assert r["val_loss"] == pytest.approx(teacher["val_loss"], abs=0.05) and teacher["val_loss"] > 1.0


def test_teacher_with_another_tokenizer_is_a_one_line_error(corpus, tmp_path):
    gpt2_folder(tmp_path / "gpt2")
    with pytest.raises(SystemExit) as e:
        ft.main(ft_tiny(corpus, tmp_path / "out", max_steps=2, teacher=str(tmp_path / "gpt2")))
    assert "reads gpt2 tokens (320) but the student reads byte tokens (257)" in str(e.value) and "\n" not in str(e.value)


def test_int8_round_trip_is_within_half_a_step():
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 0, 64)[:, None]
    w[3, 7] = 40.0  # an outlier widens its own row's step only
    q, scale = ft.quantize(w)
    back = ft.dequantize({"x.weight": q.to(torch.int8), "x.weight_scale": scale})["x.weight"]
    assert q.abs().max() == 127 and ((back - w).abs() <= scale / 2 * (1 + 1e-5)).all()
    assert (back - w)[torch.arange(64) != 3].abs().max() < 0.01 * w.abs().max()


def test_export_int8_keeps_the_loss_and_samples(corpus, tmp_path):
    # without value embeddings: their tables stay in float, as the embedding does, and here they would be half the
    # weights that int8 halves
    tg.main(tiny(corpus, tmp_path / "a", max_steps=40, lr=1e-2, optimizer="adamw", value_embeds=False))
    r = ft.main(ft.Config(export="int8", ckpt=str(tmp_path / "a"), out_dir=str(tmp_path / "q"), data_dir=str(corpus),
                          device="cpu"))
    assert r["float_val_loss"] < 3.0 and abs(r["int8_val_loss"] - r["float_val_loss"]) < 0.01  # measured: 1e-4
    assert r["int8_mb"] < 0.5 * r["float_mb"]  # the hidden matrices at a quarter; embedding and head as they were
    ckpt, _ = tg.load_checkpoint(r["path"])
    assert ckpt["model"]["blocks.0.attn.qkv.weight"].dtype == torch.int8 and ckpt["model"]["wte.weight"].dtype == torch.float32
    out = sample_gpt.main(sample_gpt.Config(ckpt=r["path"], max_new_tokens=20, device="cpu"))
    assert len(out["ids"]) == 1 + 20


def test_qat_at_16_bits_trains_as_plain(corpus, tmp_path):
    tg.main(tiny(corpus, tmp_path / "plain", max_steps=8))
    ft.main(ft_tiny(corpus, tmp_path / "qat", max_steps=8, qat=16))  # 16-bit grid steps are far below the updates
    plain, qat = losses(tmp_path / "plain"), losses(tmp_path / "qat")
    assert all(qat[s] == pytest.approx(plain[s], abs=1e-4) for s in plain) and plain[8] < plain[1] - 0.5


@pytest.mark.parametrize("kw, message", [
    (dict(export="int8", ckpt="nowhere"), "--export needs --ckpt=PATH, a checkpoint of train_gpt.py; nowhere is not one"),
    (dict(export="int4"), "--export only int8"),
    (dict(qat=1), "--qat takes 0 (off) or 2 bits and up"),
])
def test_bad_export_flags_give_one_line_errors(corpus, tmp_path, kw, message):
    with pytest.raises(SystemExit) as e:
        ft.main(ft_tiny(corpus, tmp_path / "out", max_steps=2, **kw))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_cli_of_finetune_gpt_is_train_gpts_over_its_config(capsys):
    """finetune_gpt.py parses with train_gpt.py's shim over its Config, a subclass: -h shows both scripts' flags with
    their comments, an unknown flag names the nearest of either, --preset knows finetune and train_gpt.py's, and the
    choices of train_gpt.py's fields still bind."""
    with pytest.raises(SystemExit):
        tg.parse_args(ft.Config, ["-h"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("finetune_gpt.py: train_gpt.py's GPT from other weights") == 1
    assert "--n_layer N_LAYER transformer blocks (default: 4)" in out and "--lora_rank LORA_RANK LoRA adapters" in out
    assert "named overrides: finetune, or train_gpt.py's" in out  # its own comment wins over train_gpt.py's
    for argv, message in ((["--lora_rnak=4"], "did you mean --lora_rank"), (["--n_emdb=4"], "did you mean --n_embd")):
        with pytest.raises(SystemExit, match=message):
            tg.parse_args(ft.Config, argv)
    assert tg.parse_args(ft.Config, ["--preset=gpt2_124m"]).n_embd == 768
    assert tg.parse_args(ft.Config, ["--preset=finetune"]).init_from == "gpt2"
    presets = "cpu_demo, cpu_128, gpt2_124m, gpt2_350m"
    with pytest.raises(SystemExit, match=f"unknown --preset=finetune; choose one of {presets}$"):
        tg.parse_args(tg.Config, ["--preset=finetune"])
    assert get_args(ft.Config.__dataclass_fields__["mlp"].type) == ("swiglu", "relu2", "gelu")  # inherited
    assert {n: t for n, _, t in tg.config_lines(ft.Config)}["n_layer"] == "transformer blocks"  # and its help text
    with pytest.raises(SystemExit, match="--mlp=tanh is not one of swiglu|relu2|gelu"):
        ft.main(ft.Config(mlp="tanh"))
    with pytest.raises(SystemExit, match="unknown flag '--lora_rank'"):  # a flag of finetune_gpt.py only
        tg.parse_args(tg.Config, ["--lora_rank=4"])
    p = subprocess.run([sys.executable, ft.__file__, "--lora_rnak=4"], capture_output=True, text=True)
    want = "finetune_gpt.py: error: unknown flag '--lora_rnak'; did you mean --lora_rank?"
    assert p.returncode and p.stderr.splitlines() == [want]


def test_resume_shares_the_adapters(gpt2_corpus, tmp_path):
    """A fine-tuning run resumes only with its LoRA and QAT settings (FineTune.layout), not as a train_gpt.py run."""
    gpt2_folder(tmp_path / "gpt2")
    kw = dict(init_from=str(tmp_path / "gpt2"), lora_rank=2, batch_size=2)
    ft.main(ft_tiny(gpt2_corpus, tmp_path / "a", max_steps=2, **kw))
    with pytest.raises(SystemExit, match=r"lora_alpha=16.0 \(now 8.0\)"):
        ft.main(ft_tiny(gpt2_corpus, tmp_path / "a", max_steps=3, resume=True, lora_alpha=8.0, **kw))
    with pytest.raises(SystemExit, match=r"qat=0 \(now 8\)"):
        ft.main(ft_tiny(gpt2_corpus, tmp_path / "a", max_steps=3, resume=True, qat=8, **kw))
    with pytest.raises(SystemExit, match=r"lora_rank=2 \(now None\)"):
        tg.main(tiny(gpt2_corpus, tmp_path / "a", max_steps=3, resume=True))
    assert ft.main(ft_tiny(gpt2_corpus, tmp_path / "a", max_steps=3, resume=True, **kw))["steps"] == 3


def test_export_hf_round_trips_with_equal_logits(corpus, gpt2_corpus, tmp_path):
    """--export=hf of GPT-2 fine-tuned with LoRA on the 4-bit grid (QAT) writes config.json and model.safetensors
    with the 320 real vocabulary rows, not the 384 padded ones; imported back as GPT-2, its logits are those of the
    model as it trained (adapters beside the frozen rounded weights). The suite's own shape goes out as StableLM."""
    from safetensors.torch import load_file
    gpt2_folder(tmp_path / "gpt2")
    ft.main(ft_tiny(gpt2_corpus, tmp_path / "run", init_from=str(tmp_path / "gpt2"), lora_rank=2, qat=4, max_steps=3,
                    lr=1e-2, batch_size=2))
    r = ft.main(ft.Config(export="hf", ckpt=str(tmp_path / "run"), out_dir=str(tmp_path / "hf")))
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (conf["model_type"], conf["vocab_size"], conf["n_positions"], conf["n_layer"]) == ("gpt2", 320, 32, 2)
    assert load_file(tmp_path / "hf" / "model.safetensors")["transformer.wte.weight"].shape == (320, GPT2["n_embd"])
    ckpt, _ = tg.load_checkpoint(str(tmp_path / "run"))
    cfg = ft.Config(**ckpt["config"])
    trained = tg.build_model(cfg, 320, torch.device("cpu"))  # the model as it trained: QAT layers inside LoRA
    ft.swap_layers(trained, ("attn", "mlp"), lambda layer: ft.QATLinear(layer, 4))
    ft.add_lora(trained, cfg).load_state_dict(ckpt["model"])
    back = ft.from_pretrained(r["path"])
    idx = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert back.cfg.seq_len == 32 and (back(idx) - trained.eval()(idx)).abs().max() < 1e-5
        assert (back(idx) - ft.from_pretrained(str(tmp_path / "gpt2"))(idx)).abs().max() > 1e-3  # it learned
    # the suite's own shape (without the value embeddings, which no transformers class has) goes out as another class
    tg.main(tiny(corpus, tmp_path / "rope", max_steps=1, value_embeds=False))
    r = ft.main(ft.Config(export="hf", ckpt=str(tmp_path / "rope"), out_dir=str(tmp_path / "hf2")))
    assert r["architecture"] == "StableLmForCausalLM"


def test_export_hf_loads_in_transformers(gpt2_corpus, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only oracle, not installed here")
    gpt2_folder(tmp_path / "gpt2")
    ft.main(ft_tiny(gpt2_corpus, tmp_path / "run", init_from=str(tmp_path / "gpt2"), max_steps=2, lr=1e-2,
                    optimizer="adamw", batch_size=2))
    ft.main(ft.Config(export="hf", ckpt=str(tmp_path / "run"), out_dir=str(tmp_path / "hf")))
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    ours = ft.load_model(str(tmp_path / "run"), torch.device("cpu"))[0]
    idx = torch.randint(0, GPT2["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        diff = ours(idx) - theirs(idx).logits
        assert diff.abs().max() < 1e-4
        assert (ours(idx) - ft.from_pretrained(str(tmp_path / "gpt2"))(idx)).abs().max() > 1e-3  # it learned


def test_the_docstring_commands_parse():
    """Every command finetune_gpt.py's docstring shows parses under its parser (torchrun's too): a flag renamed or
    gone fails here, as the README's commands do in test_readme."""
    from commands import run_command
    lines = [ln.split("  #")[0] for ln in ft.__doc__.splitlines() if ln.startswith(("  python", "  torchrun"))]
    assert len(lines) >= 9, lines
    for argv in (shlex.split(ln) for ln in lines if not ln.rstrip().endswith(" -h")):
        assert run_command(argv, execute=False) is not None, argv


@pytest.fixture(scope="module")
def bpe_corpus(tmp_path_factory):
    """Python-like text as prepare_data.py's own byte-level BPE of 400 tokens, whole files held out for val."""
    from conftest import python_like_docs
    src = tmp_path_factory.mktemp("bpe_src")
    for i, doc in enumerate(python_like_docs(80, 3)):
        (src / f"m{i}.py").write_text(doc + "\nname = 'héllo wörld'  # ünïcödé, tabs\t and  spaces\n")
    out = tmp_path_factory.mktemp("bpe")
    import prepare_data
    prepare_data.main(["text", str(src), f"--data_dir={out}", "--val_percent=20", "--tokenizer=bpe:400"])
    return out


def random_run(corpus, out, **kw):
    """A one-step run whose weights are then all random, norm gains around 1 (its init leaves the output projections
    and head at zero): an export matches it only if every tensor is mapped to its place."""
    tg.main(tiny(corpus, out, max_steps=1, dtype="float32", **{"value_embeds": False, **kw}))
    path = tg.list_checkpoints(str(out))[-1][1]
    ckpt, g = torch.load(path, weights_only=True), torch.Generator().manual_seed(7)
    ckpt["model"] = {k: torch.randn(v.shape, generator=g) * 0.3 + (k.endswith("norm.weight") or "norm1" in k or
                     "norm2" in k) * (not k.endswith("bias")) for k, v in ckpt["model"].items()}
    torch.save(ckpt, path)
    return out


# the suite's shapes, each with the transformers class that must compute it (value embeddings, the CPU default's,
# have none: random_run turns them off): the CPU default (LayerNorm, QK-norm,
# SwiGLU, RoPE, untied), GQA, tied embeddings, muP, no QK-norm, and the GPT-2 presets' RMSNorm at GPT-2's vocabulary
SHAPES = [({}, "StableLmForCausalLM"), ({"n_kv_head": 2}, "StableLmForCausalLM"),
          ({"tie_embeddings": True, "qk_norm": False}, "StableLmForCausalLM"),
          ({"mup": True, "base_width": 32}, "StableLmForCausalLM"),
          ({"norm": "rmsnorm", "n_kv_head": 2}, "Qwen3ForCausalLM"),
          ({"norm": "rmsnorm", "qk_norm": False, "mup": True, "base_width": 16}, "LlamaForCausalLM"),
          ({"norm": "rmsnorm", "vocab_size": 50257, "n_layer": 1}, "Qwen3ForCausalLM")]


@pytest.mark.parametrize("kw, arch", SHAPES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items())
                         if isinstance(s, dict) else s)
def test_export_hf_of_the_suites_own_shapes_loads_and_matches(bpe_corpus, tmp_path, kw, arch):
    """--export=hf maps each shape the suite trains onto a transformers class that loads with no code of ours: the
    logits equal ours to 1e-4 (fp32, CPU) on random weights, and greedy continuation is the same text."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only oracle, not installed here")
    run = random_run(bpe_corpus, tmp_path / "run", **kw)
    r = ft.main(ft.Config(export="hf", ckpt=str(run), out_dir=str(tmp_path / "hf")))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ours = ft.load_model(str(run), torch.device("cpu"))[0]
    assert r["architecture"] == type(theirs).__name__ == arch
    idx = torch.randint(0, ours.vocab_size, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = ours(idx), theirs(idx).logits
        assert a.shape == b.shape and (a - b).abs().max() < 1e-4 and a.std() > 0.1
        greedy = theirs.generate(idx[:1, :8], max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert greedy.tolist() == ours.generate(idx[:1, :8], 12, temperature=0).tolist()


def test_export_hf_tokenizer_encodes_as_prepare_data_did(bpe_corpus, corpus, tmp_path, monkeypatch):
    """The exported tokenizer.json, through AutoTokenizer, gives the ids prepare_data.py wrote for the val split (the
    suite's BPE) and a byte run's ids; GPT-2 tokens get GPT-2's ranks (here a stand-in encoding named gpt2)."""
    transformers = pytest.importorskip("transformers", reason="transformers is a test-only oracle, not installed here")
    import prepare_data
    import tiktoken
    import tiktoken.load
    for data, name in ((bpe_corpus, "bpe"), (corpus, "byte")):
        tg.main(tiny(data, tmp_path / name, max_steps=1, value_embeds=False))
        ft.main(ft.Config(export="hf", ckpt=str(tmp_path / name), out_dir=str(tmp_path / f"hf_{name}")))
        tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / f"hf_{name}"))
        ids = prepare_data.read_shard(next((data).glob("val_*.bin"))).tolist()
        eot = json.loads((data / "meta.json").read_text())["eot_id"]
        docs, cur = [], []
        for i in ids + [eot]:  # the val split is EOT, doc, EOT, doc, ...
            if i == eot and cur:
                docs.append(cur)
            cur = [] if i == eot else cur + [i]
        assert len(docs) > 3 and all(tok(tok.decode(d))["input_ids"] == d for d in docs)
        assert tok.eos_token_id == eot and tok.convert_ids_to_tokens(eot) == "<|endoftext|>"
    bpe = json.loads((bpe_corpus / "meta.json").read_text())
    enc = tiktoken.Encoding("gpt2", pat_str=bpe["pat_str"], mergeable_ranks=tiktoken.load.load_tiktoken_bpe(
        str(bpe_corpus / "tokenizer.tiktoken")), special_tokens={"<|endoftext|>": bpe["eot_id"]})
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: enc)
    text = "def área(x):\n    return x * 2  # ünïcödé\n\n\n"
    spec = ft.hf_tokenizer({"tokenizer": "gpt2", "eot_id": bpe["eot_id"]}, "x")
    (tmp_path / "tj").mkdir()
    (tmp_path / "tj" / "tokenizer.json").write_text(json.dumps(spec))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tj" / "tokenizer.json"))
    assert tok(text)["input_ids"] == enc.encode_ordinary(text)


@pytest.mark.parametrize("kw, flag", [({"logit_softcap": 30.0}, "--logit_softcap=30.0"), ({"window": 8}, "--window=8"),
                                      ({"mlp": "relu2"}, "--mlp=relu2"), ({"pos_emb": "learned"}, "--pos_emb=learned"),
                                      ({"bias": True}, "--bias=True"), ({}, "--value_embeds=True")])
def test_export_hf_refuses_what_no_transformers_model_computes(corpus, tmp_path, kw, flag):
    """A flag with no equivalent in the classes we export to stops the export in one line that names it, and
    nothing is written."""
    tg.main(tiny(corpus, tmp_path / "run", max_steps=1, **kw))
    with pytest.raises(SystemExit) as e:
        ft.main(ft.Config(export="hf", ckpt=str(tmp_path / "run"), out_dir=str(tmp_path / "hf")))
    assert flag in str(e.value) and "\n" not in str(e.value) and not (tmp_path / "hf").exists()
