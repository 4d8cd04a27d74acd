"""Issue 51's sweep of bad input across the suite's scripts: each case runs a script in this process as its
`if __name__ == "__main__":` block does, on one bad input made in tmp_path, and must end as the suite promises: a
non-zero exit, one line on stderr naming the problem and the fix (or one line per problem: a skipped checkpoint's
warning, then the error), never a traceback, and no file left behind (an empty folder is allowed, except from a
preparation: prepare_data.py and chat_gpt.py --prepare leave no new folder either). The cases' ids say what each
breaks; what each did before issue 51 (its make_fixtures and run, given 26d9540's scripts) is in issue 51's closing
note. Issue 61 added the cases at the end of CASES, and SAYS: what the line of some must also say."""
import contextlib
import importlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tiny runs of one step on CPU: a case's bad input is met before or at its first step
GPT = ("--n_layer=1 --n_head=2 --n_embd=32 --seq_len=16 --batch_size=2 --max_steps=1 --time_budget=0 "
       "--warmup_steps=1 --eval_every=0 --eval_tokens=64 --log_every=1 --sample_tokens=0 --device=cpu "
       "--compile=false").split()
IMG = ("--n_layer=1 --n_head=2 --n_embd=16 --patch_size=4 --batch_size=8 --max_steps=1 --time_budget=0 "
       "--warmup_steps=1 --eval_every=0 --log_every=1 --device=cpu --compile=false").split()
DIT = [*IMG, "--sample_steps=2", "--per_class=1", "--eval_images=8", "--final_samples=10"]


def entry(script, argv):
    """What `python SCRIPT ARGV...` runs: the script's `if __name__ == "__main__":` block."""
    mod = importlib.import_module(script[:-3])
    if script == "prepare_data.py":
        sys.exit(mod.main(argv))
    elif script in ("scaling.py", "bench.py"):
        mod.main(argv)
    else:  # the trainers parse flags with their own shim, the companions with their trainer's (tg, tv or td)
        shim = mod if script.startswith("train_") else next(vars(mod)[n] for n in ("tg", "tv", "td") if n in vars(mod))
        mod.main(shim.parse_args(mod.Config, argv))


def run(script, argv, cwd):
    """(exit status, stdout, stderr as a terminal shows it, files new under cwd) of the command, run in this
    process from cwd. An exception other than SystemExit is what Python would print as a traceback."""
    before = set(cwd.rglob("*"))
    out, err, old = io.StringIO(), io.StringIO(), (os.getcwd(), sys.argv)
    os.chdir(cwd)
    sys.argv = [script, *argv]  # die() names the script from it
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                entry(script, argv)
                code = 0
            except SystemExit as e:  # Python prints a str code on stderr and exits 1
                code = 1 if isinstance(e.code, str) else e.code or 0
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
            except BaseException as e:  # noqa: BLE001
                code = 1
                print(f"Traceback (most recent call last):\n{type(e).__name__}: {e}", file=sys.stderr)
    finally:
        os.chdir(old[0])
        sys.argv = old[1]
    preparing = script == "prepare_data.py" or any(a.startswith("--prepare=") for a in argv)
    new = sorted(str(p.relative_to(cwd)) for p in set(cwd.rglob("*")) - before  # an empty folder may stay, but
                 if p.is_file() or preparing or p.name.startswith(".") or ".tmp" in p.name)  # not a data dir's
    return code, out.getvalue(), err.getvalue(), new


def problems(script, code, out, err, new):
    """What is wrong with the ending of a command that should fail: [] if it ended as promised."""
    found = []
    if "Traceback" in out + err:
        found.append("traceback: " + err.strip().split("\n")[-1][:200])
    elif code == 0:
        found.append("exit 0")
    else:  # before the error, on lines of their own: warnings, one a problem, and progress (redrawn with \r)
        lines = [line for line in err.split("\n") if line.strip()]
        others = [line for line in lines[:-1] if not line.startswith("warning: ") and "\r" not in line]
        if others or not lines or not lines[-1].startswith(f"{script}: error: "):
            found.append(f"{len(lines)} lines on stderr: " + " / ".join(lines)[-300:])
    if new:
        found.append(f"left {', '.join(new)}")
    return found


