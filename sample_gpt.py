"""
sample_gpt.py: text from a trained GPT. It continues a prompt with a checkpoint of
train_gpt.py or finetune_gpt.py (LoRA and int8 ones too), or with GPT-2's own weights.

  python sample_gpt.py --ckpt=out/gpt --prompt="def fib(n):" --max_new_tokens=300
  python sample_gpt.py --ckpt=gpt2 --prompt="The meaning of life is"   # GPT-2 (a download)
  python sample_gpt.py -h          # every flag, with its default

Sampling is a job on a finished checkpoint, not a part of training, so it lives here, as
nanoGPT keeps sample.py beside train.py. The model, its KV-cache sampler and the tokenizer
all come from train_gpt.py; the checkpoint reader comes from finetune_gpt.py, which also
reads GPT-2's weights and folds LoRA adapters and int8 weights back into plain ones.
"""
import sys
from dataclasses import dataclass
from typing import Literal

import finetune_gpt as ft
import train_gpt as tg


@dataclass
class Config:
    # what to sample from
    ckpt: str = "out/gpt"  # a run's folder (its newest checkpoint), a ckpt_*.pt, gpt2[-medium|-xl...], a HF folder
    prompt: str = ""  # the text to continue; empty: start after an end-of-text token
    # how to sample
    max_new_tokens: int = 500  # tokens sampled after the prompt
    temperature: float = 0.8  # the logits are divided by it before the softmax; 0 = greedy
    top_k: int = 50  # sample among the k likeliest tokens only; 0 = all of them
    seed: int = 1337  # of the sampler's random generator: the same seed, the same text
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"  # auto: CUDA, else MPS, else the CPU


PRESETS = {}  # parse_args() offers a trainer's presets; sampling has none


def check_config(cfg):
    """Refuse impossible settings in one line, before the checkpoint is read."""
    if cfg.max_new_tokens < 1:
        tg.die(f"--max_new_tokens must be at least 1, got {cfg.max_new_tokens}")
    if cfg.temperature < 0 or cfg.top_k < 0:
        tg.die(f"need --temperature >= 0 and --top_k >= 0, got {cfg.temperature:g} and {cfg.top_k}")


def main(cfg):
    """Print a continuation of cfg.prompt; returns {"text", "ids"}."""
    check_config(cfg)
    device = tg.setup_dist(cfg.device)[2]
    model, tokenizer, step, path = ft.load_model(cfg.ckpt, device)
    ids, text = tg.sample(model, tokenizer, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.seed, cfg.prompt)
    print(f"# {path} (step {step})\n{text}")
    return {"text": text, "ids": ids}


if __name__ == "__main__":
    main(tg.parse_args(Config, sys.argv[1:]))
