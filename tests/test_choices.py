"""Multiple-choice evaluation (eval_gpt.py, HellaSwag's format): the packed scorer against a reference written from
the definition, then end to end on a run's checkpoints, on two ranks, and on a GPT-2 folder."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

import eval_gpt
import finetune_gpt as ft
import ranks
import train_gpt as tg
from conftest import hellaswag_items, write_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BYTES = {"tokenizer": "byte", "eot_id": 256}


def reference(model, items):
    """(acc, acc_norm, [(summed loss, tokens)] per ending) by the definition: one plain forward per (context,
    ending), no packing, no padding, no cache; the loss over the ending's tokens only."""
    hits, per_ending = [0, 0], []
    for ctx, ends, label in items:
        sums, means = [], []
        for e in ends:
            ids = torch.tensor([ctx + e])
            with torch.no_grad():
                logp = F.log_softmax(model(ids[:, :-1]).float(), -1)[0]  # (T - 1, V): position t predicts t + 1
            nll = -logp[len(ctx) - 1:].gather(1, ids[0, len(ctx):, None]).squeeze(1)  # the ending's tokens
            sums.append(nll.sum().item())
            means.append(nll.mean().item())
            per_ending.append((nll.sum().item(), len(e)))
        hits[0] += min(range(len(ends)), key=sums.__getitem__) == label
        hits[1] += min(range(len(ends)), key=means.__getitem__) == label
    return hits[0] / len(items), hits[1] / len(items), per_ending