def put(path, data):
    """path, written with data (bytes or text), its folder made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def folder(path):
    """path, made an empty folder."""
    path.mkdir(parents=True)
    return path


def half(src, dst):
    """dst: the first half of src's bytes, as a copy or download cut short."""
    return put(dst, Path(src).read_bytes()[:Path(src).stat().st_size // 2])


def replaced(src, dst, name, data):
    """A copy dst of the folder src whose file `name` is data (bytes or text), or gone (None)."""
    shutil.copytree(src, dst)
    (dst / name).unlink()
    if data is not None:
        put(dst / name, data)
    return dst


def make_fixtures(root):
    """The tiny inputs the cases damage: a byte corpus and a GPT checkpoint of it; shapes images and a ViT and a DiT
    checkpoint of them; a folder of PNGs in two classes; and, where chat_gpt.py exists, chat data and a chat model."""
    import prepare_data
    from PIL import Image

    from conftest import write_corpus
    f = SimpleNamespace(corpus=write_corpus(root / "corpus", n_train=40, n_val=5), shapes=root / "shapes",
                        vit=root / "vit", dit=root / "dit", pngs=root / "pngs", chat=root / "chat")
    entry("train_gpt.py", [*GPT, "--max_steps=2", f"--data_dir={f.corpus}", f"--out_dir={root / 'gpt'}"])
    f.gpt = next((root / "gpt").glob("ckpt_*.pt"))
    splits = {"train": prepare_data.make_shapes(32, 16, 0), "val": prepare_data.make_shapes(8, 16, 1)}
    prepare_data.write_images(f.shapes, splits, list(prepare_data.SHAPES), "shapes")
    entry("train_vit.py", [*IMG, f"--data_dir={f.shapes}", f"--out_dir={f.vit}", "--eval_images=8"])
    entry("train_diffusion.py", [*DIT, f"--data_dir={f.shapes}", f"--out_dir={f.dit}"])
    for i, im in enumerate(prepare_data.make_shapes(6, 16, 3)[0]):
        (f.pngs / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(im).save(f.pngs / f"c{i % 2}" / f"im{i}.png")
    if os.path.exists(os.path.join(os.path.dirname(prepare_data.__file__), "chat_gpt.py")):  # not at 26d9540
        entry("chat_gpt.py", chat(f, "--prepare=arithmetic", "--conversations=20", f"--data_dir={f.chat}"))
        entry("chat_gpt.py", chat(f, f"--data_dir={f.chat}", f"--out_dir={root / 'chat_model'}", "--max_steps=1",
                                  "--eval_turns=1", "--batch_size=2", "--eval_every=0"))
        f.chat_model = next((root / "chat_model").glob("ckpt_*.pt"))
    return f


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    """make_fixtures' inputs, made once for the module."""
    return make_fixtures(tmp_path_factory.mktemp("fixtures"))


def gpt(f, t, *flags):
    """train_gpt.py's (or finetune_gpt.py's) flags for a one-step run on the corpus, then flags."""
    return [*GPT, f"--data_dir={f.corpus}", f"--out_dir={t / 'out'}", *flags]


def gpt_data(f, t, name, data):
    """A one-step run on a copy of the corpus whose file `name` is data (None: gone)."""
    return gpt(f, t, f"--data_dir={replaced(f.corpus, t / 'data', name, data)}")


def img(f, t, flags, *more):
    """A one-step image run (flags: IMG or DIT) on the shapes, then more."""
    return [*flags, f"--data_dir={f.shapes}", f"--out_dir={t / 'out'}", *more]


def img_data(f, t, flags, name, data):
    """A one-step image run on a copy of the shapes whose file `name` is data (None: gone)."""
    return img(f, t, flags, f"--data_dir={replaced(f.shapes, t / 'data', name, data)}")


def chat(f, *flags):
    """chat_gpt.py's flags from the GPT checkpoint, then flags."""
    return [f"--init_from={f.gpt}", "--seq_len=128", "--device=cpu", "--compile=false", *flags]


def hf_folder(t, config=None, weights=("model.safetensors", b"")):
    """A Hugging Face GPT-2 folder: config.json (else a valid one for a tiny GPT-2) and (name, bytes) of weights."""
    conf = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8, "n_positions": 16,
            "layer_norm_epsilon": 1e-5, "vocab_size": 64}
    put(t / "hf" / "config.json", json.dumps(conf) if config is None else config)
    put(t / "hf" / weights[0], weights[1])
    return t / "hf"


def cut_safetensors(t):
    """A model.safetensors cut short, as a download that stopped."""
    import torch
    from safetensors.torch import save_file
    save_file({"wte.weight": torch.zeros(64, 8)}, t / "whole.safetensors")
    return "model.safetensors", (t / "whole.safetensors").read_bytes()[:100]


def gpt2_weights(t, n_layer=1, n_embd=8):
    """model.safetensors of a tiny GPT-2 (vocab 64, 16 positions) in Hugging Face's names and layout: Conv1D
    weights are (in, out)."""
    import torch
    from safetensors.torch import save_file
    d = n_embd
    w = {"wte.weight": torch.zeros(64, d), "wpe.weight": torch.zeros(16, d), "ln_f.weight": torch.ones(d),
         "ln_f.bias": torch.zeros(d)}
    for i in range(n_layer):
        shapes = {"ln_1": (d,), "attn.c_attn": (d, 3 * d), "attn.c_proj": (d, d), "ln_2": (d,), "mlp.c_fc": (d, 4 * d),
                  "mlp.c_proj": (4 * d, d)}
        for name, shape in shapes.items():
            w[f"h.{i}.{name}.weight"] = torch.zeros(shape)
            w[f"h.{i}.{name}.bias"] = torch.zeros(shape[-1])
    save_file(w, t / "weights.safetensors")
    return "model.safetensors", (t / "weights.safetensors").read_bytes()


def resume_from_cut(f, t, ckpt, flags):
    """flags, then --resume from an out_dir whose only checkpoint was cut short."""
    half(ckpt, t / "run" / ckpt.name)
    return [*flags, f"--out_dir={t / 'run'}", "--resume"]


def short_shard(t, f):
    """A one-step run on a copy of the corpus whose train shard holds 5 tokens, fewer than a row (--seq_len + 1)."""
    import prepare_data
    d = replaced(f.corpus, t / "data", "train_000000.bin", None)
    prepare_data.write_shard(d / "train_000000.bin", list(range(5)))
    return gpt(f, t, f"--data_dir={d}")


def cut_png(t, f):
    """prepare_data.py imagefolder on a copy of the PNG folder with one image cut short."""
    shutil.copytree(f.pngs, t / "pngs")
    half(f.pngs / "c1" / "im5.png", t / "pngs" / "c1" / "im5.png")
    return ["imagefolder", str(t / "pngs"), f"--data_dir={t / 'd'}", "--image_size=16"]


def cut_mnist(t):
    """prepare_data.py mnist, its four downloads there already but each cut off after gzip's header."""
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                 "t10k-labels-idx1-ubyte.gz"):
        put(t / "d" / name, b"\x1f\x8b\x08\x00")
    return ["mnist", f"--data_dir={t / 'd'}"]


def chat_data_cut(t, f):
    """SFT on a copy of the chat data whose val mask shard was cut short."""
    d = replaced(f.chat, t / "d", "val_mask_000000.bin", (f.chat / "val_mask_000000.bin").read_bytes()[:-2])
    return chat(f, f"--data_dir={d}", f"--out_dir={t / 'o'}", "--max_steps=1")


def chat_data_here(t, f):
    """--chat with nothing trained, in a folder whose data/arith_chat (the default --data_dir) is prepared."""
    shutil.copytree(f.chat, t / "data" / "arith_chat")
    return ["--chat", "--prompt=hi", "--device=cpu"]


def one_class(t):
    """An image data dir made by hand whose images are all of one class (prepare_data.py refuses such a folder)."""
    import prepare_data
    x, y = prepare_data.make_shapes(16, 16, 0)
    splits = {"train": (x, y * 0), "val": (x[:8], y[:8] * 0)}
    prepare_data.write_images(t / "one", splits, ["circle"], "by hand")
    return t / "one"


def rl(f, t, *flags):
    """rl_gpt.py's flags for a two-step run from the chat model, on 20 arithmetic dialogues, then flags."""
    return [f"--init_from={f.chat_model}", "--conversations=20", "--max_steps=2", "--batch_size=1", "--samples=2",
            "--max_new_tokens=2", "--eval_items=1", "--pass_k=0", "--eval_every=0", "--device=cpu", "--compile=false",
            f"--out_dir={t / 'rl'}", *flags]


def rl_finished(t, f):
    """--resume of a finished two-step RL run, with the same budget."""
    entry("rl_gpt.py", rl(f, t))
    return rl(f, t, "--resume")


HF_TWO_LAYERS = json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 8, "n_positions": 16,
                            "layer_norm_epsilon": 1e-5, "vocab_size": 64})
