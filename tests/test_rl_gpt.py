"""rl_gpt.py: the reward reads final answers, a zero advantage teaches nothing, only answer tokens get a gradient, the
gradient is the same for any split of a step (micro-steps, ranks), batched sampling is one-at-a-time sampling, a tiny
run raises its reward, and SIGTERM then --resume gives the uninterrupted run's losses."""
import json
import os

import pytest
import torch

import chat_gpt as chat
import faults
import ranks
import rl_gpt as rl
import train_gpt as tg
from test_chat import BYTES, TINY, encode, tiny_model

CPU = torch.device("cpu")
TPL = chat.make_template(BYTES, 257)
END = TPL["specials"]["<|end|>"]
PLAIN = torch.autocast("cpu", enabled=False)
NO_SCALER = torch.amp.GradScaler(enabled=False)
QUESTIONS = ["What is 2 + 3?", "hi", "Tell me a long story about cats."]  # prompts of three lengths


def prompt(q):
    return rl.prompt_ids([{"role": "user", "content": q}], TPL, encode)


@pytest.mark.parametrize("text, answer, pattern, want", [
    ("2 + 3 = 5.", "5", rl.Config.answer_regex, 1.0),             # right
    ("2 + 3 = 6.", "5", rl.Config.answer_regex, 0.0),             # wrong
    ("2 + 3 = 5. Glad to help!", "5", rl.Config.answer_regex, 1.0),  # right, with trailing text (no number)
    ("5, or maybe 6", "5", rl.Config.answer_regex, 0.0),          # the last number counts
    ("", "5", rl.Config.answer_regex, 0.0),                        # empty
    ("37 - 48 = -11", "-11", rl.Config.answer_regex, 1.0),        # a negative answer
    ("  Paris ", "Paris", "", 1.0),                                 # no regex: the whole reply, stripped
    ("Paris, France", "Paris", "", 0.0),
])
def test_the_reward_compares_final_answers(text, answer, pattern, want):
    assert rl.reward(text, answer, pattern) == want


ANSWERS = [[1, 2, 3], [4, END], [5], [6, 7]]  # of 1 to 3 tokens, one ended
ADV = [1.0, -1.0, 0.5, -0.5]


def rows(which=range(4), adv=ADV):
    """(x, y, adv) of rows `which` of four: prompts of three lengths and ANSWERS, right-padded."""
    prompts = [prompt(q) for q in QUESTIONS + QUESTIONS[:1]]
    return rl.rows_of([prompts[i] for i in which], [ANSWERS[i] for i in which],
                      torch.tensor([adv[i] for i in which], dtype=torch.float32), CPU)


def step_grads(model, batches, world_size=1):
    model.zero_grad()
    loss = rl.backward(model, batches, PLAIN, NO_SCALER, world_size)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_zero_advantage_gives_a_zero_gradient():
    adv = rl.advantages([1.0, 1.0, 0.0, 0.0], 2, std_norm=False)  # each group scored alike
    assert torch.equal(adv, torch.zeros(4))
    assert torch.equal(rl.advantages([1.0, 0.0, 0.0, 0.0], 2, True).sign(), torch.tensor([1.0, -1.0, 0.0, 0.0]))
    loss, grads = step_grads(tiny_model(261), [rows(adv=adv.tolist())])
    assert loss.item() == 0.0 and all(torch.equal(g, torch.zeros_like(g)) for g in grads.values())
    _, grads = step_grads(tiny_model(261), [rows()])  # and a non-zero one moves every weight
    assert all(g.abs().sum() > 0 for g in grads.values())


def test_only_answer_tokens_get_a_gradient():
    x, y, adv = rows()
    for b, a in enumerate(ANSWERS):  # the targets are the answers, where they stand in each row, and nothing else
        assert y[b][y[b] != -100].tolist() == a
        start = int((y[b] != -100).nonzero()[0])  # the prompt's last input predicts the answer's first token
        assert x[b, start + 1:start + len(a)].tolist() == a[:-1]
    model, out = tiny_model(261), {}

    def keep(module, inputs, output):  # the final norm's output, (B, T, d), and its gradient
        output.retain_grad()
        out["h"] = output

    model.norm.register_forward_hook(keep)
    step_grads(model, [(x, y, adv)])
    moved = out["h"].grad.abs().sum(-1) > 0  # (B, T): the positions whose prediction the loss reaches
    assert torch.equal(moved, y != -100) and moved.any()


