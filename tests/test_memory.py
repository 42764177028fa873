import json

import numpy as np
import pytest

from lib.cache.kv_cache import KVCache
from lib.config import DRAFT, TARGET, ModelConfig
from lib.gpu.memory import H100, UTILIZATION, WORKSPACE, expected_experts, from_hf_config, from_model_config, kv_budget
from lib.gpu.models import LLAMA_2_7B, LLAMA_3_8B, REAL_MODELS

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
    with pytest.raises(ValueError, match="layer_types must be a list of 2 strings"):
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


def test_tensor_parallel_shares():
    qwen = next(m for m in REAL_MODELS if m.name == "Qwen3-8B")  # 8 K/V heads
    assert qwen.per_gpu(2).kv_bytes(100) == qwen.kv_bytes(100) / 2
    assert qwen.per_gpu(8).n_kv_head == 1 and qwen.per_gpu(16).n_kv_head == 1  # replicated beyond 8
    deepseek = next(m for m in REAL_MODELS if m.name == "DeepSeek-V3")
    assert deepseek.per_gpu(8).bytes_per_token() == deepseek.bytes_per_token()  # the latent is on every GPU


def test_gpu_budget():
    assert kv_budget(H100, 16e9, 0.9, 2e9) == pytest.approx(81559 * 2**20 * 0.9 - 18e9)
    assert kv_budget(H100, 16e9) == kv_budget(H100, 16e9, UTILIZATION, WORKSPACE) and UTILIZATION == 0.9  # vLLM's default
    assert WORKSPACE == 2 * 2**30  # the book's one budget rule (chapter 4)
    assert kv_budget(H100, 100e9) < 0


def test_expected_experts_touched():
    assert expected_experts(32, 4, 0) == 0 and expected_experts(32, 4, 1) == pytest.approx(4)
    assert expected_experts(256, 8, 2) == pytest.approx(16 - 8 * 8 / 256)  # two tokens overlap by k^2/E on average
    assert expected_experts(32, 32, 5) == 32  # every expert active: all touched at once
    rng = np.random.default_rng(0)  # the formula against uniform routing, simulated
    draws = [len({int(e) for _ in range(16) for e in rng.choice(32, 4, replace=False)}) for _ in range(2000)]
    assert np.mean(draws) == pytest.approx(expected_experts(32, 4, 16), abs=0.1)  # std error ~0.04


def test_a_step_reads_neither_gathered_rows_nor_idle_experts():
    by_name = {m.name: m for m in REAL_MODELS}
    qwen, oss, deepseek, gemma = (by_name[n] for n in ("Qwen3-8B", "gpt-oss-20b", "DeepSeek-V3", "Gemma-3-27B"))
    assert qwen.weight_bytes(batch=1) == qwen.weight_bytes() - 151936 * 4096 * 2  # untied: rows gathered
    assert LLAMA_3_8B.weight_bytes(batch=1) / 1e9 == pytest.approx(15.01, abs=0.01)  # 8.03e9 - 128,256 x 4,096, bf16
    assert gemma.weight_bytes(batch=1) == gemma.weight_bytes()  # tied: the output head reads the matrix
    assert oss.expert_params == 24 * 32 * 3 * 2880 * 2880 and deepseek.expert_params == 58 * 256 * 3 * 7168 * 2048
    # active parameters per token, as the model cards give them: 3.6B (gpt-oss-20b) and 37B (DeepSeek-V3)
    assert oss.weight_bytes("float32", batch=1) / 4 / 1e9 == pytest.approx(3.6, abs=0.05)
    assert deepseek.weight_bytes("float32", batch=1) / 4 / 1e9 == pytest.approx(37, abs=0.5)
    reads = [deepseek.weight_bytes("fp8", batch=b) for b in (1, 8, 64, 512, 4096)]
    assert reads == sorted(reads) and reads[-1] <= deepseek.weight_bytes("fp8")  # more tokens, more experts
    assert oss.weight_bytes("bfloat16", "mxfp4") / GIB == pytest.approx(12.8, abs=0.05)  # the model card's checkpoint
    assert oss.per_gpu(2).weight_bytes(batch=3) == pytest.approx(oss.weight_bytes(batch=3) / 2)


def test_moe_and_embedding_fields_from_a_config():
    fields = {"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 8, "vocab_size": 10,
              "tie_word_embeddings": False, "n_routed_experts": 16, "num_experts_per_tok": 2,
              "moe_intermediate_size": 3, "first_k_dense_replace": 1}
    spec = from_hf_config(fields, n_params=1e4)
    assert (spec.embedding, spec.experts, spec.active, spec.expert_params) == (80, 16, 2, 3 * 16 * 3 * 8 * 3)
    assert from_hf_config(fields).expert_params == 0  # no parameter count: no parts of it
    assert from_hf_config(fields | {"tie_word_embeddings": True}, n_params=1e4).embedding == 0
    with pytest.raises(ValueError, match="embedding \\+ expert_params"):
        from_hf_config(fields, n_params=100)
    with pytest.raises(ValueError, match="num_experts_per_tok=17 is more than its 16 routed experts"):
        from_hf_config(fields | {"num_experts_per_tok": 17}, n_params=1e4)


def test_experts_without_experts_per_token_name_the_missing_key():
    fields = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 8, "num_local_experts": 8}
    with pytest.raises(ValueError, match="lacks num_experts_per_tok and moe_intermediate_size or intermediate_size"):
        from_hf_config(fields, n_params=1e4)
    with pytest.raises(ValueError, match="in some layers only"):
        from_hf_config(fields | {"num_experts_per_tok": 2, "intermediate_size": 4, "expert_layer_period": 2}, n_params=1e4)


def test_hybrid_models_count_attention_layers_and_a_constant_state():
    from lib.gpu.models import HYBRID_MODELS
    qwen_next, jamba = HYBRID_MODELS
    assert sum(w is None for w in qwen_next.windows) == 12 and qwen_next.n_layer == 48  # full_attention_interval 4
    assert [i for i, w in enumerate(jamba.windows) if w is None] == [4, 12, 20, 28]  # period 8, offset 4
    assert qwen_next.bytes_per_token() == 2 * 12 * 2 * 256 * 2 and jamba.bytes_per_token() == 2 * 4 * 8 * 128 * 2
    # Gated DeltaNet: 32 value heads x 128 x 128, and a kernel of 4 over 2 x 16 x 128 + 32 x 128 channels, in 36 layers
    assert qwen_next.state == 36 * (32 * 128 * 128 + 8192 * 3)
    assert jamba.state == 28 * (2 * 4096) * (16 + 3)  # Mamba: d_inner x (d_state + d_conv - 1) in 28 layers
    assert qwen_next.kv_bytes(0, batch=3) == 3 * 2 * qwen_next.state  # an empty sequence holds its state
    assert qwen_next.kv_bytes(1000) - qwen_next.kv_bytes(0) == 1000 * qwen_next.bytes_per_token()
    assert qwen_next.per_gpu(2).state == qwen_next.state // 2