NOT_UTF8 = "caf\u00e9\n".encode("latin-1")  # Latin-1 text
NOT_JSON = "hello\n{]\n"
LABEL_4_OF_4 = '{"ctx": "a b", "endings": ["c", "d", "e", "f"], "label": 4}\n'  # HellaSwag's labels are 0..3
CASES = {  # id: (script, setup(tmp_path, fixtures) -> argv); what each did at 26d9540: issue 51's closing note
    # train_gpt.py
    "gpt-out_dir-is-a-file": ("train_gpt.py", lambda t, f: gpt(f, t, f"--out_dir={put(t / 'o', 'x')}")),
    "gpt-n_head-0": ("train_gpt.py", lambda t, f: gpt(f, t, "--n_head=0")),
    "gpt-beta1-above-1": ("train_gpt.py", lambda t, f: gpt(f, t, "--beta1=1.5")),
    "gpt-weight_decay-negative": ("train_gpt.py", lambda t, f: gpt(f, t, "--weight_decay=-0.1")),
    "gpt-init_std-negative": ("train_gpt.py", lambda t, f: gpt(f, t, "--init_std=-1")),
    "bench-steps-0": ("bench.py", lambda t, f: [os.path.join(ROOT, "train_gpt.py"), "--steps=0", *GPT]),
    "gpt-rope_base-0": ("train_gpt.py", lambda t, f: gpt(f, t, "--rope_base=0")),
    "gpt-norm_eps-negative": ("train_gpt.py", lambda t, f: gpt(f, t, "--norm_eps=-1e-6")),
    "sample-max_new_tokens-negative": ("sample_gpt.py", lambda t, f: [f"--ckpt={f.gpt}", "--max_new_tokens=-1",
                                                                     "--device=cpu"]),
    "sample-ckpt-cut": ("sample_gpt.py", lambda t, f: [f"--ckpt={half(f.gpt, t / 'c.pt')}"]),
    "gpt-resume-ckpt-cut": ("train_gpt.py", lambda t, f: resume_from_cut(f, t, f.gpt, gpt(f, t))),
    "ft-export-pt-ckpt-cut": ("finetune_gpt.py", lambda t, f: ["--export=pt", f"--ckpt={half(f.gpt, t / 'c.pt')}",
                                                              f"--out_dir={t / 'o'}"]),
    "gpt-meta-json-cut": ("train_gpt.py", lambda t, f: gpt_data(f, t, "meta.json", '{"format": "trainsu')),
    "gpt-prepare-interrupted-no-meta-json": ("train_gpt.py", lambda t, f: gpt_data(f, t, "meta.json", None)),
    "gpt-shard-odd-bytes": ("train_gpt.py", lambda t, f: gpt_data(
        f, t, "train_000000.bin", (f.corpus / "train_000000.bin").read_bytes()[:-1])),
    "gpt-shard-shorter-than-a-row": ("train_gpt.py", short_shard),
    "eval-items-not-json": ("eval_gpt.py", lambda t, f: [f"--ckpt={f.gpt}", f"--items={put(t / 'mc.jsonl', NOT_JSON)}",
                                                         "--device=cpu"]),
    "eval-items-not-utf8": ("eval_gpt.py", lambda t, f: [f"--ckpt={f.gpt}", f"--items={put(t / 'mc.jsonl', NOT_UTF8)}",
                                                         "--device=cpu"]),
    # train_vit.py
    "vit-out_dir-is-a-file": ("train_vit.py", lambda t, f: img(f, t, IMG, f"--out_dir={put(t / 'o', 'x')}")),
    "vit-n_head-0": ("train_vit.py", lambda t, f: img(f, t, IMG, "--n_head=0")),
    "vit-beta2-1": ("train_vit.py", lambda t, f: img(f, t, IMG, "--beta2=1")),
    "vit-mlp_ratio-negative": ("train_vit.py", lambda t, f: img(f, t, IMG, "--mlp_ratio=-1")),
    "vit-eval_images-negative": ("train_vit.py", lambda t, f: img(f, t, IMG, "--eval_images=-1")),
    "vit-predict-png-cut": ("predict_vit.py", lambda t, f: [
        f"--images={half(f.pngs / 'c0' / 'im0.png', t / 'a.png')}", f"--ckpt={f.vit}", "--device=cpu"]),
    "vit-predict-ckpt-cut": ("predict_vit.py", lambda t, f: [
        f"--images={f.pngs}", f"--ckpt={half(next(f.vit.glob('ckpt_*.pt')), t / 'c.pt')}", "--device=cpu"]),
    "vit-predict-moved": ("train_vit.py", lambda t, f: [f"--predict={f.pngs}", f"--ckpt={f.vit}"]),
    "vit-resume-ckpt-cut": ("train_vit.py", lambda t, f: resume_from_cut(
        f, t, next(f.vit.glob("ckpt_*.pt")), img(f, t, IMG))),
    "vit-meta-json-not-json": ("train_vit.py", lambda t, f: img_data(f, t, IMG, "meta.json", "\x00\x01")),
    "vit-prepare-interrupted-no-meta-json": ("train_vit.py", lambda t, f: img_data(f, t, IMG, "meta.json", None)),
    "vit-images-npy-cut": ("train_vit.py", lambda t, f: img_data(
        f, t, IMG, "train_images.npy", (f.shapes / "train_images.npy").read_bytes()[:500])),
    "vit-labels-npy-not-npy": ("train_vit.py", lambda t, f: img_data(f, t, IMG, "val_labels.npy", b"\x93NUMPY")),
    # train_diffusion.py
    "dit-out_dir-is-a-file": ("train_diffusion.py", lambda t, f: img(f, t, DIT, f"--out_dir={put(t / 'o', 'x')}")),
    "dit-n_head-0": ("train_diffusion.py", lambda t, f: img(f, t, DIT, "--n_head=0")),
    "dit-beta1-negative": ("train_diffusion.py", lambda t, f: img(f, t, DIT, "--beta1=-0.5")),
    "dit-mlp_ratio-0": ("train_diffusion.py", lambda t, f: img(f, t, DIT, "--mlp_ratio=0")),
    "dit-sample-ckpt-cut": ("sample_diffusion.py", lambda t, f: [
        f"--ckpt={half(next(f.dit.glob('ckpt_*.pt')), t / 'c.pt')}", "--device=cpu"]),
    "dit-sample-cfg_scale-negative": ("sample_diffusion.py", lambda t, f: [
        f"--ckpt={f.dit}", "--cfg_scale=-1", "--device=cpu"]),
    "dit-sample_out-is-a-folder": ("sample_diffusion.py", lambda t, f: [
        f"--ckpt={f.dit}", f"--out={folder(t / 'grid.png')}", "--device=cpu", "--sample_steps=1", "--per_class=1"]),
    "dit-sample_out-in-a-file": ("sample_diffusion.py", lambda t, f: [
        f"--ckpt={f.dit}", f"--out={put(t / 'f', 'x') / 'grid.png'}", "--device=cpu"]),
    "dit-sample-moved": ("train_diffusion.py", lambda t, f: ["--sample", f"--ckpt={f.dit}", "--cfg_scale=3"]),
    "dit-eval_classifier-ckpt-cut": ("train_diffusion.py", lambda t, f: img(
        f, t, DIT, f"--eval_classifier={half(next(f.vit.glob('ckpt_*.pt')), t / 'c.pt')}")),
    "dit-fid_weights-not-torchscript": ("train_diffusion.py", lambda t, f: img(
        f, t, DIT, f"--eval_classifier={f.vit}", f"--fid_weights={put(t / 'inception.pt', b'PK')}")),
    "dit-images-npy-cut": ("train_diffusion.py", lambda t, f: img_data(
        f, t, DIT, "val_images.npy", (f.shapes / "val_images.npy").read_bytes()[:300])),
    # finetune_gpt.py
    "ft-init_from-ckpt-cut": ("finetune_gpt.py", lambda t, f: gpt(f, t, f"--init_from={half(f.gpt, t / 'c.pt')}")),
    "sample-hf-config-not-json": ("sample_gpt.py", lambda t, f: [
        f"--ckpt={hf_folder(t, config='{model_type')}", "--device=cpu"]),
    "sample-hf-safetensors-cut": ("sample_gpt.py", lambda t, f: [
        f"--ckpt={hf_folder(t, weights=cut_safetensors(t))}", "--device=cpu"]),
    "sample-hf-bin-cut": ("sample_gpt.py", lambda t, f: [
        f"--ckpt={hf_folder(t, weights=('pytorch_model.bin', f.gpt.read_bytes()[:999]))}", "--device=cpu"]),
    "ft-teacher-ckpt-cut": ("finetune_gpt.py", lambda t, f: gpt(f, t, f"--teacher={half(f.gpt, t / 'c.pt')}")),
    "ft-distill_temp-0": ("finetune_gpt.py", lambda t, f: gpt(f, t, f"--teacher={f.gpt}", "--distill_temp=0")),
    "ft-export-int8-ckpt-cut": ("finetune_gpt.py", lambda t, f: [
        "--export=int8", f"--ckpt={half(f.gpt, t / 'c.pt')}", f"--out_dir={t / 'o'}"]),
    "ft-export-hf-out_dir-is-a-file": ("finetune_gpt.py", lambda t, f: [
        "--export=hf", f"--ckpt={f.gpt}", f"--out_dir={put(t / 'o', 'x')}"]),
    # chat_gpt.py
    "chat-prepare-not-json": ("chat_gpt.py", lambda t, f: chat(
        f, f"--prepare={put(t / 'c.jsonl', NOT_JSON)}", f"--data_dir={t / 'd'}")),
    "chat-prepare-not-utf8": ("chat_gpt.py", lambda t, f: chat(
        f, f"--prepare={put(t / 'c.jsonl', NOT_UTF8)}", f"--data_dir={t / 'd'}")),
    "chat-prepare-init_from-cut": ("chat_gpt.py", lambda t, f: chat(
        f, "--prepare=arithmetic", f"--init_from={half(f.gpt, t / 'c.pt')}", f"--data_dir={t / 'd'}")),
    "chat-prepare-data_dir-is-a-file": ("chat_gpt.py", lambda t, f: chat(
        f, "--prepare=arithmetic", "--conversations=4", f"--data_dir={put(t / 'd', 'x')}")),
    "chat-mask-shard-cut": ("chat_gpt.py", chat_data_cut),
    "chat-ckpt-cut": ("chat_gpt.py", lambda t, f: [
        "--chat", f"--ckpt={half(f.chat_model, t / 'c.pt')}", "--prompt=hi", "--device=cpu"]),
    "chat-max_new_tokens-0": ("chat_gpt.py", lambda t, f: [
        "--chat", f"--ckpt={f.chat_model}", "--prompt=hi", "--max_new_tokens=0", "--device=cpu"]),
    "chat-temperature-negative": ("chat_gpt.py", lambda t, f: [
        "--chat", f"--ckpt={f.chat_model}", "--prompt=hi", "--temperature=-0.5", "--device=cpu"]),
    # prepare_data.py
    "prep-text-data_dir-is-a-file": ("prepare_data.py", lambda t, f: [
        "text", str(put(t / "a.txt", "hello world\n" * 50)), f"--data_dir={put(t / 'd', 'x')}"]),
    "prep-shapes-data_dir-in-a-file": ("prepare_data.py", lambda t, f: [
        "shapes", f"--data_dir={put(t / 'f', 'x') / 'd'}", "--train_size=4", "--val_size=2", "--image_size=8"]),
    "prep-text-shard_tokens-0": ("prepare_data.py", lambda t, f: [
        "text", str(put(t / "a.txt", "hello\n" * 50)), f"--data_dir={t / 'd'}", "--shard_tokens=0"]),
    "prep-imagefolder-image_size-0": ("prepare_data.py", lambda t, f: [
        "imagefolder", str(f.pngs), f"--data_dir={t / 'd'}", "--image_size=0"]),
    "prep-imagefolder-val_fraction-nan": ("prepare_data.py", lambda t, f: [
        "imagefolder", str(f.pngs), f"--data_dir={t / 'd'}", "--val_fraction=nan"]),
    "prep-imagefolder-png-cut": ("prepare_data.py", cut_png),
    "prep-cifar10-download-corrupt": ("prepare_data.py", lambda t, f: [
        "cifar10", f"--data_dir={put(t / 'd' / 'cifar-10-python.tar.gz', b'not a tar').parent}"]),
    "prep-mnist-download-cut": ("prepare_data.py", lambda t, f: cut_mnist(t)),
    # scaling.py
    "scaling-compare-run-missing": ("scaling.py", lambda t, f: ["compare", str(t / "nothing"),
                                                                f"--out={t / 'c.png'}"]),
    "scaling-compare-metrics-not-json": ("scaling.py", lambda t, f: [
        "compare", str(put(t / "r" / "metrics.jsonl", NOT_JSON).parent), f"--out={t / 'c.png'}"]),
    "scaling-compare-metrics-not-utf8": ("scaling.py", lambda t, f: [
        "compare", str(put(t / "r" / "metrics.jsonl", NOT_UTF8).parent), f"--out={t / 'c.png'}"]),
    "scaling-compare-out-in-a-file": ("scaling.py", lambda t, f: [
        "compare", str(put(t / "r" / "metrics.jsonl", '{"step": 1, "loss": 2.0}\n').parent),
        f"--out={put(t / 'f', 'x') / 'c.png'}"]),
    "scaling-coord_check-out_dir-in-a-file": ("scaling.py", lambda t, f: [
        "coord_check", f"--out_dir={put(t / 'f', 'x') / 'cc'}", "--widths=16,32", "--steps=1", "--seeds=1"]),
    "scaling-compare-out-format-unknown": ("scaling.py", lambda t, f: [
        "compare", str(put(t / "r" / "metrics.jsonl", '{"step": 1, "loss": 2.0}\n').parent),
        f"--out={t / 'c.plot'}"]),
    "scaling-plan-fit-json-cut": ("scaling.py", lambda t, f: [
        "plan", "--flops=1e12", "--out_dir=" + str(put(t / "s" / "fit.json", '{"params": {').parent)]),
    "scaling-plan-fit-json-no-params": ("scaling.py", lambda t, f: [
        "plan", "--flops=1e12", "--out_dir=" + str(put(t / "s" / "fit.json", "{}").parent)]),
    "scaling-plan-flops-nan": ("scaling.py", lambda t, f: ["plan", "--flops=nan", "--published=chinchilla"]),
    "scaling-fit-tsv-not-utf8": ("scaling.py", lambda t, f: ["fit", f"--tsv={put(t / 's.tsv', NOT_UTF8)}",
                                                             f"--out_dir={t / 'o'}"]),
    "scaling-sweep-ratio-0": ("scaling.py", lambda t, f: ["sweep", "--ratio=0", f"--data_dir={f.corpus}",
                                                          f"--out_dir={t / 'o'}"]),
    "scaling-sweep-sizes-0": ("scaling.py", lambda t, f: ["sweep", "--sizes=0", f"--data_dir={f.corpus}",
                                                          f"--out_dir={t / 'o'}"]),
    "scaling-sweep-lr-nan": ("scaling.py", lambda t, f: ["sweep", "--lr=nan", f"--data_dir={f.corpus}",
                                                         f"--out_dir={t / 'o'}"]),
    "scaling-coord_check-steps-0": ("scaling.py", lambda t, f: ["coord_check", "--steps=0", f"--out_dir={t / 'o'}"]),
    "scaling-lr_transfer-widths-not-numbers": ("scaling.py", lambda t, f: [
        "lr_transfer", "--widths=wide", f"--data_dir={f.corpus}", f"--out_dir={t / 'o'}"]),
    "scaling-sharpness-ckpt-cut": ("scaling.py", lambda t, f: ["sharpness", f"--ckpt={half(f.gpt, t / 'c.pt')}"]),
    # issue 61: a failed preparation leaves no new folder, a typo gets the nearest flag, a message names the right
    # flag and what the path holds, and nothing trained yet names the command that trains it
    "prep-text-bpe-too-large-in-new-folders": ("prepare_data.py", lambda t, f: [
        "text", str(put(t / "a.txt", "hello world\n" * 50)), f"--data_dir={t / 'new' / 'd'}", "--tokenizer=bpe:9000"]),
    "prep-flag-misspelt": ("prepare_data.py", lambda t, f: ["stdlib", "--data-dir=d"]),
    "prep-flag-of-another-command": ("prepare_data.py", lambda t, f: ["shapes", "--tokenizer=gpt2"]),
    "sample-ckpt-empty-folder": ("sample_gpt.py", lambda t, f: [f"--ckpt={folder(t / 'empty')}", "--device=cpu"]),
    "sample-ckpt-a-data-dir": ("sample_gpt.py", lambda t, f: [f"--ckpt={f.corpus}", "--device=cpu"]),
    "eval-ckpt-empty-folder": ("eval_gpt.py", lambda t, f: [f"--ckpt={folder(t / 'empty')}", "--device=cpu"]),
    "ft-init_from-empty-folder": ("finetune_gpt.py", lambda t, f: gpt(f, t, f"--init_from={folder(t / 'empty')}")),
    "ft-teacher-empty-folder": ("finetune_gpt.py", lambda t, f: gpt(f, t, f"--teacher={folder(t / 'empty')}")),
    "chat-nothing-trained": ("chat_gpt.py", lambda t, f: ["--chat", "--prompt=hi", "--device=cpu"]),
    "chat-nothing-trained-data-ready": ("chat_gpt.py", chat_data_here),
    "chat-ckpt-not-a-chat-model": ("chat_gpt.py", lambda t, f: [
        "--chat", f"--ckpt={f.gpt}", f"--data_dir={f.chat}", "--prompt=hi", "--device=cpu"]),
    # issue 61 in the trainers: a device that is not there, a head count with the ones that work, the other kind of data
    "gpt-device-mps-missing": ("train_gpt.py", lambda t, f: gpt(f, t, "--device=mps")),
    "gpt-n_head-3-of-64": ("train_gpt.py", lambda t, f: gpt(f, t, "--n_embd=64", "--n_head=3")),
    "vit-n_head-3-of-64": ("train_vit.py", lambda t, f: img(f, t, IMG, "--n_embd=64", "--n_head=3")),
    "gpt-data_dir-of-images": ("train_gpt.py", lambda t, f: gpt(f, t, f"--data_dir={f.shapes}")),
    "vit-data_dir-of-text": ("train_vit.py", lambda t, f: img(f, t, IMG, f"--data_dir={f.corpus}")),
    "dit-data_dir-of-text": ("train_diffusion.py", lambda t, f: img(f, t, DIT, f"--data_dir={f.corpus}")),
    # issue 80: an item whose label is past its endings said "not a multiple-choice item", as if its shape were wrong
    "eval-items-label-past-its-endings": ("eval_gpt.py", lambda t, f: [
        f"--ckpt={f.gpt}", f"--items={put(t / 'mc.jsonl', LABEL_4_OF_4)}", "--device=cpu"]),
    # issue 80's sweep: a classifier of one class, RL resumed when it is done, a regex echoed as typed, a GPT-2
    # folder whose config.json is not its weights'
    "vit-data_dir-of-one-class": ("train_vit.py", lambda t, f: img(f, t, IMG, f"--data_dir={one_class(t)}",
                                                                   "--eval_images=8")),
    "rl-resume-a-finished-run": ("rl_gpt.py", rl_finished),
    "sample-hf-config-narrower-than-its-weights": ("sample_gpt.py", lambda t, f: [
        f"--ckpt={hf_folder(t, weights=gpt2_weights(t, n_embd=16))}", "--device=cpu"]),
    "sample-hf-config-deeper-than-its-weights": ("sample_gpt.py", lambda t, f: [
        f"--ckpt={hf_folder(t, config=HF_TWO_LAYERS, weights=gpt2_weights(t))}", "--device=cpu"]),
    "sample-hf-config-shallower-than-its-weights": ("sample_gpt.py", lambda t, f: [
        f"--ckpt={hf_folder(t, weights=gpt2_weights(t, n_layer=2))}", "--device=cpu", "--max_new_tokens=1"]),
    "rl-answer_regex-not-a-regex": ("rl_gpt.py", lambda t, f: rl(f, t, r"--answer_regex=(\d+")),
    # an old flag's new command, with the user's own values: --out_dir (or a preset's) as --ckpt, and the flags given
    "gpt-sample-moved-own-out_dir": ("train_gpt.py", lambda t, f: ["--sample", "--prompt=def f(x):",
                                                                   "--out_dir=runs/mine"]),
    "gpt-eval_only-moved-a-presets-out_dir": ("train_gpt.py", lambda t, f: ["--preset=gpt2_124m", "--eval_only"]),
    "ft-sample-moved-own-out_dir": ("finetune_gpt.py", lambda t, f: ["--sample", "--out_dir=runs/ft"]),
    "vit-predict-moved-own-ckpt": ("train_vit.py", lambda t, f: ["--predict=pngs", "--ckpt=runs/vit"]),
    "dit-sample_out-moved-own-out_dir": ("train_diffusion.py", lambda t, f: ["--sample_out=g.png", "--out_dir=runs/dit"]),
}
SAYS = {  # what the line must say, beyond the one line that every case ends in
    "gpt-device-mps-missing": "--device=mps but MPS is not available",
    "gpt-n_head-3-of-64": "--n_head=1|2|4|8|16|32 would", "vit-n_head-3-of-64": "--n_head=1|2|4|8|16|32 would",
    "gpt-data_dir-of-images": "holds images, which train_vit.py and train_diffusion.py read",
    "vit-data_dir-of-text": "holds token shards (text), which train_gpt.py reads",
    "dit-data_dir-of-text": "holds token shards (text), which train_gpt.py reads",
    "vit-data_dir-of-one-class": "/one holds images of 1 class (circle); a classifier needs at least 2",
    "sample-hf-config-narrower-than-its-weights": "/hf/model.safetensors: wte.weight is 64x16 there, but "
                                                  "config.json (n_layer 1, n_embd 8, vocab_size 64, 16 positions) "
                                                  "makes it 64x8; the weights and config.json",
    "sample-hf-config-deeper-than-its-weights": "/hf/model.safetensors holds no h.1.ln_1.weight, which config.json "
                                                "(n_layer 2,",
    "sample-hf-config-shallower-than-its-weights": "/hf/model.safetensors holds h.1.attn.c_attn.bias, of a layer "
                                                   "beyond config.json's n_layer 1;",
    "gpt-sample-moved-own-out_dir": "error: --sample moved: python sample_gpt.py --ckpt=runs/mine "
                                    "--prompt='def f(x):'",
    "gpt-eval_only-moved-a-presets-out_dir": "moved: python eval_gpt.py --ckpt=out/gpt2_124m --items=data/hellaswag",
    "ft-sample-moved-own-out_dir": "moved: python sample_gpt.py --ckpt=gpt2 --prompt=TEXT (or --ckpt=runs/ft, this "
                                   "script's run)",
    "vit-predict-moved-own-ckpt": "error: --predict moved: python predict_vit.py --ckpt=runs/vit --images=PATH",
    "dit-sample_out-moved-own-out_dir": "moved: python sample_diffusion.py --ckpt=runs/dit --out=PATH.png",
    "rl-resume-a-finished-run": "/rl is complete at step 2; raise its budget (--max_steps, --time_budget, ...)",
    "rl-answer_regex-not-a-regex": "error: --answer_regex='(\\d+' is no regular expression (missing ), unterminated ",
    "prep-flag-misspelt": "error: unrecognized arguments: --data-dir=d; did you mean --data_dir?",
    "prep-flag-of-another-command": "error: unrecognized arguments: --tokenizer=gpt2; see python prepare_data.py "
                                    "shapes -h",
    "sample-ckpt-empty-folder": "/empty: no checkpoint there, nor a Hugging Face GPT-2 folder (an empty folder); give "
                                "a checkpoint of train_gpt.py, a GPT-2 folder, or one of gpt2,",
    "eval-ckpt-empty-folder": "error: --ckpt=",
    "sample-ckpt-a-data-dir": "/corpus: no checkpoint there, nor a Hugging Face GPT-2 folder (a data dir: "
                              "--data_dir takes it); give a checkpoint",
    "ft-init_from-empty-folder": "/empty: no checkpoint there, nor a Hugging Face GPT-2 folder (an empty folder); give",
    "ft-teacher-empty-folder": "error: --teacher=",
    "chat-nothing-trained": "error: --out_dir=out/chat: no checkpoint there (no such file or folder); train a chat "
                            "model first: python chat_gpt.py --init_from=out/gpt --data_dir=data/arith_chat "
                            "--prepare=arithmetic, then python chat_gpt.py --init_from=out/gpt "
                            "--data_dir=data/arith_chat --out_dir=out/chat",
    "chat-nothing-trained-data-ready": "error: --out_dir=out/chat: no checkpoint there (no such file or folder); "
                                       "train a chat model first: python chat_gpt.py --init_from=out/gpt "
                                       "--data_dir=data/arith_chat --out_dir=out/chat",
    "eval-items-label-past-its-endings": "mc.jsonl:1: label 4 is not an index of its 4 endings (0..3)",
    "chat-ckpt-not-a-chat-model": "is no chat model (its tokenizer has no template); train a chat model first: python "
                                  "chat_gpt.py --init_from=out/gpt --data_dir=",
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_ends_in_one_line(case, fx, tmp_path, capfd):
    script, setup = CASES[case]
    argv = setup(tmp_path, fx)
    code, out, err, new = run(script, argv, tmp_path)
    assert not problems(script, code, out, err, new), err[-3000:]
    assert SAYS.get(case, "") in err.strip().split("\n")[-1], err[-3000:]
    assert "Traceback" not in capfd.readouterr().err  # nothing reached the real stderr either


def test_a_real_process_ends_as_the_sweep_models_it(tmp_path):
    """One case as a user meets it, in a process of its own: exit status 1 and the one line that the in-process
    run gives (prepare_data.py: the cheapest script to start)."""
    argv = CASES["prep-text-data_dir-is-a-file"][1](tmp_path, None)
    code, _, err, _ = run("prepare_data.py", argv, tmp_path)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "prepare_data.py"), *argv], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    assert (p.returncode, p.stderr) == (code, err) == (1, err), p.stderr


