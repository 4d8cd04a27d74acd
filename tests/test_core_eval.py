"""CORE (issue 81): prepare_data.py core on a small bundle of the DCLM layout that each test writes, and
eval_gpt.py --task=core scored against references worked out by hand: the few-shot prompts as literal strings, and
each kind of task's decisions, item by item, under a stub model whose every loss the test sets. Then the whole path,
bundle to CORE, on a tiny trained GPT, against plain forwards, in one process, on each checkpoint and on two ranks."""
import csv
import hashlib
import io
import json
import math
import os
import random
import zipfile
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import eval_gpt
import prepare_data
import ranks
import train_gpt as tg
from conftest import write_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENCODE = tg.load_tokenizer({"tokenizer": "byte"})[0]  # a character a token: continuations can be read off by eye
BOS = 256  # the byte tokenizer's end-of-text token, where every CORE prompt starts

# One task of each kind. Under the stub model below, each item's answer is worked out by hand in its comment.
MC = [  # delimiter: core.yaml gives none, so llm-foundry's default, a space
    {"query": "Q0", "choices": ["aaa", "bbb"], "gold": 0},  # 'a' is the likelier letter: right
    # "b" has the lower summed loss (one token), "aaab" the lower mean (L - 1.5 against L): right only by the mean
    {"query": "Q1", "choices": ["b", "aaab"], "gold": 1},
    {"query": "Q2", "choices": ["bab", "aab"], "gold": 0},  # "aab" is likelier: wrong
    # both start with "b", which is context, not continuation: "a" (L - 2) beats "caaa" (L - 1.5); were the shared
    # "b" (L) scored too, the means would be L - 1 and L - 1.2, and the answer 1
    {"query": "Q3", "choices": ["ba", "bcaaa"], "gold": 0},
]
SCHEMA = [  # delimiter "": the options run straight into the shared continuation "zz"
    {"context_options": ["xq", "xp"], "continuation": "zz", "gold": 0},  # 'z' follows 'q': right
    {"context_options": ["xq", "xp"], "continuation": "zz", "gold": 1},  # wrong
    {"context_options": ["ap", "aq"], "continuation": "zz", "gold": 1},  # right
]
LM = [  # delimiter " ": the continuation is " " + its text, and ' ' is greedy only after '?'
    {"context": "what?", "continuation": "aaa"},  # ' ', then 'a' after ' ' and after 'a': right
    {"context": "why?", "continuation": "ab"},  # 'b' is not greedy after 'a': wrong
    {"context": "  who?  ", "continuation": "a"},  # the context's whitespace is stripped: right
    {"context": "hm", "continuation": "a"},  # after 'm' greedy is 'a', not ' ': wrong
]
RIGHT = {"mc": [True, True, False, True], "schema": [True, False, True], "lm": [True, False, True, False]}
CORE_YAML = """icl_tasks:
-
  label: mc
  dataset_uri: reasoning/mc.jsonl
  num_fewshot: [1]
  icl_task_type: multiple_choice
-
  label: schema
  dataset_uri: reasoning/schema.jsonl
  num_fewshot: [1]
  icl_task_type: schema
  continuation_delimiter: ''
-
  label: lm
  dataset_uri: language/lm.jsonl
  num_fewshot: [2]
  icl_task_type: language_modeling
  continuation_delimiter: ' '
"""
BASELINES = {"mc": 50, "schema": 50, "lm": 0}  # percent, as the bundle gives them


def write_bundle(root, mc=MC):
    """root/eval_bundle in the DCLM bundle's layout: core.yaml, eval_meta_data.csv (more columns than the baseline,
    as the real one has) and eval_data/CATEGORY/TASK.jsonl."""
    b = root / "eval_bundle"
    files = {"reasoning/mc.jsonl": mc, "reasoning/schema.jsonl": SCHEMA, "language/lm.jsonl": LM}
    for name, items in files.items():
        (b / "eval_data" / name).parent.mkdir(parents=True, exist_ok=True)
        (b / "eval_data" / name).write_text("".join(json.dumps(it) + "\n" for it in items))
    (b / "core.yaml").write_text(CORE_YAML)
    with open(b / "eval_meta_data.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Eval Task", "Task Category", "Task Type", "#shots", "#datapoints", "Random baseline"])
        for label, base in BASELINES.items():
            w.writerow([label, "test", "test", 0, 0, base])
    return b


