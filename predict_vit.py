"""
predict_vit.py: the class probabilities of your images, from a checkpoint of train_vit.py.

Each image is read as prepare_data.py stored the training images (its centre square, resized to
the checkpoint's image size), and the model of that run classifies it, with the EMA weights where
the run kept an EMA. It prints the most probable classes of each image, and returns them.

  python train_vit.py                                          # a run to predict with, in out/vit
  python predict_vit.py --ckpt=out/vit --images=my_images/     # every PNG/JPEG under a folder
  python predict_vit.py --ckpt=out/vit/ckpt_0001000.pt --images=cat.png --show=3
  python predict_vit.py -h                                     # every flag, with its default

It imports train_vit.py for the model, the checkpoint reader and the flag parser, so it reads
every checkpoint that train_vit.py writes (one file, or a folder of FSDP shards), and a damaged
or crafted one stops in the same one-line error.
"""
import dataclasses
import glob
import os
import sys
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

import train_vit as tv

# -----------------------------------------------------------------------------
# Config

@dataclass
class Config:
    images: str = ""  # an image file, or a folder searched for PNG/JPEG files
    ckpt: str = "out/vit"  # a checkpoint file, or a run's out_dir (its newest)
    show: int = 5  # classes shown per image, the most probable first
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"  # where the model runs

# train_vit.py's flag parser reads a script's presets; a prediction has no sizes to name
PRESETS = {}

IMAGE_TYPES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif")
# images per forward: a folder of thousands never needs the memory for all of them at once
BATCH = 256

def check_config(cfg):
    """Reject impossible flags in one line that names the fix, before any work."""
    # the flag parser checks a Literal's choices; a Config built in Python is checked here
    for field in dataclasses.fields(cfg):
        tv.choose(field, getattr(cfg, field.name))
    if not cfg.images:
        tv.die("name the images to classify: --images=FILE_OR_FOLDER")
    if cfg.show < 1:
        tv.die(f"--show must be at least 1, got {cfg.show}")

# -----------------------------------------------------------------------------
# Images and the model

def image_files(where):
    """The files to classify: where itself, or every image under the folder where, sorted."""
    if os.path.isfile(where):
        return [where]
    # recursive, so that a folder of one subfolder per class (prepare_data.py imagefolder's
    # layout) is read as it is
    found = glob.glob(os.path.join(where, "**", "*"), recursive=True)
    files = sorted(f for f in found if f.lower().endswith(IMAGE_TYPES))
    if not files:
        tv.die(f"--images={where}: no such image file, or no PNG/JPEG images in that folder")
    return files

def load_image(path, size, channels):
    """An image file as (size, size, channels) uint8: its centre square, resized as prepare_data.py does."""
    from PIL import Image, ImageOps
    # the same crop and filter as the training images had: a model sees an image as it saw them
    try:
        with Image.open(path) as im:
            im = im.convert("RGB" if channels == 3 else "L")
            a = np.asarray(ImageOps.fit(im, (size, size), Image.Resampling.BILINEAR))
    # a damaged file, or a pixel bomb (a tiny file that claims billions of pixels)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        tv.die(f"cannot read the image {path} ({type(e).__name__}: {e}); give PNG/JPEG files")
    return a.reshape(size, size, channels)

def load_model(path, ckpt, device):
    """(model in eval mode, image size, channels, class names) of the checkpoint ckpt read from path."""
    # Rebuilt from the run's own config: build_model then makes the very model that was trained.
    # Keys this train_vit.py no longer has (an older checkpoint's --predict, say) are left out.
    # Everything read from the file is inside exit_if_unreadable(): a crafted value stops in one line.
    with tv.exit_if_unreadable(path, "pass a checkpoint written by train_vit.py"):
        fields = tv.Config.__dataclass_fields__
        trained = tv.Config(**{k: v for k, v in ckpt["config"].items() if k in fields})
        meta = ckpt["data_meta"]
        model = tv.build_model(trained, meta, device).eval()
        # the EMA's weights classify better than the last step's, where the run kept them
        model.load_state_dict(ckpt.get("ema") or ckpt["model"])
        size = int(meta["image_size"][0])
        channels = int(meta["channels"])
        classes = [str(c) for c in meta["classes"]]
    return model, size, channels, classes

# -----------------------------------------------------------------------------
# Prediction

def main(cfg):
    """Print and return {image: {class: probability}}, the --show most probable classes of each image."""
    check_config(cfg)
    ckpt, path = None, None
    if os.path.exists(cfg.ckpt):  # a damaged file stops in load_checkpoint, saying what is wrong with it
        ckpt, path = tv.load_checkpoint(cfg.ckpt)
    if ckpt is None:
        tv.die(f"no complete checkpoint at {cfg.ckpt!r}; train first (python train_vit.py) or pass --ckpt=PATH")
    files = image_files(cfg.images)
    _, _, device = tv.setup_dist(cfg.device)
    model, size, channels, classes = load_model(path, ckpt, device)
    weights = "EMA" if ckpt.get("ema") else "raw"
    print(f"# {path} (step {ckpt['step']}, {weights} weights)")
    out = {}
    for i in range(0, len(files), BATCH):
        batch = files[i:i + BATCH]
        x = np.stack([load_image(f, size, channels) for f in batch])  # (B, size, size, channels) uint8
        # pixels in [0, 1], as in training: the model normalises by the data's mean and std itself
        x = torch.from_numpy(x).to(device).float() / 255
        with torch.no_grad():
            probs = model(x).float().softmax(-1).cpu()  # (B, classes)
        for f, p in zip(batch, probs):
            top = p.topk(min(cfg.show, len(classes)))
            out[f] = {classes[j]: float(v) for v, j in zip(top.values, top.indices)}
            shown = " | ".join(f"{c} {100 * v:.1f}%" for c, v in out[f].items())
            print(f"{f}: {shown}")
    return out

# -----------------------------------------------------------------------------
# Entry point

if __name__ == "__main__":
    main(tv.parse_args(Config, sys.argv[1:]))
