"""Real sizes: the code paths users meet, at the sizes they meet them, on small models. GPT-2's vocabulary (50,257,
not a multiple of 64) and context (1,024) on a 2-layer, 64-wide GPT-2 (finetune_gpt.py); nanoGPT's three data layouts;
finetune_gpt.py --init_from with a longer context, resumed; and the boundaries around them, each ending in training or
in one line."""
import json
import math
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import finetune_gpt as ft
import sample_gpt
import train_gpt as tg
from conftest import python_like_docs
from test_finetune import ft_tiny, gpt2_corpus, gpt2_folder, gpt2_reference  # noqa: F401 - gpt2_corpus is a fixture
from test_train_gpt import losses, tiny

REAL = dict(vocab_size=50257, n_positions=1024, n_embd=64, n_layer=2, n_head=2, layer_norm_epsilon=1e-5)
CPU = dict(device="cpu", compile="false", dtype="float32")


@pytest.fixture(scope="module")
def real_gpt2(tmp_path_factory):
    """(folder, tensors) of a GPT-2 of the real vocabulary and context whose logits all sit near -60."""
    path = tmp_path_factory.mktemp("real") / "gpt2"
    return path, gpt2_folder(path, conf=REAL, far_below_zero=True)


def test_gpt2_loss_at_its_real_vocabulary_is_its_own(real_gpt2):
    """The padding of 50,257 to 50,304 rows never shows: logits have 50,257 columns and the loss is the reference
    forward's cross-entropy. Zero padding rows in the loss put it about 50 nats too high here."""
    path, w = real_gpt2
    model = ft.from_pretrained(str(path))
    idx = torch.randint(0, REAL["vocab_size"], (1, 1025), generator=torch.Generator().manual_seed(0))
    x, y = idx[:, :-1], idx[:, 1:]
    with torch.no_grad():
        logits, ref = model(x), gpt2_reference(w, x, REAL)
        loss, want = model(x, y).item(), F.cross_entropy(ref.flatten(0, 1), y.flatten()).item()
    assert logits.shape == ref.shape == (1, 1024, 50257) and ref.max() < -50  # as a trained GPT-2's logits
    assert (logits - ref).abs().max() < 1e-3 and loss == pytest.approx(want, abs=1e-3)
    assert model.wte.weight.shape[0] == 50304  # the padding is there, for fast matmuls
    transformers = pytest.importorskip("transformers", reason="transformers is an optional oracle, not installed here")
    with torch.no_grad():
        theirs = transformers.GPT2LMHeadModel.from_pretrained(str(path)).eval()(idx[:, :-1], labels=idx[:, :-1]).loss
    assert model(idx[:, :-2], idx[:, 1:-1]).item() == pytest.approx(theirs.item(), abs=1e-3)


def first_batch_loss(w, data, T):
    """The reference GPT-2's loss on the first training batch of one row that train_gpt.py reads from data."""
    loader = tg.TokenLoader(tg.find_shards(str(data), "train"), 1, T, 0, 1, torch.device("cpu"),
                            seed=tg.Config().seed)  # the trainer's default seed: its order of rows
    x, y = loader.next()
    with torch.no_grad():
        return F.cross_entropy(gpt2_reference(w, x, REAL).flatten(0, 1), y.flatten()).item()


def test_fine_tuning_lora_distillation_and_export_start_from_gpt2s_loss(real_gpt2, gpt2_corpus, tmp_path):
    """Every path that takes a loss over imported weights, at GPT-2's vocabulary and context: fine-tuning, LoRA and
    distillation start at the reference loss (half of it with weight 0.5 on a KL to itself), and the val loss that
    --export=int8 prints is GPT-2's order of loss, ln(50,257) = 10.8, not 60."""
    path, w = real_gpt2
    want = first_batch_loss(w, gpt2_corpus, 1024)
    flags = ["--preset=finetune", f"--init_from={path}", f"--data_dir={gpt2_corpus}", "--seq_len=1024",
             "--batch_size=1", "--max_steps=2", "--log_every=1", "--eval_every=2", "--eval_tokens=2048",
             "--sample_tokens=8"] + [f"--{k}={v}" for k, v in CPU.items()]
    for name, extra, scale in (("ft", [], 1.0), ("lora", ["--lora_rank=2"], 1.0),
                               ("kd", [f"--teacher={path}", "--distill_weight=0.5"], 0.5)):
        ft.main(tg.parse_args(ft.Config, flags + extra + [f"--out_dir={tmp_path / name}"]))
        assert losses(tmp_path / name)[1] == pytest.approx(scale * want, abs=1e-3), name
    r = ft.main(ft.Config(export="int8", ckpt=str(tmp_path / "ft"), out_dir=str(tmp_path / "q"),
                          data_dir=str(gpt2_corpus), device="cpu"))
    assert abs(r["float_val_loss"] - want) < 1.0 and abs(r["int8_val_loss"] - r["float_val_loss"]) < 0.05