def zip_bundle(folder, path, leave_out=()):
    """path: a zip of folder (an eval_bundle/) as the published one is, members stored uncompressed."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for f in sorted(folder.rglob("*")):
            name = f"eval_bundle/{f.relative_to(folder).as_posix()}"
            if f.is_file() and name not in leave_out:
                z.write(f, name)
    return path


class Bigram(torch.nn.Module):
    """A stub model whose logits at a position are a row of a table, picked by the token there: a bigram model,
    so that every loss is the test's to set. Logits in every row: 2 for 'a', 0 for the rest; after 'q', 6 for 'z';
    after '?', 6 for ' '. So greedy decoding gives 'z' after 'q', ' ' after '?' and 'a' everywhere else."""

    def __init__(self, seq_len=1024):
        super().__init__()
        self.table = torch.zeros(257, 257)
        self.table[:, ord("a")] = 2.0
        self.table[ord("q"), ord("z")] = 6.0
        self.table[ord("?"), ord(" ")] = 6.0
        self.cfg = SimpleNamespace(seq_len=seq_len)

    def hidden(self, idx):
        return self.table[idx], torch.eye(257)  # (B, T, 257), a head that passes the row through

    def logits(self, h, w):
        return F.linear(h, w).float()


L = math.log(256 + math.exp(2))  # the loss of any letter but 'a' after a plain letter; 'a' costs L - 2


def test_few_shot_examples_are_nanochats_draw():
    """Item i's examples: nanochat's draw, random.Random(1234 + i).sample of the list of every other index,
    which few_shot makes without building that list."""
    for n, shots in ((2, 1), (7, 3), (50, 10), (2000, 10)):
        for i in (0, 1, n // 2, n - 1):
            others = [j for j in range(n) if j != i]
            assert eval_gpt.few_shot(n, i, shots) == random.Random(1234 + i).sample(others, shots)
    assert eval_gpt.few_shot(5, 2, 0) == []


def test_prompts_render_the_few_shot_examples_first():
    """Each kind's texts, few-shot examples solved and a blank line after each, written out by hand."""
    mc = eval_gpt.core_prompts("multiple_choice", MC[0], [MC[2], MC[1]], "\nA: ")
    assert mc == ["Q2\nA: bab\n\nQ1\nA: aaab\n\nQ0\nA: aaa", "Q2\nA: bab\n\nQ1\nA: aaab\n\nQ0\nA: bbb"]
    schema = eval_gpt.core_prompts("schema", SCHEMA[0], [SCHEMA[2]], "")
    assert schema == ["aqzz\n\nxqzz", "aqzz\n\nxpzz"]
    lm = eval_gpt.core_prompts("language_modeling", LM[1], [LM[2], LM[0]], " ")
    assert lm == ["who? a\n\nwhat? aaa\n\nwhy?", "who? a\n\nwhat? aaa\n\nwhy? ab"]


def test_continuations_are_found_in_tokens():
    """The continuation of each row: after the tokens every choice shares (multiple choice), the tokens every
    option ends with (schema), after the prompt without it (language modelling); over-long rows keep their end."""
    def continuations(kind, item, seq_len=1024):
        rows = eval_gpt.core_rows(kind, eval_gpt.core_prompts(kind, item, [], " "), ENCODE, BOS, seq_len)
        return [bytes(ids[start:]).decode() for ids, start in rows]
    assert continuations("multiple_choice", MC[3]) == ["a", "caaa"]
    assert continuations("schema", SCHEMA[2]) == [" zz", " zz"]
    assert continuations("language_modeling", LM[0]) == [" aaa"]
    rows = eval_gpt.core_rows("multiple_choice", ["Q3 ba", "Q3 bcaaa"], ENCODE, BOS, seq_len=4)
    assert rows == [(list(b"Q3 ba"), 4), (list(b"bcaaa"), 1)]  # the last 5 tokens: 4 inputs, 4 targets


def test_each_kind_of_task_decides_as_worked_out_by_hand():
    """Item by item, under the bigram stub: the decisions of RIGHT, with the few-shot examples core.yaml asks for
    in front (they leave a bigram's losses of the continuation as they are); the mean losses of one item by hand."""
    model, ctx, cpu = Bigram(), tg.contextlib.nullcontext(), torch.device("cpu")
    kinds = {"mc": ("multiple_choice", MC, " ", 1), "schema": ("schema", SCHEMA, "", 1),
             "lm": ("language_modeling", LM, " ", 2)}
    for label, (kind, items, delimiter, shots) in kinds.items():
        decided = []
        for i, item in enumerate(items):
            shown = [items[j] for j in eval_gpt.few_shot(len(items), i, shots)]
            rows = eval_gpt.core_rows(kind, eval_gpt.core_prompts(kind, item, shown, delimiter), ENCODE, BOS, 1024)
            means, greedy = eval_gpt.continuation_scores(model, rows, ctx, cpu)
            decided.append(eval_gpt.core_right(kind, item, means, greedy))
            if label == "mc" and i == 1:
                assert means == pytest.approx([L, L - 1.5], abs=1e-5)
        assert decided == RIGHT[label], label


