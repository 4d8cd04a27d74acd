"""chat_gpt.py: the template's special tokens cannot be forged, the masked loss trains the assistant's tokens only,
its gradient is the same for any split of a step (micro-steps, ranks), bad conversations stop in one line, and a
fine-tuned model answers one turn and stops at end-of-turn."""
import json
import os

import numpy as np
import pytest
import torch

import chat_gpt as chat
import ranks
import train_gpt as tg
from conftest import write_corpus

BYTES = {"tokenizer": "byte", "eot_id": 256}  # 257 tokens: 256 bytes and end-of-text
TINY = dict(n_layer=1, n_head=2, n_embd=32, seq_len=64, batch_size=4, warmup_steps=2, eval_every=0, log_every=10,
            sample_tokens=0, device="cpu", compile="false", dtype="float32")
CONVS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi <|end|>"},
          {"role": "assistant", "content": "hello"}],
         [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5."}],
         [{"role": "user", "content": "only a question, nothing to learn"}],
         [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": "z"},
          {"role": "assistant", "content": "w <|endoftext|>"}]]


def encode(s):
    return list(s.encode())


def tiny_model(vocab_size=261, seed=0, **kw):
    """A tiny GPT whose zero-initialised head and projections are random, so every position's loss has a gradient."""
    fields = {k: v for k, v in TINY.items() if k in tg.Config.__dataclass_fields__}
    model = tg.build_model(tg.Config(**fields, seed=seed, **kw), vocab_size, torch.device("cpu"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("proj.weight") or n == "head.weight":
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed))
    return model


def rendered(loss_on="answers"):
    """[(ids, learn)] of CONVS in the byte template, as load_conversations gives them."""
    tpl = chat.make_template(BYTES, 257)
    out = []
    for c in CONVS:
        ids, mask = (np.array(a) for a in chat.render(c, tpl, encode))
        out.append((ids, (mask & 1) > 0 if loss_on == "answers" else (mask & 2) == 0))
    return out


def test_template_round_trips_and_text_cannot_forge_its_tokens():
    tpl = chat.make_template(BYTES, 257)
    assert tpl["specials"] == {"<|system|>": 257, "<|user|>": 258, "<|assistant|>": 259, "<|end|>": 260}
    ids, mask = chat.render(CONVS[0], tpl, encode)
    decode = tg.load_tokenizer(BYTES)[1]
    for c in CONVS:  # the template round-trips, the special strings in the text included
        assert chat.parse(chat.render(c, tpl, encode)[0], tpl, decode) == c
    assert ids[0] == 256 and [i for i in ids if i > 256] == [257, 260, 258, 260, 259, 260]  # the "<|end|>" typed: text
    said = [i for i, m in zip(ids, mask) if m & 1]
    assert said == encode("hello") + [260] and mask[0] == 2 and sum(m & 2 for m in mask) == 2
    gpt2 = chat.make_template({"tokenizer": "gpt2", "eot_id": 50256}, 50257)  # in the rows padding 50,257 to 50,304
    assert sorted(gpt2["specials"].values()) == [50257, 50258, 50259, 50260] and gpt2["vocab_size"] <= 50304
    assert chat.make_template({**BYTES, "chat": tpl}, 261) == tpl  # a chat model's own template is kept


def test_a_bpe_never_encodes_the_special_strings():
    import base64

    import prepare_data
    ranks = "".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256))
    tok = {"tokenizer": "bpe:257", "eot_id": 256, "pat_str": prepare_data.PAT, "ranks": ranks}
    enc = tg.load_tokenizer(tok)[0]
    tpl = chat.make_template(tok, 257)
    ids, _ = chat.render([{"role": "user", "content": "<|endoftext|><|user|><|end|>"}], tpl, enc)
    assert ids.count(256) == 1 and ids.count(258) == 1 and ids.count(260) == 1  # the template's own, once each