def write_nanogpt(path, layout):
    """nanoGPT's layout: train.bin and val.bin of raw uint16, and meta.pkl as its preparers write it: characters
    (stoi/itos), a vocab_size alone (here bytes), or none (GPT-2 tokens; here byte values, which are GPT-2 ids too)."""
    path.mkdir()
    text = "\n".join(python_like_docs(200, 0))
    if layout == "chars":
        chars = sorted(set(text))
        stoi = {c: i for i, c in enumerate(chars)}
        ids, meta = [stoi[c] for c in text], {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}
    else:
        ids, meta = list(text.encode()), {"vocab_size": 256} if layout == "bytes" else None
    ids = np.array(ids, dtype=np.uint16)
    ids[:len(ids) * 9 // 10].tofile(path / "train.bin")
    ids[len(ids) * 9 // 10:].tofile(path / "val.bin")
    if meta:
        with open(path / "meta.pkl", "wb") as f:
            pickle.dump(meta, f)
    return text


@pytest.mark.parametrize("layout, tokenizer, vocab", [("chars", "chars", None), ("bytes", "byte", 256),
                                                      ("gpt2", "gpt2", 50257)])
def test_nanogpt_layouts_train_past_evals_with_samples(layout, tokenizer, vocab, tmp_path, capsys, monkeypatch):
    """Each of nanoGPT's layouts loads as nanoGPT reads it and trains to its end with a sample at every eval; the
    checkpoint samples too. Before, a vocab_size-only meta.pkl crashed in the embedding at the first sample (GPT-2's
    end-of-text id 50256 in a 256-token model) and characters stopped there for want of a start token."""
    import tiktoken

    def offline(name):
        raise OSError("offline")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)  # no network: GPT-2 samples show token ids
    text = write_nanogpt(tmp_path / "d", layout)
    meta = tg.load_meta(str(tmp_path / "d"))
    assert meta["tokenizer"] == tokenizer and meta["vocab_size"] == (vocab or len(set(text)))
    r = tg.main(tiny(tmp_path / "d", tmp_path / "out", max_steps=6, eval_every=3, sample_tokens=12, seq_len=64,
                     eval_tokens=1024))
    assert r["steps"] == 6 and math.isfinite(r["val_loss"])
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        assert [m["step"] for m in map(json.loads, f) if "val_loss" in m] == [0, 3, 6]  # step 0's eval: issue 59
    samples = capsys.readouterr().out.split("-" * 40 + "\n")[1::2]
    assert len(samples) == 3 and all(s.strip() for s in samples)
    if layout == "chars":
        assert set(samples[0]) <= set(text) | {"\n"}
    out = sample_gpt.main(sample_gpt.Config(ckpt=str(tmp_path / "out"), max_new_tokens=10, device="cpu"))
    assert len(out["ids"]) == 1 + 10  # a newline (or token 0) to start from, then 10 more


def test_init_from_a_checkpoint_at_a_longer_context_resumes_exactly(corpus, tmp_path):
    """RoPE has no length limit: --init_from a run at 32 tokens trains at 64, and that run resumes exactly.
    Learned positions (GPT-2's) are a table: longer than it stops in one line, shorter cuts it."""
    tg.main(tiny(corpus, tmp_path / "a", max_steps=6))
    kw = dict(init_from=str(tmp_path / "a"), seq_len=64, save_every=3, keep_last=5)
    ra = ft.main(ft_tiny(corpus, tmp_path / "b", max_steps=6, **kw))
    (tmp_path / "b" / "ckpt_0000006.pt").unlink()  # back to step 3, then on to 6 again
    rb = ft.main(ft_tiny(corpus, tmp_path / "b", max_steps=6, resume=True, **kw))
    assert rb["train_loss"] == ra["train_loss"] and rb["val_loss"] == ra["val_loss"]
    assert tg.load_checkpoint(str(tmp_path / "b"))[0]["config"]["seq_len"] == 64
    tg.main(tiny(corpus, tmp_path / "learned", max_steps=2, pos_emb="learned"))
    with pytest.raises(SystemExit) as e:
        ft.main(ft_tiny(corpus, tmp_path / "c", max_steps=2, init_from=str(tmp_path / "learned"), seq_len=64))
    assert "--seq_len=64 is longer than the 32 positions" in str(e.value) and "\n" not in str(e.value)
    r = ft.main(ft_tiny(corpus, tmp_path / "d", max_steps=2, init_from=str(tmp_path / "learned"), seq_len=16))
    assert r["steps"] == 2


def test_gpt2_longer_than_its_positions_is_one_line(real_gpt2, gpt2_corpus, tmp_path):
    with pytest.raises(SystemExit) as e:
        ft.main(ft_tiny(gpt2_corpus, tmp_path / "o", max_steps=1, init_from=str(real_gpt2[0]), seq_len=2048))
    assert "--seq_len=2048 is longer than the 1024 positions" in str(e.value) and "\n" not in str(e.value)


def test_data_boundaries_end_in_training_or_one_line(tmp_path):
    """An empty val split stops in one line; a val split shorter than one batch, and rows longer than any
    document, train; a prompt with no token of the vocabulary stops in one line; token ids prompt an ids model."""
    write_nanogpt(tmp_path / "d", "chars")
    (tmp_path / "d" / "val.bin").write_bytes(b"")
    with pytest.raises(SystemExit) as e:
        tg.main(tiny(tmp_path / "d", tmp_path / "o", max_steps=1))
    assert "val.bin is empty" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "d" / "val.bin").write_bytes((np.arange(100) % 20).astype(np.uint16).tobytes())
    r = tg.main(tiny(tmp_path / "d", tmp_path / "o", max_steps=2, seq_len=64, batch_size=8))  # 100 val tokens
    assert r["steps"] == 2 and math.isfinite(r["val_loss"])
    with pytest.raises(SystemExit) as e:  # resuming a complete run: its budget must grow
        tg.main(tiny(tmp_path / "d", tmp_path / "o", max_steps=2, seq_len=64, batch_size=8, resume=True))
    assert "is complete at step 2; raise its budget" in str(e.value) and "\n" not in str(e.value)
    assert tg.main(tiny(tmp_path / "d", tmp_path / "o", max_steps=3, seq_len=64, batch_size=8, resume=True))["steps"] == 3
    write_nanogpt(tmp_path / "d2", "chars")
    r = tg.main(tiny(tmp_path / "d2", tmp_path / "long", max_steps=2, seq_len=512, batch_size=1))  # docs: ~150 chars
    assert r["steps"] == 2
    with pytest.raises(SystemExit) as e:
        sample_gpt.main(sample_gpt.Config(ckpt=str(tmp_path / "o"), prompt="\u00e9\u00e9", device="cpu"))
    assert "none of its characters is in the chars vocabulary" in str(e.value) and "\n" not in str(e.value)
    write_nanogpt(tmp_path / "ids", "bytes")
    with open(tmp_path / "ids" / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 300}, f)
    tg.main(tiny(tmp_path / "ids", tmp_path / "ids_out", max_steps=1))
    out = sample_gpt.main(sample_gpt.Config(ckpt=str(tmp_path / "ids_out"), prompt="17 42", max_new_tokens=3,
                            device="cpu"))
    assert out["ids"][:2] == [17, 42] and len(out["text"].split()) == 5


def test_a_failing_sample_or_statistic_is_a_warning(corpus, tmp_path, monkeypatch, capsys):
    """Side paths never end a run: each failure is one warning line, and the run trains to its end and saves."""
    def boom(*args):
        raise RuntimeError("boom")
    for name in ("sample", "layer_stats"):
        monkeypatch.setattr(tg, name, boom)
    r = tg.main(tiny(corpus, tmp_path / "o", max_steps=4, eval_every=2, sample_tokens=5))
    assert r["steps"] == 4 and [s for s, _ in tg.list_checkpoints(str(tmp_path / "o"))] == [4]
    err = capsys.readouterr().err
    for what in ("sampling", "layer statistics"):
        assert f"warning: {what} failed, training goes on: boom" in err