def test_the_gradient_is_the_same_for_accum_1_and_4():
    one = step_grads(tiny_model(261), [rows()])
    four = step_grads(tiny_model(261), [rows([b]) for b in range(4)])
    assert torch.allclose(one[0], four[0], atol=1e-6)
    for n, g in one[1].items():
        assert g.abs().sum() > 0 and torch.allclose(g, four[1][n], atol=1e-6), n


@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (1.0, 0), (0.7, 20)])
def test_batched_sampling_is_one_at_a_time_sampling(temperature, top_k):
    """Rows of three prompt lengths, three rows a prompt, through the KV cache together: each row is what
    chat_gpt.reply samples for it alone, greedily, or with a generator seeded alike."""
    # the end token's row below ends some rows early and lets others run to the end on this model, without value
    # embeddings; with them, every row ends early, and the check that some run on would not hold
    model = tiny_model(261, value_embeds=False).eval()
    prompts = [prompt(q) for q in QUESTIONS for _ in range(3)]
    with torch.no_grad():  # <|end|>'s row along the mean hidden state: some rows end early, others go on
        u = model.hidden(torch.tensor([prompts[0]]))[0][0].mean(0)
        model.head.weight[END] = u / u.norm()
    row_seeds = rl.seeds(1, 2, n=len(prompts))
    got = rl.sample(model, prompts, row_seeds, END, 20, temperature, top_k)
    for p, s, answer in zip(prompts, row_seeds, got):
        gen = torch.Generator().manual_seed(s) if temperature else None
        alone, ended = chat.reply(model, p, END, 20, temperature, top_k, gen)
        assert answer == alone + [END] * ended
    lengths = {len(a) for a in got}
    assert min(lengths) < 20 and max(lengths) == 20 or temperature == 0, lengths  # some ended, some ran to the end
    if temperature:  # a prompt's rows differ: each has its own draws
        assert any(len({tuple(a) for a in got[i:i + 3]}) > 1 for i in (0, 3, 6))