BEFORE_THE_WORK = {  # id: (script, setup, the module and name of the work that the output path is checked before)
    "ft-export-int8-out_dir-in-a-file": ("finetune_gpt.py", lambda t, f: [
        "--export=int8", f"--ckpt={f.gpt}", f"--out_dir={put(t / 'f', 'x') / 'o'}"], ("finetune_gpt", "plain_weights")),
    "ft-export-hf-out_dir-is-a-file": ("finetune_gpt.py", lambda t, f: [
        "--export=hf", f"--ckpt={f.gpt}", f"--out_dir={put(t / 'o', 'x')}"], ("finetune_gpt", "plain_weights")),
    "chat-sft-out_dir-is-a-file": ("chat_gpt.py", lambda t, f: chat(
        f, f"--data_dir={f.chat}", f"--out_dir={put(t / 'o', 'x')}", "--max_steps=1"), ("chat_gpt", "build")),
    "chat-prepare-data_dir-in-a-file": ("chat_gpt.py", lambda t, f: chat(
        f, "--prepare=arithmetic", f"--data_dir={put(t / 'f', 'x') / 'd'}"), ("chat_gpt", "source_tokenizer")),
}


@pytest.mark.parametrize("case", list(BEFORE_THE_WORK))
def test_an_output_path_is_checked_before_the_work(case, fx, tmp_path, monkeypatch):
    """An output path that cannot be written stops the command before the work that would fill it (an export's
    conversion, SFT's training, --prepare's tokenizing): here that work raises if it starts at all."""
    script, setup, (module, name) = BEFORE_THE_WORK[case]
    argv = setup(tmp_path, fx)

    def work(*args, **kwargs):
        raise AssertionError(f"{name} ran before the output path was checked")
    monkeypatch.setattr(importlib.import_module(module), name, work)
    code, out, err, new = run(script, argv, tmp_path)
    assert not problems(script, code, out, err, new), err[-3000:]
    assert "cannot be written: " in err.strip().split("\n")[-1], err[-3000:]


