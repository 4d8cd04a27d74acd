"""Issue 80: a periodic eval just before the end only repeats the final one (a DiT run evaluated at 4,000 and again
at 4,005, a GPT at 1,000 and 1,003). Within a tenth of an interval of the end it is skipped, in every trainer."""
import math

import train_diffusion as td
import train_gpt as tg
import train_vit as tv
from test_train_diffusion import tiny as tiny_dit
from test_train_gpt import tiny as tiny_gpt
from test_train_vit import records, shapes  # noqa: F401 - shapes is a fixture
from test_train_vit import tiny as tiny_vit


def test_steps_left_counts_or_estimates():
    for m in (tg, tv, td):
        assert m.steps_left(40, 41, 0.0, 0.0, 0.0) == 1  # a step budget: counted
        assert m.steps_left(10, 0, 90.0, 100.0, 0.5) == 20  # a time budget: 10 s left at 0.5 s a step
        assert m.steps_left(0, 0, 0.0, 100.0, 0.0) == math.inf  # before the first sync nothing is known


def test_no_trainer_evaluates_twice_at_its_end(corpus, shapes, tmp_path):  # noqa: F811
    """41 steps, an eval each 20: evals at 0, 20 and 41, not at 40 as well (a step before the final one)."""
    runs = {"gpt": (tg, tiny_gpt(corpus, tmp_path / "gpt", max_steps=41, eval_every=20, eval_tokens=256), "val_loss"),
            "vit": (tv, tiny_vit(shapes, tmp_path / "vit", max_steps=41, eval_every=20), "val_acc"),
            "dit": (td, tiny_dit(shapes, tmp_path / "dit", max_steps=41, eval_every=20, sample_steps=2,
                                  eval_samples=10, final_samples=10), "val_loss")}
    for name, (m, cfg, key) in runs.items():
        m.main(cfg)
        assert sorted(records(cfg.out_dir, key)) == [0, 20, 41], name
    # an interval that ends a tenth or more before the end is kept: 0, 20, 40 and 42... (eval_every 20, 42 steps)
    cfg = tiny_gpt(corpus, tmp_path / "gpt42", max_steps=42, eval_every=20, eval_tokens=256)
    tg.main(cfg)
    assert sorted(records(cfg.out_dir, "val_loss")) == [0, 20, 40, 42]