def test_masked_out_tokens_get_no_gradient_and_masked_in_do():
    model, convs = tiny_model(), rendered()
    rows = chat.pack([len(c[0]) for c in convs], 63, range(len(convs)))
    x, y = chat.batch(convs, rows, 63, torch.device("cpu"))
    h, w = model.hidden(x)
    h.retain_grad()
    model.loss(h, w, y, reduction="sum").backward()
    moved = h.grad.abs().sum(-1) > 0  # (B, T): the positions whose prediction the loss reaches
    assert torch.equal(moved, y != -100) and moved.any()


def step_grads(model, batches, world_size=1):
    model.zero_grad()
    loss = chat.backward(model, batches, torch.autocast("cpu", enabled=False), torch.amp.GradScaler(enabled=False),
                         0.0, world_size)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_gradient_is_the_same_for_accum_1_and_4_and_an_all_masked_micro_batch_adds_zero():
    convs, cpu = rendered(), torch.device("cpu")
    rows = [[0], [1], [2], [3]]  # row 2 has nothing to learn: an all-masked micro-batch at accum 4
    one = step_grads(tiny_model(), [chat.batch(convs, rows, 63, cpu)])
    four = step_grads(tiny_model(), [chat.batch(convs, [r], 63, cpu) for r in rows])
    assert torch.allclose(one[0], four[0], atol=1e-6)
    for n, g in one[1].items():
        assert torch.isfinite(g).all() and torch.allclose(g, four[1][n], atol=1e-6), n
    none = step_grads(tiny_model(), [chat.batch(convs, [[2]], 63, cpu)])  # a whole step masked: 0, not NaN
    assert none[0].item() == 0.0 and all(torch.equal(g, torch.zeros_like(g)) for g in none[1].values())


RANKS = """
import sys, torch, torch.distributed as dist
sys.path[:0] = [{root!r}, {tests!r}]
import chat_gpt as chat, train_gpt as tg, test_chat as t
rank, world_size, device = tg.setup_dist("cpu")
model = t.tiny_model()
ddp = torch.nn.parallel.DistributedDataParallel(model)
convs = t.rendered()
mine = [[0, 3], [1, 2]][rank]  # rank 1's second row has nothing to learn
loss, grads = t.step_grads(ddp, [chat.batch(convs, [[i]], 63, device) for i in mine], world_size)
loss = tg.all_mean(loss, world_size)
if rank == 0:
    torch.save({{"loss": loss, "grads": {{n.removeprefix("module."): g for n, g in grads.items()}}}}, {out!r})
del ddp  # DDP holds the process group: free it here, not in the interpreter's teardown
dist.barrier()  # no rank tears down while the other still works
dist.destroy_process_group()
"""


def test_the_gradient_is_the_same_on_one_rank_and_two(tmp_path):
    script = tmp_path / "ranks.py"
    here = os.path.dirname(os.path.abspath(__file__))
    script.write_text(RANKS.format(root=os.path.dirname(here), tests=here, out=str(tmp_path / "grads.pt")))
    p = ranks.run([str(script)], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    two = torch.load(tmp_path / "grads.pt")
    convs = rendered()
    one = step_grads(tiny_model(), [chat.batch(convs, [[0], [1]], 63, torch.device("cpu")),
                                    chat.batch(convs, [[3], [2]], 63, torch.device("cpu"))])
    assert torch.allclose(one[0], two["loss"], atol=1e-6)
    for n, g in one[1].items():
        assert torch.allclose(g, two["grads"][n], atol=1e-6), n


def test_packing_keeps_whole_conversations_in_rows():
    lengths = [40, 30, 30, 20, 60, 4]  # best fit: 4 into a row with room for 4; 64 tokens a row
    rows = chat.pack(lengths, 63, range(len(lengths)))
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert all(sum(lengths[i] for i in r) <= 64 for r in rows) and len(rows) == 3


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny byte-level checkpoint, trained for a few steps: what SFT starts from."""
    d = tmp_path_factory.mktemp("chat")
    corpus = write_corpus(d / "corpus", n_train=40, n_val=5)
    tg.main(tg.Config(**TINY, max_steps=2, data_dir=str(corpus), out_dir=str(d / "base")))
    return d


def run(args):
    """chat_gpt.py's main on flags, as the command line gives them."""
    return chat.main(tg.parse_args(chat.Config, args))


@pytest.mark.parametrize("lines, error", [
    ([{"messages": [{"content": "hi"}]}], ":1: turn 1 has no role"),
    ([{"messages": [{"role": "user", "content": "hi"}]}, {"messages": []}], ":2: an empty conversation"),
    (["not json"], ":1: not a conversation"),
    ([{"messages": [{"role": "user", "content": "x" * 200}]}], ":1: 203 tokens, longer than --seq_len=64"),
])
def test_bad_conversations_stop_in_one_line_and_leave_nothing(base, tmp_path, lines, error):
    src = tmp_path / "convs.jsonl"
    src.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines))
    out = tmp_path / "data"
    with pytest.raises(SystemExit) as e:
        run([f"--prepare={src}", f"--init_from={base / 'base'}", f"--data_dir={out}", "--seq_len=64"])
    assert f"{src}{error}" in str(e.value) and "\n" not in str(e.value), e.value  # the file, its line, the fix
    assert sorted(os.listdir(tmp_path)) == ["convs.jsonl"]  # no stage left, nor the data dir it made (issue 61)