def test_core_is_the_mean_of_centred_accuracies(tmp_path):
    """score_core on the crafted bundle: each task's accuracy from RIGHT, centred on its baseline from the csv (in
    percent there), and CORE their mean: (0.5 + 1/3 + 0.5) / 3."""
    tasks = eval_gpt.read_core(str(write_bundle(tmp_path)))
    assert [(t["label"], t["kind"], t["shots"], t["delimiter"], t["baseline"]) for t in tasks] == [
        ("mc", "multiple_choice", 1, " ", 0.5), ("schema", "schema", 1, "", 0.5),
        ("lm", "language_modeling", 2, " ", 0.0)]
    rec = eval_gpt.score_core(Bigram(), tasks, ENCODE, BOS, tg.contextlib.nullcontext(), 1024, 0, 1,
                              torch.device("cpu"), "# stub")
    acc = {label: sum(r) / len(r) for label, r in RIGHT.items()}
    assert {k: v["acc"] for k, v in rec["core_tasks"].items()} == pytest.approx(acc)
    centred = [(acc["mc"] - 0.5) / 0.5, (acc["schema"] - 0.5) / 0.5, acc["lm"]]
    assert [v["centred"] for v in rec["core_tasks"].values()] == pytest.approx(centred)
    assert rec["core"] == pytest.approx(sum(centred) / 3) and rec["core"] == pytest.approx(4 / 9)


