"""README.md and docs/*.md cannot rot: every command of their ```bash blocks (and every '$ ' command their sample
output shows) parses under its script's own parser, and every one a CPU can run offline in one process runs, shrunk,
in order, on small data this test makes. WORKSHOP.md is tests/test_workshop.py's."""
import glob
import json
import os
import re
import shlex
import shutil
import traceback
from types import SimpleNamespace

import pytest

import finetune_gpt
import prepare_data
from commands import FENCES, ROOT, commands, run_command, split_env, workshop_tiny, write_scratch_data
from conftest import hellaswag_items, python_like_docs, write_corpus
from test_core_eval import write_bundle
from test_finetune import GPT2, gpt2_folder

DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                             recursive=True)
                              if os.path.basename(p) != "WORKSHOP.md")
COMMANDS = [(f"{doc}:{n}", argv) for doc in DOCS for _, n, argv in commands(os.path.join(ROOT, doc))]
SHOWN = [(f"{doc}:{n}", argv) for doc in DOCS for _, n, argv in commands(os.path.join(ROOT, doc), shown=True)]

# what cannot run here decides parse-only: a download, a GPU, several processes, an install, the suite itself
DOWNLOADS = ("fineweb", "shakespeare", "cifar10", "cifar100", "mnist", "fashion_mnist", "gpt2",
             "hellaswag", "core")  # prepare_data.py's
GPU_PRESETS = ("gpt2_124m", "gpt2_350m", "cifar10")  # sizes written for a GPU (train_gpt, train_vit, train_diffusion)
# commands that fail when run, for a bug in a script that is being fixed elsewhere: {command: (what its error says,
# why)}. Each must still fail with that error, so an entry goes once the bug is fixed and hides nothing else
KNOWN_FAILURES = {
    "python train_gpt.py --save_every=100 --resume": (
        "is complete at step 6; raise its budget",
        "the run before it here is complete (6 steps of 6); a run cut short resumes, as tests/test_train_gpt.py's "
        "resume tests show, and a complete one stops in this one line"),
    "python rl_gpt.py --init_from=out/chat --out_dir=out/rl --resume": (
        "is complete at step 3; raise its budget",
        "the RL run before it here is complete (3 steps of 3); a run cut short by SIGTERM resumes, as "
        "tests/test_rl_gpt.py's resume test shows, and a complete one stops in this one line (issue 80)"),
}
# the modes of each trainer that read a run instead of starting one (predict_vit.py and sample_diffusion.py only
# read one: their commands are not here, and never remove an out_dir)
NOT_TRAINING = {"train_gpt": ("resume",),
                "finetune_gpt": ("resume", "export", "merge_lora"),
                "chat_gpt": ("prepare", "chat"), "rl_gpt": ("resume", "score_only"),
                "train_vit": ("resume",), "train_diffusion": ("resume",)}


def why_parse_only(argv):
    """Why argv cannot run on this CPU machine, offline, in this process; None when it runs here, shrunk."""
    argv = split_env(argv)[1]
    flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    if argv[0] == "pip":
        return "an install"
    if argv[0] == "bash":
        return "a GPU (bench.sh's --dry-run is tests/test_bench.py's)"
    if argv[0] == "torchrun":
        return "several processes"
    if argv[1:3] == ["-m", "pytest"]:
        return "the test suite, which runs anyway"
    if (argv[1] == "prepare_data.py" and argv[2] in DOWNLOADS) or flags.get("tokenizer") == "gpt2":
        return "the network"  # gpt2 tokens need tiktoken's files
    if any(flags.get(k) in finetune_gpt.GPT2_NAMES[1:] for k in ("init_from", "teacher", "ckpt")):
        return "the network"  # only models/gpt2 has a stand-in
    if argv[1] == "chat_gpt.py" and flags.get("init_from") == "gpt2" and "prepare" not in flags:
        return "GPT-2's 1,024 positions: models/gpt2's stand-in has 40, too few for a conversation"
    if flags.get("device") == "cuda" or flags.get("preset") in GPU_PRESETS or argv[1:] == ["kernels.py", "--bench"]:
        return "a GPU"
    if "gpt2_124m" in flags.get("ckpt", ""):
        return "a GPU (the checkpoints of a --preset=gpt2_124m run)"
    if flags.get("export") == "pt":
        return "an FSDP checkpoint folder, which only a torchrun run writes"
    return None