def random_gpt(vocab_size, **kw):
    """A GPT with every weight random (a fresh one's zero head would tie every ending)."""
    cfg = tg.Config(**{"n_layer": 2, "n_head": 2, "n_embd": 32, "seq_len": 128, **kw})
    model = tg.build_model(cfg, vocab_size, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


def write_items(path, items):
    path.write_text("".join(json.dumps(it) + "\n" for it in items))
    return path


@pytest.mark.parametrize("vocab_size", [257, 50257])  # bytes; GPT-2's vocabulary, padded to 50,304 rows
def test_scorer_equals_the_definition(vocab_size):
    """The packed scorer (items of unequal lengths in one right-padded forward) gives each ending the loss of a plain
    forward over context + ending, counts only the ending's tokens, and so the same acc and acc_norm."""
    encode = tg.load_tokenizer(BYTES)[0]
    items = [(encode(it["ctx"]), [encode(" " + e) for e in it["endings"]], it["label"]) for it in hellaswag_items(24)]
    model = random_gpt(vocab_size)
    acc, acc_norm, per_ending = reference(model, items)
    rows = [(c + e, len(e)) for c, ends, _ in items for e in ends]
    total, count = eval_gpt.choice_losses(model, rows, tg.contextlib.nullcontext(), torch.device("cpu"))
    assert count.tolist() == [n for _, n in per_ending]  # the ending's tokens, not the context's nor the padding
    torch.testing.assert_close(total, torch.tensor([s for s, _ in per_ending]), rtol=1e-4, atol=1e-4)
    rec = eval_gpt.score_choices(model, items, tg.contextlib.nullcontext(), 128, 0, 1, torch.device("cpu"), "mc", per_batch=5)
    assert (rec["mc_acc"], rec["mc_acc_norm"], rec["mc_items"]) == (acc, acc_norm, 24)
    assert acc != acc_norm or len({round(s, 3) for s, _ in per_ending}) > 1  # the two scores are not one in disguise


def test_read_choices_takes_a_folder_and_refuses_bad_lines(tmp_path):
    encode = tg.load_tokenizer(BYTES)[0]
    write_items(tmp_path / "hellaswag_val.jsonl", hellaswag_items(3))
    assert len(eval_gpt.read_choices(str(tmp_path), encode)) == 3
    bad = tmp_path / "bad.jsonl"
    for line in ('{"ctx": "a", "endings": [], "label": 0}', '{"ctx": "a"}', "not json"):
        bad.write_text(json.dumps(hellaswag_items(1)[0]) + "\n" + line + "\n")
        with pytest.raises(SystemExit, match=r"bad.jsonl:2: not a multiple-choice item; each line needs"):
            eval_gpt.read_choices(str(bad), encode)
    bad.write_text('{"ctx": "a", "endings": ["b", "c"], "label": 2}\n')  # issue 80: the shape is right, the label not
    with pytest.raises(SystemExit, match=r"bad.jsonl:1: label 2 is not an index of its 2 endings \(0..1\)$"):
        eval_gpt.read_choices(str(bad), encode)
    with pytest.raises(SystemExit, match="2 .jsonl files there; name one"):
        eval_gpt.read_choices(str(tmp_path), encode)


def test_a_run_scored_on_its_checkpoints_and_on_two_ranks(tmp_path):
    """HellaSwag-format items scored on a run's checkpoint, in one process and in two (items sharded, counts
    all-reduced), and on each checkpoint the run kept (--every_checkpoint): all equal the reference."""
    data, mc = write_corpus(tmp_path / "data"), write_items(tmp_path / "mc.jsonl", hellaswag_items(37))
    out = tmp_path / "run"
    cfg = tg.Config(n_layer=2, n_head=2, n_embd=32, seq_len=64, batch_size=8, max_steps=6, eval_every=3, log_every=3,
                    sample_tokens=0, device="cpu", dtype="float32", compile="false", data_dir=str(data),
                    out_dir=str(out), save_every=3)
    tg.main(cfg)
    model, tok, _, _ = ft.load_model(str(out), torch.device("cpu"))
    encode = tg.load_tokenizer(tok)[0]
    items = [(encode(it["ctx"]), [encode(" " + e) for e in it["endings"]], it["label"]) for it in hellaswag_items(37)]
    acc, acc_norm, _ = reference(model, items)
    one = eval_gpt.main(eval_gpt.Config(ckpt=str(out), items=str(mc), device="cpu", dtype="float32"))
    assert (one["mc_acc"], one["mc_acc_norm"], one["mc_items"]) == (acc, acc_norm, 37)
    every = eval_gpt.main(eval_gpt.Config(ckpt=str(out), items=str(mc), device="cpu", dtype="float32",
                                          every_checkpoint=True))
    assert every == one  # the last of steps 3 and 6 is the newest checkpoint
    two = ranks.run([os.path.join(ROOT, "eval_gpt.py"), f"--ckpt={out}", f"--items={mc}", "--device=cpu",
                     "--dtype=float32"], timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    assert f"acc_norm {acc_norm:.2%} | acc {acc:.2%} | 37 items" in two.stdout, two.stdout
    assert two.stdout.count("ckpt_0000006") == 1 and "ckpt_0000003" not in two.stdout


def test_an_item_with_an_empty_context_starts_at_the_end_of_text_token(tmp_path):
    """Issue 61: an item whose "ctx" is empty crashed the scorer with a shape error; its endings are now scored after
    the end-of-text token, as lm-evaluation-harness does, and without one it is refused in one line."""
    items = hellaswag_items(3)
    items[1]["ctx"] = ""
    path = write_items(tmp_path / "mc.jsonl", items)
    encode = tg.load_tokenizer(BYTES)[0]
    read = eval_gpt.read_choices(str(path), encode, eot=256)
    assert read[1][0] == [256] and read[1][1][0] == encode(" " + items[1]["endings"][0])
    rec = eval_gpt.score_choices(random_gpt(257), read, tg.contextlib.nullcontext(), 128, 0, 1, torch.device("cpu"),
                                 "mc")
    assert rec["mc_items"] == 3
    with pytest.raises(SystemExit, match=r"mc.jsonl:2: the context is empty and this tokenizer has no end-of-text"):
        eval_gpt.read_choices(str(path), encode, eot=None)


def test_the_old_flags_name_the_new_commands():
    """train_gpt.py and finetune_gpt.py --sample and --eval_only moved to sample_gpt.py and eval_gpt.py: each old flag
    stops in one line that names the new command."""
    import finetune_gpt as ft
    for cls, flag, new in ((tg.Config, "--sample", "sample_gpt.py"), (tg.Config, "--eval_only", "eval_gpt.py"),
                           (tg.Config, "--eval_mc=x", "eval_gpt.py"), (ft.Config, "--sample", "sample_gpt.py --ckpt=gpt2"),
                           (ft.Config, "--eval_only", "eval_gpt.py --ckpt=gpt2")):
        with pytest.raises(SystemExit) as e:
            tg.parse_args(cls, [flag])
        assert f"{flag.split('=')[0]} moved: python {new}" in str(e.value) and "\n" not in str(e.value)


def test_eval_only_on_a_gpt2_folder_made_by_transformers(tmp_path, monkeypatch):
    """eval_gpt.py --ckpt=FOLDER scores GPT-2 as transformers' GPT2LMHeadModel does."""
    transformers = pytest.importorskip("transformers")
    import tiktoken

    import finetune_gpt as ft
    ranks = {bytes([i]): i for i in range(256)} | {bytes([i % 256, i // 256]): 256 + i for i in range(50000)}
    stand_in = tiktoken.Encoding("gpt2", pat_str=r"\S+|\s+", mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": 50256})  # GPT-2's files are a download
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: stand_in)
    torch.manual_seed(0)
    conf = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=128, vocab_size=50257)
    hf = transformers.GPT2LMHeadModel(conf).eval()
    hf.save_pretrained(tmp_path / "gpt2")
    mc = write_items(tmp_path / "mc.jsonl", hellaswag_items(16))
    items = [(stand_in.encode_ordinary(it["ctx"]), [stand_in.encode_ordinary(" " + e) for e in it["endings"]],
              it["label"]) for it in hellaswag_items(16)]
    acc, acc_norm, _ = reference(lambda idx: hf(idx).logits, items)
    rec = eval_gpt.main(eval_gpt.Config(ckpt=str(tmp_path / "gpt2"), items=str(mc), device="cpu", dtype="float32"))
    assert (rec["mc_acc"], rec["mc_acc_norm"], rec["mc_items"]) == (acc, acc_norm, 16)
