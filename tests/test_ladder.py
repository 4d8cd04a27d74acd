"""The ladder's tricks (issue 78, BENCHMARKS.md "The ladder"): each one computes what it claims, samples through the
KV cache as it trains, and resumes exactly."""
import shutil

import pytest
import torch

import train_gpt as tg
from test_train_gpt import TINY, losses, tiny

VOCAB = 320


def model_of(vocab=VOCAB, **kw):
    """A tiny GPT whose weights are all non-trivial (the zero-initialised projections and head would hide a trick)."""
    cfg = tg.Config(**{**TINY, **kw})
    model = tg.build_model(cfg, vocab, torch.device("cpu"))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.2)
    return model


def same_weights(src, dst):
    """Copy src's weights into dst where their names agree; return the names dst has beyond src."""
    theirs = src.state_dict()
    mine = dst.state_dict()
    with torch.no_grad():
        for name, t in mine.items():
            if name in theirs:
                t.copy_(theirs[name])
    return sorted(set(mine) - set(theirs))


TRICKS = {"value_embeds": dict(value_embeds=True)}


@pytest.mark.parametrize("trick", TRICKS)
def test_a_trick_with_its_new_weights_at_zero_is_the_plain_model_and_otherwise_is_not(trick):
    """Each trick adds weights through a gate or a scale; with that scale at 0, it computes the plain GPT."""
    kw = TRICKS[trick]
    plain = model_of(**{**kw, trick: False})
    with_trick = model_of(**kw)
    extra = same_weights(plain, with_trick)
    assert extra  # the trick's own weights
    x = torch.randint(0, VOCAB, (2, 20))
    assert not torch.allclose(with_trick(x), plain(x), atol=1e-3)
    with torch.no_grad():
        for table in with_trick.value_embeds.values():
            table.weight.zero_()
    torch.testing.assert_close(with_trick(x), plain(x))


def test_value_embeddings_are_on_alternate_layers_from_the_last_and_train_as_embeddings():
    model = model_of(1100, value_embeds=True, n_layer=5)  # a BPE's vocabulary: the embedding gets 10x the LR
    assert sorted(model.value_embeds) == ["0", "2", "4"]
    assert [b.attn.ve_gate is not None for b in model.blocks] == [True, False, True, False, True]
    # a lookup is no matmul: the FLOPs count the gates, not the tables
    plain = model_of(1100, n_layer=5, value_embeds=False)
    gates = sum(b.attn.ve_gate.weight.numel() for b in model.blocks if b.attn.ve_gate is not None)
    assert model.flops_per_token() - plain.flops_per_token() == 6 * gates
    # the tables take the embedding's own LR and no weight decay, as the token embedding does
    cfg = tg.Config(**{**TINY, "value_embeds": True, "n_layer": 5})
    opts = tg.build_optimizers(cfg, model)
    embed = [g for o in opts for g in o.param_groups if any(p is model.wte.weight for p in g["params"])][0]
    assert all(any(t.weight is p for p in embed["params"]) for t in model.value_embeds.values())
    assert embed["weight_decay"] == 0.0 and embed["lr"] == 10 * cfg.lr
    x = torch.randint(0, 1100, (2, 20))
    model(x, x).backward()
    for table in model.value_embeds.values():  # only the rows of the tokens in x get gradient
        seen = table.weight.grad.abs().sum(1) > 0
        assert seen.any() and torch.equal(seen.nonzero().flatten(), x.unique())


@pytest.mark.parametrize("trick", TRICKS)
def test_a_trick_samples_through_the_kv_cache_as_it_trains(trick):
    model = model_of(**TRICKS[trick])
    x = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        full = model(x)
        cache = tg.KVCache(model.cfg.n_layer, model.cfg.seq_len)
        steps = [model(x[:, :8], cache=cache)[:, -1]] + [model(x[:, t:t + 1], cache=cache)[:, -1] for t in range(8, 20)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 7:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("trick", TRICKS)
def test_a_run_with_a_trick_resumes_exactly(corpus, tmp_path, trick):
    a, b = tmp_path / "a", tmp_path / "b"
    kw = TRICKS[trick]
    tg.main(tiny(corpus, a, max_steps=8, save_every=4, keep_last=5, **kw))
    b.mkdir()
    shutil.copy(a / "ckpt_0000004.pt", b)
    tg.main(tiny(corpus, b, max_steps=8, resume=True, **kw))
    la, lb = losses(a), losses(b)
    assert sorted(lb) == [5, 6, 7, 8] and all(la[s] == lb[s] for s in lb), (la, lb)
    # and the run's checkpoint says what it trained: a resume without the trick is refused
    with pytest.raises(SystemExit):
        tg.main(tiny(corpus, b, max_steps=10, resume=True, **{**kw, trick: False}))