RANKS = """
import sys, torch, torch.distributed as dist
sys.path[:0] = [{root!r}, {tests!r}]
import train_gpt as tg, test_rl_gpt as t
rank, world_size, device = tg.setup_dist("cpu")
ddp = torch.nn.parallel.DistributedDataParallel(t.tiny_model(261))
mine = [[0, 3], [1, 2]][rank]  # two micro-steps of a row each; the ranks' answers differ in length
loss, grads = t.step_grads(ddp, [t.rows([i]) for i in mine], world_size)
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
    one = step_grads(tiny_model(261), [rows()])
    assert torch.allclose(one[0], two["loss"], atol=1e-6)
    for n, g in one[1].items():
        assert torch.allclose(g, two["grads"][n], atol=1e-6), n


FLAGS = ["--seq_len=64", "--device=cpu", "--compile=false", "--dtype=float32"]
LETTERS = "abcd"


def run_rl(args):
    """rl_gpt.py's main on flags, as the command line gives them."""
    return rl.main(tg.parse_args(rl.Config, [*args, *FLAGS]))


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A tiny byte-level chat model, SFT'd to answer "letter N?" with one of a, b, c, d at random and stop: a
    quarter of its answers are "a"."""
    import dataclasses
    d = tmp_path_factory.mktemp("rl")
    cfg = tg.Config(**TINY)
    base = tg.build_model(cfg, 257, CPU)
    tg.write_checkpoint(str(d / "base"), {"model": base.state_dict(), "optim": None, "step": 0, "train_time": 0.0,
                                          "history": [], "config": dataclasses.asdict(cfg),
                                          "data_info": {"vocab_size": 257}, "tokenizer": BYTES, "world_size": 1})
    convs, prompts = d / "convs.jsonl", d / "prompts.jsonl"
    q = [[{"role": "user", "content": f"letter {i}?"}] for i in range(200)]
    convs.write_text("".join(json.dumps({"messages": m + [{"role": "assistant", "content": LETTERS[i % 4]}]}) + "\n"
                             for i, m in enumerate(q)))
    prompts.write_text("".join(json.dumps({"messages": m, "answer": "a"}) + "\n" for m in q))
    sft_flags = [f"--init_from={d / 'base'}", f"--data_dir={d / 'data'}", *FLAGS]
    chat.main(tg.parse_args(chat.Config, [f"--prepare={convs}", *sft_flags]))
    chat.main(tg.parse_args(chat.Config, [*sft_flags, f"--out_dir={d / 'sft'}", "--max_steps=40", "--lr=1e-2",
                                          "--batch_size=8", "--eval_turns=4"]))
    return d


def rl_flags(d, out):
    """A tiny RL run from the SFT model: the reward is 1 for the answer "a" exactly (no regex), 16 steps of 4 prompts
    with 4 answers each."""
    return [f"--init_from={d / 'sft'}", f"--prompts={d / 'prompts.jsonl'}", f"--out_dir={out}", "--answer_regex=",
            "--max_steps=16", "--lr=1e-2", "--batch_size=4", "--samples=4", "--max_new_tokens=4", "--eval_items=8",
            "--pass_k=2", "--eval_every=0", "--save_every=0"]


def history(out):
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def uninterrupted(sft):
    r = run_rl(rl_flags(sft, sft / "rl"))
    return r, history(sft / "rl")


def test_a_tiny_run_raises_the_reward(uninterrupted):
    r, h = uninterrupted
    rewards = [x["reward"] for x in h if "reward" in x]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-4:]) / 4  # about a quarter of the SFT model's answers are "a"
    assert len(rewards) == 16 and first <= 0.4 and last >= 0.8, rewards
    assert r["pass1"] >= 0.75 and r["pass1_before"] <= 0.25, r  # the greedy answer to held-out prompts, too
    assert [x["step"] for x in h if "pass1" in x] == [0, 16] and all("answer_len" in x for x in h if "reward" in x)


def test_sigterm_then_resume_gives_the_uninterrupted_losses(sft, uninterrupted):
    import signal
    before = signal.getsignal(signal.SIGTERM)
    out = sft / "rl_stopped"
    with faults.inject(tg, "sigterm@6"):
        stopped = run_rl(rl_flags(sft, out))
    assert stopped == {"preempted": True, "steps": 6, "train_time": stopped["train_time"]}
    assert [s for s, _ in tg.list_checkpoints(str(out))] == [6] and signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(SystemExit, match="--resume"):  # a run in that folder continues only with --resume
        run_rl(rl_flags(sft, out))
    r = run_rl([*rl_flags(sft, out), "--resume"])
    want = uninterrupted[1]
    got = history(out)
    keys = ("step", "loss", "reward", "answer_len", "gnorm")
    assert [[x.get(k) for k in keys] for x in got] == [[x.get(k) for k in keys] for x in want]
    assert r["pass1"] == uninterrupted[0]["pass1"] and r["pass2"] == uninterrupted[0]["pass2"]


@pytest.mark.parametrize("line, error", [
    ("not json", ":2: not a prompt"),
    ({"messages": [{"role": "user", "content": "hi"}]}, ":2: not a prompt"),  # no answer
    ({"messages": [{"role": "user", "content": "hi"}], "answer": ""}, ':2: "answer" must be a non-empty string'),
    ({"messages": [{"role": "assistant", "content": "hi"}], "answer": "a"}, ":2: the messages must be turns"),
    ({"messages": [{"role": "user", "content": "x" * 60}], "answer": "a"}, ":2: a prompt of 64 tokens"),
])
def test_a_bad_prompt_line_stops_in_one_line(sft, tmp_path, line, error):
    src = tmp_path / "prompts.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}], "answer": "a"}
    src.write_text(json.dumps(good) + "\n" + (json.dumps(line) if isinstance(line, dict) else line) + "\n")
    with pytest.raises(SystemExit) as e:
        run_rl([f"--init_from={sft / 'sft'}", f"--prompts={src}", f"--out_dir={tmp_path / 'out'}"])
    assert f"{src}{error}" in str(e.value) and "\n" not in str(e.value), e.value  # the file, its line, the fix


def test_the_arithmetic_prompts_are_the_ones_sft_held_out(sft, tmp_path):
    """--prompts=arithmetic holds out what chat_gpt.py --prepare=arithmetic held out, whatever RL's --seed: the
    held-out prompts are the val dialogues up to their last answer, in the val split's order."""
    data = tmp_path / "arith"
    chat.main(tg.parse_args(chat.Config, ["--prepare=arithmetic", "--conversations=40", f"--init_from={sft / 'base'}",
                                          f"--data_dir={data}", "--seq_len=256"]))
    meta = json.loads((data / "meta.json").read_text())
    val = chat.load_conversations(str(data), meta, "val", "answers")
    aid = TPL["specials"]["<|assistant|>"]
    want = [ids[:max(i for i, t in enumerate(ids) if t == aid) + 1].tolist() for ids, _ in val]
    cfg = rl.Config(conversations=40, seq_len=256, seed=7)
    train, held = rl.load_items(cfg, TPL, encode)
    assert [p for p, _ in held] == want and len(train) > len(held)
    assert all(a.lstrip("-").isdigit() for _, a in train + held)  # each reference's final answer, a number


