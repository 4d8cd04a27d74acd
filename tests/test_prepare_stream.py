"""prepare_data.py imagefolder on a folder of 20,000 images: written a chunk at a time, in worker processes, in memory
well below a split's size, with the same bytes and meta.json as the whole-split code before it (issue 63)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

import prepare_data as pd

ROOT = Path(__file__).resolve().parent.parent
CLASSES = [f"n{k:08d}" for k in range(10)]  # ImageNet's class folders are WordNet ids such as n01440764

# Runs a command and prints the peak resident memory (KiB on Linux) of the largest process below this one: the
# command, or one of its workers (Linux hands a reaped child's peak up to its parent's RUSAGE_CHILDREN). A wrapper of
# its own, so that no earlier child of the test process counts.
PEAK_RSS = """
import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:]).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(rc)
"""


def make_folder(root, n, seed, gray=False):
    """n small images under root/CLASS/, spread over CLASSES: random colours, 16x16 or a little wider or taller
    (so the crop matters), every 7th a JPEG with ImageNet's upper-case .JPEG, the rest PNG."""
    rng = np.random.default_rng(seed)
    for c in CLASSES:
        (root / c).mkdir(parents=True, exist_ok=True)
    sizes = [(16, 16), (20, 16), (16, 24)]
    for i in range(n):
        w, h = sizes[i % 3]
        if gray:
            image = Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8))  # mode L
        else:
            image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        path = root / CLASSES[i % len(CLASSES)] / f"img_{i:06d}"
        if i % 7 == 0:
            image.save(path.with_suffix(".JPEG"), "JPEG")
        else:
            image.save(path.with_suffix(".png"))
    return root


def decode(paths, size):
    """The images as the whole-split code read them, from Pillow's calls: RGB, the centre square, bilinear."""
    out = []
    for p in paths:
        with Image.open(p) as im:
            out.append(np.asarray(ImageOps.fit(im.convert("RGB"), (size, size), Image.Resampling.BILINEAR)))
    return np.stack(out)


def listed(root):
    """(paths, labels) of a folder in the order the command writes them: classes sorted, then paths sorted."""
    paths, labels = [], []
    for k, c in enumerate(CLASSES):
        for p in sorted((root / c).iterdir()):
            paths.append(p)
            labels.append(k)
    return paths, np.array(labels)


