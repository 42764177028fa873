import json

import numpy as np
import pytest

from lib.config import DRAFT, TARGET, ModelConfig
from lib.kv_cache import KVCache
from lib.memory import REAL_MODELS, from_hf_config, from_model_config

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
