"""Files from someone else: a checkpoint, a shard, meta.json, a tokenizer, meta.pkl, PNGs. Corrupted many ways (seeded),
each must end in a one-line error, or in the documented fallback to the previous intact checkpoint; never in a
traceback, and a pickle's payload never runs."""
import json
import os
import pickle
import random
import shutil

import numpy as np
import pytest
import torch

import predict_vit as pv
import prepare_data
import sample_diffusion as sd
import train_diffusion as td
import sample_gpt
import train_gpt as tg
import train_vit as tv
from conftest import python_like_docs, write_corpus

TINY = dict(n_layer=1, n_head=2, n_embd=32, seq_len=16, batch_size=2, time_budget=0.0, warmup_steps=1, eval_every=0,
            eval_tokens=64, log_every=1, sample_tokens=0, device="cpu", compile="false")


class Payload:
    """Unpickling this runs a command that writes a file: what a crafted checkpoint or meta.pkl would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def outcome(fn, capfd):
    """'ok' if fn() returns, else its one-line error; any other exception fails the test, as does a traceback."""
    try:
        fn()
        result = "ok"
    except SystemExit as e:
        result = str(e.code)
        assert result and "\n" not in result.strip(), result
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    return result


def flips(data, rng, n):
    """data with n random bytes xor-ed with a random non-zero value."""
    b = bytearray(data)
    for _ in range(n):
        b[rng.randrange(len(b))] ^= rng.randrange(1, 256)
    return bytes(b)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """A tiny trained GPT: its data dir and a checkpoint at steps 2 and 4."""
    root = tmp_path_factory.mktemp("gpt")
    data = write_corpus(root / "data", n_train=60, n_val=10)
    tg.main(tg.Config(**{**TINY, "data_dir": str(data), "out_dir": str(root / "out"), "max_steps": 4, "save_every": 2,
                         "keep_last": 5}))
    return data, root / "out"


def mutated_checkpoints(ckpt, rng, marker):
    """Checkpoint dicts with a key missing, a value of the wrong type, a tensor of the wrong shape, an extra key, or a
    payload."""
    wrong = ["x", 7, [1, 2], None, {"a": 1}, 1.5, torch.zeros(3)]
    for k in ckpt:
        yield {j: v for j, v in ckpt.items() if j != k}
        yield {**ckpt, k: rng.choice(wrong)}
    name = next(iter(ckpt["model"]))
    yield {**ckpt, "model": {**ckpt["model"], name: torch.zeros(3, 3)}}
    yield {**ckpt, "model": {k: v for k, v in ckpt["model"].items() if k != name}}
    yield {**ckpt, "config": {**ckpt["config"], "n_embd": "wide"}}
    yield {**ckpt, "tokenizer": {"tokenizer": "bpe_9", "ranks": "!!! x\n", "pat_str": ".", "eot_id": 1}}
    yield {**ckpt, "extra": 1}
    yield {**ckpt, "model": Payload(marker)}
    yield Payload(marker)


def test_checkpoints_from_others(gpt_run, tmp_path, capfd):
    """--sample on a damaged or crafted file, and --resume from a directory whose newest checkpoint is one."""
    data, out = gpt_run
    rng, marker = random.Random(0), tmp_path / "PWNED"
    good = out / "ckpt_0000004.pt"
    raw = good.read_bytes()
    ckpt = torch.load(good, weights_only=True)
    files = []
    for i in range(30):  # truncated, or bytes flipped anywhere (tensor data, the pickle, the zip directory)
        files.append(raw[:rng.randrange(len(raw))] if i % 3 == 0 else flips(raw, rng, rng.randint(1, 5)))
    for i, c in enumerate(mutated_checkpoints(ckpt, rng, marker)):
        path = tmp_path / f"m{i}.pt"
        torch.save(c, path)
        files.append(path.read_bytes())
    results = []
    for i, blob in enumerate(files):
        path = tmp_path / f"case{i}.pt"
        path.write_bytes(blob)
        results.append(outcome(lambda: sample_gpt.main(sample_gpt.Config(ckpt=str(path), max_new_tokens=2, device="cpu")),
                               capfd))
        if i % 4 == 0:  # the same file as the newest of a run's checkpoints: --resume falls back or stops in one line
            run = tmp_path / f"run{i}"
            shutil.copytree(out, run)
            shutil.copy(path, run / "ckpt_0000006.pt")
            r = outcome(lambda: tg.main(tg.Config(**{**TINY, "data_dir": str(data), "out_dir": str(run), "max_steps": 7,
                                                     "resume": True})), capfd)
            assert r == "ok" or "ckpt_0000006.pt" in r, r
    assert not marker.exists()  # no payload ran
    assert results.count("ok") < len(results) and any("could run code" in r for r in results)
    assert any("truncated or corrupt" in r or "checksum" in r or "zip" in r for r in results), results


def test_data_dirs_from_others(gpt_run, tmp_path, capfd):
    """Damaged shards, meta.json with wrong types or keys, a crafted or malformed nanoGPT meta.pkl."""
    data, _ = gpt_run
    rng, marker = random.Random(1), tmp_path / "PWNED"
    run = lambda d, **kw: outcome(lambda: tg.main(tg.Config(**{**TINY, "data_dir": str(d), "max_steps": 1,  # noqa: E731
                                                               "out_dir": str(tmp_path / f"o{rng.random()}"), **kw})), capfd)
    shard = (data / "train_000000.bin").read_bytes()
    for i in range(12):
        d = tmp_path / f"shard{i}"
        shutil.copytree(data, d)
        (d / "train_000000.bin").write_bytes(shard[:rng.randrange(len(shard))] if i % 2 else flips(shard[:1024], rng, 3)
                                             + shard[1024:])
        run(d)
    meta = json.loads((data / "meta.json").read_text())
    wrong = ["x", -3, 0, [1], {"a": 1}, None, 2.5, True]
    variants = [{k: v for k, v in meta.items() if k != key} for key in meta]
    variants += [{**meta, key: rng.choice(wrong)} for key in meta for _ in range(2)]
    variants += [{**meta, "splits": {"val": {"tokens": "many", "bytes": 1}}}, {**meta, "tokenizer_file": "/etc/passwd"}]
    texts = [json.dumps(v) for v in variants] + ["{", "[]", "null", '"x"', "\x00\x01"]
    for i, text in enumerate(texts):
        d = tmp_path / f"meta{i}"
        shutil.copytree(data, d)
        (d / "meta.json").write_text(text)
        r = run(d)
        assert r == "ok" or "meta.json" in r, r
    nano = tmp_path / "nano"  # nanoGPT's layout: raw uint16 train.bin/val.bin and meta.pkl
    nano.mkdir()
    for split in ("train", "val"):
        (np.arange(3000) % 65).astype(np.uint16).tofile(nano / f"{split}.bin")
    for i, m in enumerate([Payload(marker), {"vocab_size": Payload(marker)}, {"vocab_size": "65"}, [1, 2],
                           {"vocab_size": 65, "itos": {"a": 1}}, {"vocab_size": 65, "itos": {i: chr(65 + i % 26) for i in range(65)}}]):
        (nano / "meta.pkl").write_bytes(pickle.dumps(m))
        r = run(nano)
        assert (r == "ok") == (i == 5), (i, r)
    (nano / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65})[:-3])  # truncated
    assert "meta.pkl" in run(nano)
    assert not marker.exists()


def test_tokenizer_files_from_others(tmp_path, capfd):
    """A BPE data dir whose tokenizer file has bad lines: one line at start, before any training."""
    text = tmp_path / "text"
    text.mkdir()
    for i, doc in enumerate(python_like_docs(80, 2)):
        (text / f"d{i}.py").write_text(doc)
    data = tmp_path / "bpe"
    prepare_data.main(["text", str(text), f"--data_dir={data}", "--tokenizer=bpe:300"])
    meta = json.loads((data / "meta.json").read_text())
    tok = data / meta["tokenizer_file"]
    lines = tok.read_text().splitlines()
    rng = random.Random(2)
    bad = ["!!!! 3", "YWJj", "YWJj x", "YWJj 1 2", "", "\x00"]
    for i in range(12):
        d = tmp_path / f"t{i}"
        shutil.copytree(data, d)
        ls = list(lines)
        ls[rng.randrange(len(ls))] = rng.choice(bad)
        (d / meta["tokenizer_file"]).write_text("\n".join(ls) + "\n")
        r = outcome(lambda: tg.main(tg.Config(**{**TINY, "data_dir": str(d), "out_dir": str(tmp_path / f"o{i}"),
                                                 "max_steps": 1})), capfd)
        assert r == "ok" or meta["tokenizer_file"] in r or "meta.json" in r, r
        assert r == "ok" or not (tmp_path / f"o{i}").exists()  # nothing written


def png_files(tmp_path, n=6):
    """A folder of n small PNGs in two class folders, and their bytes."""
    from PIL import Image
    root = tmp_path / "pngs"
    x, _ = prepare_data.make_shapes(n, 16, 3)
    for i, im in enumerate(x):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(im).save(root / f"c{i % 2}" / f"im{i}.png")
    return root


def bomb_png(path, side=40000):
    """A valid PNG header claiming side x side pixels (a decompression bomb) with almost no data."""
    import struct
    import zlib
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))  # noqa: E731
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def test_images_and_image_checkpoints_from_others(tmp_path, capfd):
    """Damaged PNGs and a pixel bomb, for prepare_data.py imagefolder and predict_vit.py; image meta.json with wrong
    types; damaged or crafted ViT and DiT checkpoints for predict_vit.py, sample_diffusion.py and --eval_classifier."""
    rng, marker = random.Random(3), tmp_path / "PWNED"
    root = png_files(tmp_path)
    shapes = tmp_path / "shapes"
    prepare_data.write_images(shapes, {"train": prepare_data.make_shapes(64, 16, 0), "val": prepare_data.make_shapes(16, 16, 1)},
                              list(prepare_data.SHAPES), "shapes")
    small = dict(n_layer=1, n_head=2, n_embd=16, patch_size=4, batch_size=8, time_budget=0.0, max_steps=2, warmup_steps=1,
                 eval_every=0, log_every=1, device="cpu", compile="false", data_dir=str(shapes))
    tv.main(tv.Config(**small, out_dir=str(tmp_path / "vit")))
    td.main(td.Config(**small, out_dir=str(tmp_path / "dit"), sample_steps=2, per_class=1, eval_images=8, final_samples=10))
    pngs = sorted(root.rglob("*.png"))
    for i in range(16):
        p = pngs[i % len(pngs)]
        blob = p.read_bytes()
        p.write_bytes(blob[:rng.randrange(8, len(blob))] if i % 2 else flips(blob, rng, rng.randint(1, 8)))
        r1 = outcome(lambda: prepare_data.main(["imagefolder", str(root), f"--data_dir={tmp_path / f'pd{i}'}",
                                                "--image_size=16"]), capfd)
        r2 = outcome(lambda: pv.main(pv.Config(images=str(root), ckpt=str(tmp_path / "vit"), device="cpu")), capfd)
        assert (r1 == "ok" or str(p) in r1) and (r2 == "ok" or str(p) in r2), (r1, r2)
        p.write_bytes(blob)
    bomb_png(pngs[0])
    assert "cannot read the image" in outcome(lambda: pv.main(pv.Config(images=str(pngs[0]), ckpt=str(tmp_path / "vit"),
                                                                        device="cpu")), capfd)
    meta = json.loads((shapes / "meta.json").read_text())
    for i, key in enumerate(meta):
        for value in ("x", -1, [3, "a"], None, {"a": 1}):
            d = tmp_path / f"img{i}{value!r:.3}"
            shutil.copytree(shapes, d)
            (d / "meta.json").write_text(json.dumps({**meta, key: value}))
            r = outcome(lambda: tv.main(tv.Config(**{**small, "data_dir": str(d), "out_dir": str(d / "o")})), capfd)
            assert r == "ok" or "meta.json" in r or str(d) in r, r
    for script, out, call in ((tv, "vit", lambda c: pv.main(pv.Config(images=str(pngs[1]), ckpt=c, device="cpu"))),
                              (td, "dit", lambda c: sd.main(sd.Config(ckpt=c, device="cpu", sample_steps=2,
                                                                      per_class=1))),
                              (td, "clf", lambda c: sd.main(sd.Config(ckpt=str(tmp_path / "dit"), device="cpu",
                                                                      sample_steps=2, per_class=1, eval_classifier=c,
                                                                      samples=10)))):
        good = script.list_checkpoints(str(tmp_path / ("vit" if out == "clf" else out)))[-1][1]
        ckpt = torch.load(good, weights_only=True)
        for i, c in enumerate(list(mutated_checkpoints(ckpt, rng, marker))[::3]):
            path = tmp_path / f"{out}{i}.pt"
            torch.save(c, path)
            outcome(lambda: call(str(path)), capfd)
    assert not marker.exists()
