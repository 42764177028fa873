"""The real models the book prices: the fields of each official config.json that the KV formula and
the weights' reads need (`lib.gpu.memory.from_hf_config`), with the address of each config.json
and, where a parameter count is not in it, where that count comes from."""
from lib.gpu.memory import from_hf_config

# The fields of each official config.json that the formula and the weights' reads need, with its address.
REAL_MODELS = [
    from_hf_config({"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                    "head_dim": 128, "hidden_size": 4096, "vocab_size": 151936, "tie_word_embeddings": False},
                   "Qwen3-8B", 8.2e9,
                   "https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json"),
    from_hf_config({"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                    "hidden_size": 8192, "vocab_size": 152064, "tie_word_embeddings": False}, "Qwen2.5-72B-Instruct", 72.7e9,
                   "https://huggingface.co/Qwen/Qwen2.5-72B-Instruct/blob/main/config.json"),
    from_hf_config({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                    "hidden_size": 4096, "sliding_window": 4096, "vocab_size": 32000, "tie_word_embeddings": False},
                   "Mistral-7B-v0.1", 7.24e9,
                   "https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json"),
    from_hf_config({"num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
                    "head_dim": 64, "hidden_size": 2880, "sliding_window": 128,
                    "layer_types": ["sliding_attention", "full_attention"] * 12, "vocab_size": 201088,
                    "tie_word_embeddings": False, "num_local_experts": 32, "num_experts_per_tok": 4,
                    "intermediate_size": 2880}, "gpt-oss-20b", 20.9e9,
                   "https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json"),
    # text_config; sliding_window_pattern is Gemma3TextConfig's default, 5 local layers per global one.
    # Parameters of the text model: the technical report's Table 1, 1,416M embedding (tied: the
    # output head reads it) + 25,600M others; the 417M vision encoder aside.
    from_hf_config({"num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
                    "head_dim": 128, "hidden_size": 5376, "sliding_window": 1024, "sliding_window_pattern": 6,
                    "vocab_size": 262208, "tie_word_embeddings": True},
                   "Gemma-3-27B", 27.016e9, "https://huggingface.co/google/gemma-3-27b-it/blob/main/config.json"),
    # 671B parameters in the main model (the model card; the checkpoint adds a 14B MTP module).
    from_hf_config({"num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
                    "hidden_size": 7168, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                    "v_head_dim": 128, "vocab_size": 129280, "tie_word_embeddings": False, "n_routed_experts": 256,
                    "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "first_k_dense_replace": 3},
                   "DeepSeek-V3", 671e9,
                   "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json"),
]

# Hybrid models: K and V in a few full-attention layers, a constant state per sequence in the others
# (lib.gpu.memory's STATE_FIELDS). Qwen3-Next's config.json gives the layout as full_attention_interval
# (a layer_types list, where a revision gives one, reads the same), Jamba's as attn_layer_period and attn_layer_offset. No parameter
# counts: the weights' parts are not read for them (Jamba's experts sit in every other layer only).
HYBRID_MODELS = [
    from_hf_config({"num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                    "hidden_size": 2048, "full_attention_interval": 4, "linear_num_value_heads": 32,
                    "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                    "linear_conv_kernel_dim": 4}, "Qwen3-Next-80B-A3B",
                   source="https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json"),
    from_hf_config({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
                    "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_expand": 2, "mamba_d_state": 16,
                    "mamba_d_conv": 4}, "Jamba-v0.1", source="https://huggingface.co/ai21labs/Jamba-v0.1/blob/main/config.json"),
]

# The pair chapter 5 compares: the same 32 layers of 32 query heads of 128 dimensions, with 32
# K/V heads (multi-head) and with 8 (GQA).
LLAMA_2_7B = from_hf_config({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                             "hidden_size": 4096, "vocab_size": 32000, "tie_word_embeddings": False},
                            "Llama-2-7B", 6.74e9,
                            "https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json")
LLAMA_3_8B = from_hf_config({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                             "hidden_size": 4096, "vocab_size": 128256, "tie_word_embeddings": False},
                            "Llama-3-8B", 8.03e9,
                            "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json")
# The parameters a Llama-3.1-8B decode step reads: all 8.03e9 but the input embedding (128,256 x
# 4,096), whose rows are gathered, not read (torchao's model size counts the same: 15.01 GB in bf16).
LLAMA_READ_PARAMS = LLAMA_3_8B.weight_bytes("bfloat16", batch=1) / 2