def whole_split_stats(train):
    """meta.json's mean and std as the whole-split code computed them: float64 pixels of every k-th image."""
    every = max(1, len(train) // 10000)
    pix = train[::every].reshape(-1, train.shape[-1]).astype(np.float64) / 255
    return pix.mean(0).round(4).tolist(), pix.std(0).round(4).tolist()


def prepare(*args, peak=False):
    """Run prepare_data.py imagefolder in a subprocess, as a user would; with peak, through PEAK_RSS."""
    command = [sys.executable, "prepare_data.py", "imagefolder", *map(str, args)]
    if peak:
        command = [sys.executable, "-c", PEAK_RSS, *command]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """An ImageNet-like layout, small: train/CLASS/*.png|JPEG with 20,000 images and val/CLASS/ with 500."""
    d = tmp_path_factory.mktemp("stream")
    return make_folder(d / "train", 20000, seed=0), make_folder(d / "val", 500, seed=1)


def test_a_large_split_streams_in_little_memory(folders, tmp_path):
    train, val = folders
    out = tmp_path / "data"
    r = prepare(train, f"--val={val}", "--image_size=64", f"--data_dir={out}", "--workers=2", peak=True)
    assert r.returncode == 0, r.stderr
    peak = int(r.stdout.split()[-1]) * 1024  # bytes
    split = 20000 * 64 * 64 * 3  # 246 MB as uint8
    # Measured (2 cores, --workers=2): 72-76 MB at the peak, 29-31% of the split (in-process, --workers=0: 71 MB). Of
    # it, 52 MB is there before the first image: Python, numpy, tiktoken and the list of 20,000 paths; the rest is up
    # to 4 chunks of 2 MiB in flight. The whole-split code before it peaked at 2.2 GB on the same command: the split,
    # then a float64 copy of the 10,000 images sampled for the mean and std.
    assert peak < 0.4 * split, f"peak RSS {peak / 1e6:.0f} MB, the split {split / 1e6:.0f} MB"
    assert "train: 20,000/20,000 images" in r.stderr and "val: 500/500 images" in r.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format"] == "trainsuite-image-1" and meta["classes"] == CLASSES and meta["channels"] == 3
    assert meta["image_size"] == [64, 64] and meta["splits"] == {"train": {"images": 20000}, "val": {"images": 500}}
    # ordinary .npy files, as the trainers open them
    x = np.load(out / "train_images.npy", mmap_mode="r")
    assert x.shape == (20000, 64, 64, 3) and x.dtype == np.uint8
    paths, labels = listed(train)
    assert np.array_equal(np.load(out / "train_labels.npy"), labels)
    rows = [*range(0, 20000, 997), 169, 170, 19999]  # a sample, a chunk's edge (170 images of 64x64x3), the last
    assert np.array_equal(x[rows], decode([paths[i] for i in rows], 64))
    paths, labels = listed(val)
    assert np.array_equal(np.load(out / "val_images.npy"), decode(paths, 64))
    assert np.load(out / "val_labels.npy").dtype == np.int64
    assert np.array_equal(np.load(out / "val_labels.npy"), labels)


def test_in_process_bytes_and_meta_match_the_whole_split_code(folders, tmp_path):
    train, val = folders
    out = tmp_path / "data"
    pd.main(["imagefolder", str(train), f"--val={val}", "--image_size=16", f"--data_dir={out}", "--workers=0"])
    x = np.load(out / "train_images.npy")
    paths, labels = listed(train)
    assert np.array_equal(x, decode(paths, 16))
    assert np.array_equal(np.load(out / "train_labels.npy"), labels)
    meta = json.loads((out / "meta.json").read_text())
    mean, std = whole_split_stats(x)  # every 2nd of the 20,000
    assert meta["mean"] == mean and meta["std"] == std


def test_a_bad_image_near_the_end_leaves_nothing(tmp_path):
    train = make_folder(tmp_path / "train", 3000, seed=2)  # 18 chunks of 64x64x3
    bad = train / CLASSES[-1] / "zz_cut.JPEG"
    bad.write_bytes(b"\xff\xd8\xff\xe0 a JPEG cut short")
    out = tmp_path / "data"
    r = prepare(train, "--image_size=64", f"--data_dir={out}", "--workers=2", "--val_fraction=0.1")
    assert r.returncode != 0
    # progress (text=True reads its \r as a line's end), then one line of error that names the file: no traceback
    # from the main process or a worker
    lines = [s for s in r.stderr.splitlines() if s and not re.fullmatch(r"train: [\d,]+/[\d,]+ images", s)]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"prepare_data.py: error: cannot read the image {bad} (")
    assert not out.exists() and not list(tmp_path.glob(".data.tmp-*"))


def test_all_gray_keeps_one_channel(tmp_path):
    train = make_folder(tmp_path / "train", 1500, seed=3, gray=True)
    val = make_folder(tmp_path / "val", 40, seed=4, gray=True)
    out = tmp_path / "data"
    pd.main(["imagefolder", str(train), f"--val={val}", "--image_size=64", f"--data_dir={out}", "--workers=2"])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["channels"] == 1 and len(meta["mean"]) == len(meta["std"]) == 1
    x = np.load(out / "train_images.npy")
    paths, _ = listed(train)
    assert x.shape == (1500, 64, 64, 1) and np.array_equal(x, decode(paths, 64)[..., :1])
    assert (meta["mean"], meta["std"]) == whole_split_stats(x)
    paths, _ = listed(val)
    assert np.array_equal(np.load(out / "val_images.npy"), decode(paths, 64)[..., :1])
    assert not [f for f in os.listdir(out) if f.startswith("one_channel")]
