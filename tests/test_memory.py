import json

import numpy as np
import pytest

from lib.cache.kv_cache import KVCache
from lib.cache.memory import (
    GPU,
    H100,
    LLAMA_2_7B,
    LLAMA_3_8B,
    REAL_MODELS,
    from_hf_config,
    from_model_config,
    kv_budget,
    step_seconds,
)
from lib.config import DRAFT, TARGET, ModelConfig

GIB, KIB = 2**30, 2**10


@pytest.mark.parametrize("cfg", [TARGET, DRAFT, ModelConfig(2, 8, 2, 64)], ids=["target", "draft", "gqa"])
@pytest.mark.parametrize("dtype,name", [(np.float32, "float32"), (np.float16, "float16")])
def test_formula_equals_the_cache_arrays(cfg, dtype, name):
    for tokens in (1, 112, 512):
        assert from_model_config(cfg).kv_bytes(tokens, dtype=name) == KVCache(cfg, tokens, dtype).nbytes
    assert from_model_config(TARGET).kv_bytes(512, dtype="float32") == 1_572_864


def test_real_models_quoted_in_the_book():
    by_name = {m.name: m for m in REAL_MODELS}
    qwen = by_name["Qwen3-8B"]
    assert qwen.bytes_per_token() == 144 * KIB
    assert qwen.kv_bytes(32_768, batch=16) == 72 * GIB
    assert by_name["gpt-oss-20b"].kv_bytes(131_072) / GIB == pytest.approx(3.0, abs=0.01)
    assert all(m.source.startswith("https://huggingface.co/") for m in REAL_MODELS)


def test_reads_a_config_file_with_defaults(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}))
    spec = from_hf_config(path)
    assert (spec.n_kv_head, spec.head_dim, spec.windows) == (4, 16, (None, None))  # heads, hidden / heads
    assert spec.kv_bytes(10, dtype="float16") == 2 * 2 * 4 * 16 * 10 * 2


def test_reads_sliding_window_layer_types(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                                "head_dim": 32, "hidden_size": 128, "sliding_window": 16,
                                "layer_types": ["sliding_attention", "full_attention"] * 2}))
    spec = from_hf_config(path)
    per_position = 2 * 2 * 32 * 2
    assert spec.kv_bytes(100) == per_position * (2 * 100 + 2 * 16)
    assert spec.kv_bytes(10) == per_position * 4 * 10
    assert spec.bytes_per_token() == per_position * 2


def test_bad_inputs():
    with pytest.raises(ValueError, match="lacks 'hidden_size'"):
        from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4})
    with pytest.raises(ValueError, match="unknown dtype 'fp16'"):
        REAL_MODELS[0].kv_bytes(10, dtype="fp16")
    with pytest.raises(ValueError, match="layer_types has 1 entries for 2 layers"):
        from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 8, "layer_types": ["x"]})


def test_mla_hybrid_and_multi_head_baselines():
    by_name = {m.name: m for m in REAL_MODELS}
    deepseek, gemma = by_name["DeepSeek-V3"], by_name["Gemma-3-27B"]
    assert deepseek.bytes_per_token() == (512 + 64) * 61 * 2  # one latent per layer, bf16
    assert deepseek.bytes_per_token() / KIB == pytest.approx(68.6, abs=0.05)
    assert deepseek.multi_head().bytes_per_token() == 2 * 128 * 128 * 61 * 2  # DeepSeek-V2's MHA comparison
    assert sum(w is None for w in gemma.windows) == 10 and gemma.windows[:6] == (1024,) * 5 + (None,)
    assert gemma.kv_bytes(1) == 2 * 16 * 128 * 2 * 62 and gemma.bytes_per_token() == 2 * 16 * 128 * 2 * 10
    assert gemma.multi_head().bytes_per_token() == 2 * gemma.bytes_per_token()  # 32 query heads, 16 K/V heads
    assert (LLAMA_2_7B.bytes_per_token(), LLAMA_3_8B.bytes_per_token()) == (512 * KIB, 128 * KIB)
    assert LLAMA_3_8B.multi_head().bytes_per_token() == LLAMA_2_7B.bytes_per_token()
    assert from_model_config(TARGET).multi_head().bytes_per_token() == from_model_config(TARGET).bytes_per_token()


def test_max_tokens_inverts_kv_bytes():
    by_name = {m.name: m for m in REAL_MODELS}
    for m in REAL_MODELS:
        for budget, batch in ((1e6, 1), (3e9, 16), (20e9, 4)):
            t = m.max_tokens(budget, batch)
            if t is None:  # every layer windowed: the cache stops growing below the budget
                assert m.bytes_per_token() == 0 and m.kv_bytes(10**7, batch) <= budget
            else:
                assert m.kv_bytes(t, batch) <= budget < m.kv_bytes(t + 1, batch)
    assert by_name["Qwen3-8B"].max_tokens(-1.0) == -1
    assert by_name["Qwen3-8B"].max_tokens(144 * KIB * 10) == 10
    with pytest.raises(ValueError, match="budget must be a finite number"):
        by_name["Qwen3-8B"].max_tokens(float("inf"))


def test_tensor_parallel_shares():
    qwen = next(m for m in REAL_MODELS if m.name == "Qwen3-8B")  # 8 K/V heads
    assert qwen.per_gpu(2).kv_bytes(100) == qwen.kv_bytes(100) / 2
    assert qwen.per_gpu(8).n_kv_head == 1 and qwen.per_gpu(16).n_kv_head == 1  # replicated beyond 8
    deepseek = next(m for m in REAL_MODELS if m.name == "DeepSeek-V3")
    assert deepseek.per_gpu(8).bytes_per_token() == deepseek.bytes_per_token()  # the latent is on every GPU
    with pytest.raises(ValueError, match="tp=3 must divide the 8 KV heads"):
        qwen.per_gpu(3)


def test_gpu_budget_and_step_time():
    assert kv_budget(H100, 16e9, 0.9, 2e9) == pytest.approx(81559 * 2**20 * 0.9 - 18e9)
    assert kv_budget(H100, 100e9) < 0
    assert step_seconds(H100, 16e9, 4e9) == pytest.approx(20e9 / 3.35e12)
    with pytest.raises(ValueError, match="utilization must be in"):
        kv_budget(H100, 1e9, 1.5)
    with pytest.raises(ValueError, match="GPU.bandwidth must be"):
        GPU("x", 1e9, 0, 1e12)