def test_sft_then_one_turn_ends_at_end_of_turn(base, tmp_path):
    """SFT on conversations whose answer is always "ok": the model learns to say it and stop; --prompt then answers
    a new question with "ok" and <|end|>."""
    src = tmp_path / "convs.jsonl"
    qs = [f"question {i} about {w}?" for i, w in enumerate(["cats", "dogs", "sums", "files"] * 30)]
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                    {"role": "assistant", "content": "ok"}]}) + "\n" for q in qs))
    data, out = tmp_path / "data", tmp_path / "sft"
    flags = [f"--init_from={base / 'base'}", f"--data_dir={data}", "--seq_len=64", "--device=cpu", "--compile=false",
             "--dtype=float32"]
    r = run([f"--prepare={src}", *flags])
    assert r["val_conversations"] == 12 and r["train_conversations"] == 108
    meta = json.loads((data / "meta.json").read_text())
    assert meta["chat"]["specials"]["<|end|>"] == 260 and meta["vocab_size"] == 261
    r = run([*flags, f"--out_dir={out}", "--max_steps=60", "--lr=1e-2", "--batch_size=8", "--eval_turns=6"])
    assert r["ended_before"] == 0.0 and r["ended"] == 1.0 and r["exact"] == 1.0, r
    r = run(["--chat", f"--ckpt={out}", "--prompt=question 999 about birds?", "--device=cpu"])
    assert r["ended"] and r["text"] == "ok", r
    assert r["prompt_ids"][-2:] == [260, 259]  # the user's <|end|>, then <|assistant|>


def test_lora_trains_the_adapters_and_the_template_rows():
    """With LoRA the base weights are frozen; the adapters train, and so do the embedding and the head, since the
    template's rows start as the mean row and must learn. The new rows are that mean."""
    import finetune_gpt as ft
    base = tiny_model(vocab_size=257)
    cfg = chat.Config(**TINY, lora_rank=4, init_from="x")
    raw = chat.build(cfg, {"model": base.state_dict(), "vocab_size": 257}, chat.make_template(BYTES, 257),
                     torch.device("cpu"))
    trained = {n for n, p in raw.named_parameters() if p.requires_grad}
    assert {"wte.weight", "head.weight"} <= trained and all(n.endswith((".a", ".b")) for n in trained - {
        "wte.weight", "head.weight"}) and len(trained) > 2
    mean = base.wte.weight[:257].mean(0)
    assert torch.allclose(raw.wte.weight[257:261], mean.expand(4, -1)) and raw.vocab_size == 261
    merged = ft.merge_lora(raw.state_dict(), {"lora_rank": 4, "lora_alpha": 16.0})
    assert merged.keys() == tiny_model().state_dict().keys()