def test_an_interrupted_or_failed_preparation_leaves_no_new_folder(tmp_path, monkeypatch):
    """A preparation stopped by Ctrl-C (or SIGTERM, which prepare_data.py turns into one) after it made its data dir,
    and a download that fails, each in folders that did not exist: neither leaves a folder behind."""
    import prepare_data

    def interrupted(path, tokens):
        raise KeyboardInterrupt
    monkeypatch.setattr(prepare_data, "write_shard", interrupted)
    argv = ["text", str(put(tmp_path / "a.txt", "hello world\n" * 50)), f"--data_dir={tmp_path / 'new' / 'd'}"]
    code, out, err, new = run("prepare_data.py", argv, tmp_path)
    assert not problems("prepare_data.py", code, out, err, new) and "error: interrupted: " in err, err
    monkeypatch.setattr(prepare_data, "HELLASWAG_URL", (tmp_path / "nowhere" / "hellaswag_val.jsonl").as_uri())
    code, out, err, new = run("prepare_data.py", ["hellaswag", f"--data_dir={tmp_path / 'new' / 'hs'}"], tmp_path)
    assert not problems("prepare_data.py", code, out, err, new) and "error: cannot download " in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


KILLED = os.path.join("train", "c1", "im5.png")  # the 14th of 16 train images: in chunk 7 of 8, of two images each


