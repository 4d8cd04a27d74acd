"""The images fence's two paths (issue 63): a split copied to the device, or read from its file a batch ahead on the
host. Both give the same batches for the same seed, resume exactly, and train to the same numbers; a damaged or
foreign array stops in one line that names it."""
import os

import numpy as np
import pytest
import torch

import prepare_data
import train_diffusion as td
import train_vit as tv
from test_train_vit import records, run_script

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """Shapes of 16x16: 203 train (an epoch ends in a partial batch), 40 val."""
    d = tmp_path_factory.mktemp("shapes")
    splits = {"train": prepare_data.make_shapes(203, 16, 0), "val": prepare_data.make_shapes(40, 16, 1)}
    prepare_data.write_images(d, splits, list(prepare_data.SHAPES), "shapes")
    return d


def loaders(data_dir, on_device, world_size=2, B=8):
    """One ImageLoader a rank, over the train split of data_dir."""
    _, arrays = tv.load_image_data(str(data_dir))
    return [tv.ImageLoader(*arrays["train"], B, r, world_size, CPU, 5, on_device) for r in range(world_size)]


def test_both_paths_give_the_same_batches_and_resume_alike(shapes):
    """Three epochs of batches on two ranks, pixels and labels, from the device path and the host path; then each
    resumes mid-epoch from the other's state."""
    dev, host = loaders(shapes, True), loaders(shapes, False)
    assert host[0].where.endswith("(host)") and dev[0].where == "held on cpu"
    for step in range(30):  # 12 global batches of 16 an epoch: into the third epoch
        for a, b in zip(dev, host):
            (xa, ya), (xb, yb) = a.next(), b.next()
            assert torch.equal(xa, xb) and torch.equal(ya, yb), step
            assert a.state() == b.state() and len(b.ahead) == 2  # two more batches read while this one trains
    assert dev[0].epoch == 2 and dev[0].pos > 0
    state = host[1].state()
    resumed = loaders(shapes, True)[1]
    resumed.load_state(state)  # the host path's place, taken up by the device path
    for _ in range(20):
        xa, ya = host[1].next()
        xb, yb = resumed.next()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("mod", [tv, td])
def test_a_split_that_shrinks_under_the_host_path_stops_in_one_line(shapes, tmp_path, mod):
    """Issue 80: the train split cut short while the host path reads it (rewritten, a failing disk): the next batch
    stops the run in one line that names the file, from the reading thread too, not with an EOFError traceback."""
    import shutil
    d = tmp_path / "d"
    shutil.copytree(shapes, d)
    _, arrays = mod.load_image_data(str(d))
    ld = mod.ImageLoader(*arrays["train"], 8, 0, 1, CPU, 5, False)
    ld.next()
    with open(d / "train_images.npy", "r+b") as f:
        f.truncate(os.path.getsize(d / "train_images.npy") // 2)
    with pytest.raises(SystemExit, match="train_images.npy ends before image .*changed while this run read it"):
        for _ in range(30):  # an epoch: some batch reaches past the cut
            ld.next()


def test_the_host_path_holds_no_copy_of_the_split(shapes):
    """The host path's images are a HostImages over the file, which reads only the rows asked for."""
    ld = loaders(shapes, False, world_size=1)[0]
    assert isinstance(ld.x, tv.HostImages) and ld.x.shape == (203, 16, 16, 3)
    full = np.load(shapes / "train_images.npy")
    rows = torch.tensor([7, 0, 202, 7])  # out of order, repeated, the last
    assert np.array_equal(ld.x[rows].numpy(), full[rows.numpy()])
    assert np.array_equal(ld.x[195:].numpy(), full[195:])


def test_auto_takes_the_device_only_when_the_split_fits(shapes, monkeypatch):
    """auto: the device while both splits take under a quarter of its free memory; a flag forces either path."""
    _, arrays = tv.load_image_data(str(shapes))
    need = sum(x.nbytes for x, _ in arrays.values())
    cfg = tv.Config(loader="auto")
    monkeypatch.setattr(tv, "host_memory", lambda: 4 * need + 4)
    assert tv.data_on_device(cfg, arrays, CPU)
    monkeypatch.setattr(tv, "host_memory", lambda: 4 * need - 4)
    assert not tv.data_on_device(cfg, arrays, CPU)
    assert tv.data_on_device(tv.Config(loader="device"), arrays, CPU)
    monkeypatch.setattr(tv, "host_memory", lambda: 1e15)
    assert not tv.data_on_device(tv.Config(loader="host"), arrays, CPU)


@pytest.mark.parametrize("trainer", [tv, td])
def test_both_paths_train_to_the_same_numbers(shapes, tmp_path, trainer):
    """A short fp32 run of each trainer on each path: the same losses at every step, the same evals."""
    tiny = dict(n_layer=1, n_head=2, n_embd=32, patch_size=4, batch_size=16, max_steps=6, time_budget=0.0,
                eval_every=3, log_every=1, device="cpu", compile="false", dtype="float32", data_dir=str(shapes))
    if trainer is td:
        tiny |= dict(sample_steps=2, per_class=1, eval_images=40, eval_samples=10, final_samples=10)
    else:
        tiny |= dict(eval_images=40)
    for path in ("device", "host"):
        trainer.main(trainer.Config(**tiny, loader=path, out_dir=str(tmp_path / path)))
    for key in ("loss", "val_loss"):
        a, b = records(tmp_path / "device", key), records(tmp_path / "host", key)
        assert a and a == b, key


@pytest.mark.parametrize("damage, message", [
    ("truncated", "train_images.npy: ValueError"),
    ("float32", "train_images.npy is float32"),
    ("pickled", "train_images.npy: ValueError"),
])
def test_a_damaged_or_foreign_array_is_refused_in_one_line(shapes, tmp_path, damage, message):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(shapes):
        os.symlink(shapes / f, bad / f)
    os.remove(bad / "train_images.npy")
    x = np.load(shapes / "train_images.npy")
    if damage == "truncated":  # a copy cut short: the header promises more rows than the file holds
        data = (shapes / "train_images.npy").read_bytes()
        (bad / "train_images.npy").write_bytes(data[:len(data) - 1000])
    elif damage == "float32":
        np.save(bad / "train_images.npy", x.astype(np.float32))
    else:  # an object array, which only a pickle can hold
        np.save(bad / "train_images.npy", np.array([x[0], "x"], dtype=object), allow_pickle=True)
    p = run_script(f"--data_dir={bad}", "--loader=host", "--max_steps=1", f"--out_dir={tmp_path}/o", cwd=tmp_path)
    assert p.returncode != 0 and message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert str(bad / "train_images.npy") in p.stderr
