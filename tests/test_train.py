"""Training: the hand-written backward pass against finite differences, the batched forward
against the reference forward, and the optimiser's schedule."""
import numpy as np
import pytest
from conftest import perturbed_params

from lib.config import ModelConfig
from lib.corpus import MODULES, load_corpus
from lib.model import forward
from lib.train import loss_and_grads, lr_at, train

TINY = ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=8, block_size=8)


def float64_params(cfg, seed):
    return {k: v.astype(np.float64) for k, v in perturbed_params(cfg, seed).items()}


def reference_loss(params, cfg, idx, targets):
    losses = []
    for x, y in zip(idx, targets):
        z = forward(params, cfg, x)  # (T, V)
        z = z - z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        losses.append(-logp[np.arange(len(y)), y].mean())
    return np.mean(losses)


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_gradients_match_finite_differences(n_kv_head):
    cfg = ModelConfig(n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=8, block_size=8)
    params = float64_params(cfg, seed=n_kv_head)
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, 96, (2, 7)), rng.integers(0, 96, (2, 7))
    _, grads = loss_and_grads(params, cfg, idx, targets)
    eps = 1e-6
    for name, w in params.items():
        numeric = np.zeros_like(w)
        for i in np.ndindex(w.shape):
            old = w[i]
            w[i] = old + eps
            up = loss_and_grads(params, cfg, idx, targets, need_grads=False)[0]
            w[i] = old - eps
            down = loss_and_grads(params, cfg, idx, targets, need_grads=False)[0]
            w[i] = old
            numeric[i] = (up - down) / (2 * eps)
        rel = np.abs(numeric - grads[name]).max() / max(np.abs(numeric).max(), 1e-12)
        assert rel <= 1e-5, f"{name}: relative error {rel:.2e}"


def test_training_forward_equals_reference_forward():
    params = float64_params(TINY, seed=9)
    rng = np.random.default_rng(1)
    idx, targets = rng.integers(0, 96, (3, 8)), rng.integers(0, 96, (3, 8))
    loss, _ = loss_and_grads(params, TINY, idx, targets, need_grads=False)
    assert abs(loss - reference_loss(params, TINY, idx, targets)) < 1e-12


def test_schedule_warms_up_then_decays():
    lrs = [lr_at(s, 1000, 1e-3, 100) for s in range(1000)]
    assert lrs[0] == pytest.approx(1e-5) and lrs[99] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[99:], lrs[100:])) and lrs[-1] == pytest.approx(5e-5, rel=0.01)


def test_corpus_is_deterministic_and_split():
    a, b = load_corpus(), load_corpus()
    assert a.sha256 == b.sha256 and len(a.train_modules) + len(a.held_out_modules) + len(a.skipped) == len(MODULES)
    assert not set(a.train_modules) & set(a.held_out_modules)
    assert 1_500_000 < len(a.train) + len(a.held_out) < 2_600_000


def test_a_few_steps_lower_the_loss():
    corpus = load_corpus()
    cfg = ModelConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=16, block_size=32)
    _, record = train(cfg, steps=60, batch=8, seq_len=32, lr=1e-2, warmup=5, eval_every=30,
                      eval_windows=16, corpus=corpus, progress=False)
    losses = record["curve"]["train_loss"]
    assert np.mean(losses[-10:]) < np.mean(losses[:5]) - 0.5
    assert record["corpus_sha256"] == corpus.sha256


def test_corpus_skips_missing_or_non_ascii_modules_and_says_so(tmp_path, monkeypatch):
    import sysconfig

    from lib import corpus as corpus_module
    real = load_corpus().sha256
    (tmp_path / "abc.py").write_text("x = 1\n")
    (tmp_path / "ast.py").write_text("name = 'caf\u00e9'\n", encoding="latin-1")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    c = corpus_module.load_corpus()
    assert c.train_modules == ("abc",) and "ast" in c.skipped and len(c.skipped) == len(MODULES) - 1
    assert c.sha256 != real