def decode_or_be_killed(root, paths, size):
    """prepare_data.load_images in a worker that is killed (SIGKILL, as the OOM killer kills) when it is given the
    chunk that holds KILLED; the other chunks decode to black, which this test does not read."""
    import numpy as np
    if any(str(root / os.fsdecode(p)).endswith(KILLED) for p in paths):
        os.kill(os.getpid(), signal.SIGKILL)
    return np.zeros((len(paths), size, size, 3), np.uint8), False


def draw_or_be_killed(seed, index, m, size, rotate):
    """prepare_data.draw_shapes in a worker that is killed (SIGKILL) when it is given chunk 1 of the train split
    (seed 0); the other chunks are black."""
    import numpy as np
    if (seed, index) == (0, 1):
        os.kill(os.getpid(), signal.SIGKILL)
    return np.zeros((m, size, size, 3), np.uint8), np.zeros(m, np.int64)


# prepare_data.py's main in a process of its own, its workers' task one that kills them (argv[3]: the command)
KILLING = """import sys
sys.path[:0] = sys.argv[1:3]
import prepare_data, test_sweep
if sys.argv[3] == "imagefolder":
    prepare_data.load_images = test_sweep.decode_or_be_killed
    prepare_data.CHUNK_BYTES = 2 * 8 * 8 * 3  # two images a chunk
else:
    prepare_data.draw_shapes = test_sweep.draw_or_be_killed
sys.exit(prepare_data.main(sys.argv[3:]))
"""