# the scaling commands at a CPU test's size: two budgets of 2-3 small models each (a fit needs 5 runs), 8 fit starts
# instead of Hoffmann et al.'s 4,500, a grid of two models, two widths
SCALING = {"sweep": ["--flops=1e9,3e9", "--sizes=3", "--ratio=1", "--min_steps=5", "--batch_size=8"],
           "plan": ["--flops=6e9"], "coord_check": ["--widths=16,32", "--steps=2", "--seeds=1"],
           "fit": ["--bootstrap=4", '--param_grid={"e":[0,1], "a":[4,8], "b":[4,8], "alpha":[0.3], "beta":[0.3]}'],
           "lr_transfer": ["--widths=16,32", "--lrs=1e-2", "--steps=2", "--batch_size=4", "--seq_len=32"]}


def readme_tiny(script, args):
    """The flags appended to a command that runs: the workshop's for the trainers and shapes, plus what the README
    leaves long: GPT steps (the default is 240 s of training), a sample's length, the scaling commands, a BPE's
    size."""
    if script == "scaling.py":
        extra = [] if "--published" in args else SCALING.get(args[0], [])
        return extra + (["--models=1x16,1x32", "--tokens=8e3"] if any(a.startswith("--models") for a in args) else [])
    extra = list(workshop_tiny(script, args))
    if script in ("train_gpt.py", "finetune_gpt.py"):  # a length warmup grows in multiples of 64, from 64
        extra += ["--max_steps=6", "--eval_every=3", "--sample_tokens=8"] + (
            ["--seq_len=128"] if any(a.startswith("--seq_len_warmup") for a in args) else [])
    elif script == "prepare_data.py" and any(a.startswith("--tokenizer=bpe") for a in args):
        extra += ["--tokenizer=bpe:300"]
    return extra


def test_the_docs_have_their_commands():
    """The README has commands, and no doc writes a command in a block that is not a ```bash block (this test would
    not see it) unless it is shown with a '$ ' prompt as part of sample output."""
    assert len(COMMANDS) >= 20, COMMANDS
    for doc in DOCS:
        fence = None
        for n, line in enumerate(open(os.path.join(ROOT, doc)), 1):
            if line.lstrip().startswith("```"):
                fence = line.strip() if fence is None else None
            elif fence and fence not in FENCES:
                assert not line.startswith(("python ", "torchrun ", "pip ")), f"{doc}:{n}: a command outside ```bash"