def test_the_kl_penalty_is_zero_at_the_reference_and_pulls_back_elsewhere():
    """--kl: towards a copy of the model itself, k3 and its gradient are 0 (the policy gradient alone); towards
    another model, the gradient changes."""
    import copy
    batches = [rows()]
    alone = step_grads(tiny_model(261), batches)[1]
    model = tiny_model(261)
    for ref, same in ((copy.deepcopy(model), True), (tiny_model(261, seed=1), False)):
        model.zero_grad()
        rl.backward(model, batches, PLAIN, NO_SCALER, 1, kl=0.5, ref=ref.requires_grad_(False))
        close = all(torch.allclose(p.grad, alone[n], atol=1e-7) for n, p in model.named_parameters())
        assert close == same


def test_a_crash_while_the_log_is_written_leaves_the_last_one(tmp_path, monkeypatch):
    """Issue 80: each save rewrites metrics.jsonl from the history; written beside it and renamed, a write that
    fails halfway (here: a record json cannot encode) leaves the previous log whole, and no half-written file."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "reward": 0.25}\n')
    monkeypatch.setattr(tg, "write_checkpoint", lambda *a, **kw: None)
    with pytest.raises(TypeError):
        rl.save(str(out), {"history": [{"step": 1, "reward": object()}, {"step": 2}]}, 2)
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "reward": 0.25}\n'
    assert sorted(os.listdir(out)) == ["metrics.jsonl"]
    rl.save(str(out), {"history": [{"step": 1}, {"step": 2, "reward": 0.5}]}, 2)
    assert history(out) == [{"step": 1}, {"step": 2, "reward": 0.5}]


def test_a_step_whose_groups_all_scored_alike_leaves_the_weights_alone(sft, tmp_path):
    """No answer of the SFT model is "zzz", so every answer scores 0: every advantage is 0, and so is the gradient.
    Such steps are skipped (AdamW's momentum and decay would still move the weights), and the log says why."""
    prompts = tmp_path / "never.jsonl"
    lines = (sft / "prompts.jsonl").read_text().splitlines()
    prompts.write_text("".join(json.dumps({**json.loads(x), "answer": "zzz"}) + "\n" for x in lines))
    flags = rl_flags(sft, tmp_path / "rl") + [f"--prompts={prompts}", "--max_steps=3"]
    run_rl(flags)
    h = history(tmp_path / "rl")
    assert [x["no_signal"] for x in h if "reward" in x] == [1.0, 1.0, 1.0]
    before, _ = tg.load_checkpoint(str(sft / "sft"))
    after, _ = tg.load_checkpoint(str(tmp_path / "rl"))
    assert after["step"] == 3
    assert all(torch.equal(before["model"][k], v) for k, v in after["model"].items())