@pytest.mark.parametrize("command", ["imagefolder", "shapes"])
def test_a_worker_killed_from_outside_ends_in_one_line(command, tmp_path):
    """Issue 80: a worker of prepare_data.py's pool killed from outside (SIGKILL, as the OOM killer does) while it
    decodes or draws a chunk stops the command in one line that names the chunk and the likely cause, memory, and
    leaves nothing behind; multiprocessing.Pool waited for the dead worker's result for ever. The worker kills itself
    on a chosen chunk, and the timeout only ends a command that hangs."""
    from PIL import Image
    for split, n in (("train", 8), ("val", 1)):  # 16 train images of two classes, and a val folder of 2
        for c in ("c0", "c1"):
            for i in range(n):
                put(tmp_path / split / c / f"im{i}.png", b"")
                Image.new("RGB", (8, 8)).save(tmp_path / split / c / f"im{i}.png")
    flags = [f"--data_dir={tmp_path / 'd'}", "--image_size=8", "--workers=2"]
    if command == "imagefolder":
        argv = ["imagefolder", str(tmp_path / "train"), f"--val={tmp_path / 'val'}", *flags]
        killed, n = 7, 8
    else:
        argv = ["shapes", "--train_size=600", "--val_size=10", *flags]  # chunks of 256 images: 3 for train
        killed, n = 2, 3
    before = set(tmp_path.rglob("*"))
    p = subprocess.run([sys.executable, "-c", KILLING, ROOT, os.path.dirname(__file__), *argv], capture_output=True,
                       cwd=tmp_path, timeout=120)  # bytes: text mode would turn the progress line's \r into \n
    new = sorted(str(q.relative_to(tmp_path)) for q in set(tmp_path.rglob("*")) - before)
    err = p.stderr.decode()
    assert not problems("prepare_data.py", p.returncode, p.stdout.decode(), err, new), err
    line = err.strip().split("\n")[-1]
    assert "a worker process was killed from outside" in line and "memory ran out" in line, line
    # the chunks that were in flight when the pool broke (any of them may have been the killed worker's) hold it
    m = re.search(rf" chunks? (\d+)(?:-(\d+))? of {n} ", line)
    assert m and int(m[1]) <= killed <= int(m[2] or m[1]) and "--workers" in line, line


def test_kernels_py_refuses_an_unknown_argument(tmp_path):
    """python kernels.py takes --bench or --bench_window (a GPU's timings), or nothing or -h (its docstring): a typo
    is refused in one line with exit status 1, not answered with the docstring and exit 0 as if a bench had run."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "kernels.py"), "--bnech"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120)
    line = ("kernels.py: error: unknown argument '--bnech'; its flags are --bench and --bench_window (a GPU's "
            "timings)\n")
    assert (p.returncode, p.stdout, p.stderr) == (1, "", line), p.stderr