def test_every_command_parses():
    """Each command, and each command sample output shows, is accepted by the parser of the script it runs: a
    renamed or removed flag, subcommand or script fails here, as does a command form the test does not know."""
    failed = []
    for where, argv in COMMANDS + SHOWN:
        try:
            run_command(argv, execute=False)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - every command is checked, then all failures shown
            failed.append(f"{where}: {shlex.join(argv)}\n    {type(e).__name__}: {e}")
    assert not failed, "\n".join(failed)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A working directory with small stand-ins for what the commands read: the default text and image data, a
    tiny GPT-2 at models/gpt2 and text as its tokens, your notes, a book, your images, ImageNet's folders, a
    standard library."""
    d = write_scratch_data(tmp_path_factory.mktemp("readme"), n_val=8)  # a short val split: each run evaluates on all
    # where finetune_gpt.py looks for --init_from=gpt2: GPT-2's vocabulary, and logits near -60 as the real one's
    gpt2_folder(d / "models" / "gpt2", conf={**GPT2, "vocab_size": 50257}, far_below_zero=True)
    gpt2_data = write_corpus(d / "data" / "mine_gpt2", n_val=8)  # bytes relabelled as GPT-2 ids (each < 257 is one)
    (gpt2_data / "meta.json").write_text((gpt2_data / "meta.json").read_text().replace('"byte"', '"gpt2"'))
    for i, doc in enumerate(python_like_docs(40, 2)):
        for folder in ("my_notes", "stdlib"):
            (d / folder / f"note_{i}.py").parent.mkdir(exist_ok=True)
            (d / folder / f"note_{i}.py").write_text(doc)
    (d / "book.txt").write_text("\n".join(python_like_docs(20, 3)))
    chats = [{"messages": [{"role": "user", "content": f"Is {i} even?"},  # conversations, for chat_gpt.py --prepare
                           {"role": "assistant", "content": "yes" if i % 2 == 0 else "no"}]} for i in range(40)]
    (d / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    qa = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)} for i in range(40)]
    (d / "qa.jsonl").write_text("".join(json.dumps(q) + "\n" for q in qa))  # prompts and answers, for rl_gpt.py
    (d / "data" / "hellaswag").mkdir()  # what prepare_data.py hellaswag writes: HellaSwag's val JSONL
    (d / "data" / "hellaswag" / "hellaswag_val.jsonl").write_text("".join(json.dumps(it) + "\n" for it in
                                                                          hellaswag_items(8)))
    write_bundle(d / "data").rename(d / "data" / "core")  # what prepare_data.py core writes: a small DCLM bundle
    from PIL import Image
    for split, n in (("train", 12), ("val", 3)):  # ImageNet's layout: a folder a class of .JPEG files, in train and val
        images, _ = prepare_data.make_shapes(2 * n, 20, 6)
        for i, image in enumerate(images):
            folder = d / "imagenet" / split / ("n01440764", "n01443537")[i % 2]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / f"{split}_{i}.JPEG")
    images, _ = prepare_data.make_shapes(3, 16, 5)
    (d / "my_images").mkdir()
    for i, image in enumerate(images):
        Image.fromarray(image).save(d / "my_images" / f"{i}.png")
    return d


def test_the_cpu_commands_run_shrunk(scratch, monkeypatch):
    """Every command that can run here runs, in the docs' order, with flags that shrink it appended; each must finish
    without an error. A training run starts afresh (its out_dir removed, as a user would before trying another
    example), so that `--teacher=out/gpt` or `--ckpt=out/vit` find the run of the command before."""
    import tiktoken

    def stand_in(name):  # GPT-2's files are a download: 256 bytes, 50,000 byte pairs and GPT-2's end-of-text id
        assert name == "gpt2", name
        ranks = {bytes([i]): i for i in range(256)} | {bytes([i % 256, i // 256]): 256 + i for i in range(50000)}
        return tiktoken.Encoding("gpt2", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256})
    monkeypatch.chdir(scratch)
    monkeypatch.setattr(tiktoken, "get_encoding", stand_in)
    stdlib = SimpleNamespace(get_paths=lambda: {"stdlib": str(scratch / "stdlib")})
    monkeypatch.setattr(prepare_data, "sysconfig", stdlib)  # prepare_data.py stdlib reads 40 files, not 1,790
    failed, ran = [], 0
    for where, argv in COMMANDS:
        if why_parse_only(argv):
            continue
        name, error = shlex.join(argv), None
        try:
            cfg = run_command(argv, execute=False)
            trains = type(cfg).__module__ in NOT_TRAINING
            if trains and not any(getattr(cfg, k) for k in NOT_TRAINING[type(cfg).__module__]):
                shutil.rmtree(cfg.out_dir, ignore_errors=True)
            run_command(argv, execute=True, tiny=readme_tiny)
            ran += 1
        except (Exception, SystemExit) as e:  # noqa: BLE001 - every command runs, then all failures are shown
            frame = traceback.extract_tb(e.__traceback__)[-1]
            error = f"{type(e).__name__}: {e} ({os.path.basename(frame.filename)}:{frame.lineno})"
        known, why = KNOWN_FAILURES.get(name, (None, None))
        if known and (error is None or known not in error):
            failed.append(f"{where}: {name}\n    known to fail with {known!r} ({why}), but now "
                          + ("runs: take it off KNOWN_FAILURES" if error is None else f"fails otherwise: {error}"))
        elif error and not known:
            failed.append(f"{where}: {name}\n    {error}")
    assert not failed, "\n".join(failed)
    assert ran >= len(COMMANDS) // 2, f"only {ran} of {len(COMMANDS)} commands ran: is why_parse_only too wide?"


def slug(heading):
    """The #anchor GitHub gives a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_exists():
    """Every relative link `](path)` and `](path#anchor)` of the docs (images too) names a file that exists, and an
    anchor names a heading of that file: a page that moves or a heading that is renamed fails here."""
    broken = []
    for doc in DOCS + ["WORKSHOP.md", "BENCHMARKS.md"]:
        text = open(os.path.join(ROOT, doc)).read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), path)) if path else os.path.join(ROOT, doc)
            if not os.path.exists(full):
                broken.append(f"{doc}: ({target}): no such file")
            elif anchor and anchor not in {slug(h) for h in re.findall(r"^#+ (.+)$", open(full).read(), re.M)}:
                broken.append(f"{doc}: ({target}): no heading with that anchor")
    assert not broken, "\n".join(broken)