def test_a_bad_bundle_stops_in_one_line_that_names_the_file(tmp_path):
    b = write_bundle(tmp_path)
    (b / "eval_data" / "reasoning" / "mc.jsonl").write_text('{"query": "Q", "choices": ["a"], "gold": 1}\n' * 2)
    with pytest.raises(SystemExit, match=r"mc.jsonl:1: not a multiple_choice item; each line needs \{\"query\""):
        eval_gpt.read_core(str(b))
    write_bundle(tmp_path)
    (b / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nmc,50\nschema,50\n")
    with pytest.raises(SystemExit, match=r"eval_meta_data.csv: no random baseline \(0 to 100\) for task lm"):
        eval_gpt.read_core(str(b))
    with pytest.raises(SystemExit, match=r"--items=.*nowhere: no core.yaml there; python prepare_data.py core"):
        eval_gpt.read_core(str(tmp_path / "nowhere"))


def prepare(tmp_path, monkeypatch, archive, *flags):
    """prepare_data.py core with the download pointed at archive (a file:// URL); its data dir."""
    monkeypatch.setattr(prepare_data, "CORE_URL", archive.as_uri())
    data = tmp_path / "data" / "core"
    prepare_data.main(["core", f"--data_dir={data}", *flags])
    return data


def test_prepare_core_fetches_the_bundle_in_its_layout(tmp_path, monkeypatch, capsys):
    """The bundle's files land in data/core as published, with meta.json (the zip's SHA-256 and each task's item
    count) written last; the zip is gone; a second preparation replaces the first; --sha256 is checked."""
    archive = zip_bundle(write_bundle(tmp_path / "src"), tmp_path / "eval_bundle.zip")
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    data = prepare(tmp_path, monkeypatch, archive, f"--sha256={sha}")
    assert sha in capsys.readouterr().out
    names = sorted(p.relative_to(data).as_posix() for p in data.rglob("*") if p.is_file())
    assert names == ["core.yaml", "eval_data/language/lm.jsonl", "eval_data/reasoning/mc.jsonl",
                     "eval_data/reasoning/schema.jsonl", "eval_meta_data.csv", "meta.json"]
    meta = json.loads((data / "meta.json").read_text())
    assert meta["sha256"] == sha and meta["items"] == {"mc": 4, "schema": 3, "lm": 4}
    assert len(eval_gpt.read_core(str(data))) == 3
    zip_bundle(write_bundle(tmp_path / "src", mc=MC[:2]), archive)  # a new bundle over the old one
    prepare(tmp_path, monkeypatch, archive)
    assert json.loads((data / "meta.json").read_text())["items"]["mc"] == 2
    with pytest.raises(SystemExit, match=r"eval_bundle.zip: its SHA-256 is [0-9a-f]{64}, not --sha256=00"):
        prepare(tmp_path, monkeypatch, archive, "--sha256=00")


@pytest.mark.parametrize("damage", ["cut", "flipped-byte", "task-file-missing", "no-core-yaml"])
def test_a_damaged_or_partial_bundle_stops_in_one_line_that_names_the_file(tmp_path, monkeypatch, damage):
    """A zip cut short, a member whose bytes changed (its CRC-32 no longer matches), a task file that core.yaml
    names but the zip lacks, a zip without core.yaml: each ends in one line naming the file, and data/core holds
    nothing prepared (no meta.json, no bundle file)."""
    src = write_bundle(tmp_path / "src")
    archive = tmp_path / "eval_bundle.zip"
    said = {"cut": r"eval_bundle.zip: not a whole zip archive",
            "flipped-byte": r"eval_bundle.zip: eval_bundle/eval_data/language/lm.jsonl is damaged \(Bad CRC-32",
            "task-file-missing": r"eval_bundle.zip: no eval_bundle/eval_data/reasoning/schema.jsonl in it, which "
                                 r"core.yaml names for task schema",
            "no-core-yaml": r"eval_bundle.zip: no eval_bundle/core.yaml in it, so it is no DCLM eval bundle"}[damage]
    leave_out = {"task-file-missing": ["eval_bundle/eval_data/reasoning/schema.jsonl"],
                 "no-core-yaml": ["eval_bundle/core.yaml"]}.get(damage, [])
    zip_bundle(src, archive, leave_out)
    data = archive.read_bytes()
    if damage == "cut":
        archive.write_bytes(data[:len(data) // 2])
    if damage == "flipped-byte":  # stored uncompressed, so the item's text is in the zip as it is
        archive.write_bytes(data.replace(b'"context": "what?"', b'"context": "whaT?"'))
    with pytest.raises(SystemExit, match=said) as e:
        prepare(tmp_path, monkeypatch, archive)
    assert "\n" not in str(e.value) and "delete it and run the same command again" in str(e.value)
    left = [p.name for p in (tmp_path / "data").rglob("*") if p.is_file()]
    assert left == ["eval_bundle.zip"]  # the download stays for the message's "delete it"; nothing else


def test_the_whole_path_on_a_tiny_gpt_in_one_process_each_checkpoint_and_two_ranks(tmp_path, monkeypatch):
    """prepare_data.py core, then eval_gpt.py --task=core on a run's checkpoint: each task's accuracy equals a
    reference of plain forwards (no padding, full logits), in one process, on each checkpoint the run kept, and on
    two ranks, whose lines show the same CORE."""
    data = prepare(tmp_path, monkeypatch, zip_bundle(write_bundle(tmp_path / "src"), tmp_path / "eval_bundle.zip"))
    out = tmp_path / "run"
    tg.main(tg.Config(n_layer=1, n_head=2, n_embd=32, seq_len=64, batch_size=4, max_steps=2, eval_every=0,
                      log_every=1, sample_tokens=0, device="cpu", dtype="float32", compile="false",
                      data_dir=str(write_corpus(tmp_path / "corpus", n_train=40, n_val=5)), out_dir=str(out),
                      save_every=1))
    model = eval_gpt.ft.load_model(str(out), torch.device("cpu"))[0]
    want = {}
    for task in eval_gpt.read_core(str(data)):
        right = 0
        for i, item in enumerate(task["items"]):
            shown = [task["items"][j] for j in eval_gpt.few_shot(len(task["items"]), i, task["shots"])]
            prompts = eval_gpt.core_prompts(task["kind"], item, shown, task["delimiter"])
            decided = []
            for ids, start in eval_gpt.core_rows(task["kind"], prompts, ENCODE, BOS, 64):
                with torch.no_grad():
                    logits = model(torch.tensor([ids[:-1]]))[0, start - 1:]  # (continuation, vocab)
                target = torch.tensor(ids[start:])
                decided.append((F.cross_entropy(logits, target).item(), bool((logits.argmax(-1) == target).all())))
            if task["kind"] == "language_modeling":
                right += decided[0][1]
            else:
                right += min(range(len(decided)), key=lambda k: decided[k][0]) == item["gold"]
        want[task["label"]] = right / len(task["items"])
    cfg = eval_gpt.Config(task="core", ckpt=str(out), items=str(data), device="cpu", dtype="float32")
    one = eval_gpt.main(cfg)
    assert {k: v["acc"] for k, v in one["core_tasks"].items()} == pytest.approx(want, abs=1e-9)
    cfg.every_checkpoint = True
    assert eval_gpt.main(cfg) == one  # the last of steps 1 and 2 is the newest checkpoint
    two = ranks.run([os.path.join(ROOT, "eval_gpt.py"), "--task=core", f"--ckpt={out}", f"--items={data}",
                     "--device=cpu", "--dtype=float32"], timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    assert f"CORE {one['core']:.4f} over 3 tasks | GPT-2 XL: 0.256525 (nanochat's published figure)" in two.stdout
    assert two.stdout.count("CORE ") == 1, two.stdout
