"""Model families (docs/estimator.md "Model families"): the parameter count gpuops reads from a config.json
equals what transformers builds from the same config (on the meta device, no weights), for Llama 3.2,
TinyLlama, Gemma-2, Phi-3, Mixtral, Qwen1.5-MoE and DeepSeek-V2-Lite."""

import json

import pytest
import torch
import transformers

import gpuops

# config.json values of the checkpoints (the fields that decide the parameter count), as the presets hold them.
CONFIGS = {
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, tie_word_embeddings=True),
    "llama-3.2-3b": dict(model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072, tie_word_embeddings=True),
    "tinyllama-1.1b": dict(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                           num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                           max_position_embeddings=2048, tie_word_embeddings=False),
    "gemma-2-2b": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                       num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       max_position_embeddings=8192, hidden_activation="gelu_pytorch_tanh", sliding_window=4096,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256),
    "gemma-2-9b": dict(model_type="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                       num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                       max_position_embeddings=8192, hidden_activation="gelu_pytorch_tanh", sliding_window=4096,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256),
    "phi-3-mini": dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       max_position_embeddings=4096, sliding_window=2047, tie_word_embeddings=False),
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=32768, num_local_experts=8, num_experts_per_tok=2),
    "qwen1.5-moe-a2.7b": dict(model_type="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                              moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
                              num_experts_per_tok=4, num_hidden_layers=24, num_attention_heads=16,
                              num_key_value_heads=16, max_position_embeddings=8192, decoder_sparse_step=1,
                              tie_word_embeddings=False),
    "deepseek-v2-lite": dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                             moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                             num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                             first_k_dense_replace=1, moe_layer_freq=1, q_lora_rank=None, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             max_position_embeddings=163840, tie_word_embeddings=False),
}

# Small variants that exercise the less common fields: mlp_only_layers, a q LoRA rank (MLA as in
# DeepSeek-V3), moe_layer_freq, biases.
SMALL = {
    "qwen2-moe-dense-layers": dict(model_type="qwen2_moe", vocab_size=1000, hidden_size=64, intermediate_size=96,
                                   moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
                                   num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, decoder_sparse_step=2, mlp_only_layers=[3]),
    "deepseek-v3-q-lora": dict(model_type="deepseek_v3", vocab_size=1000, hidden_size=64, intermediate_size=96,
                               moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                               first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                               qk_rope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1),
    "llama-biases": dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                         mlp_bias=True),
    "gemma": dict(model_type="gemma", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=32),
    "qwen2": dict(model_type="qwen2", vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}


def transformers_count(fields):
    fields = dict(fields)
    model_type = fields.pop("model_type")
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, ImportError) as e:  # a transformers without this model class
        pytest.skip(f"transformers {transformers.__version__} cannot build {model_type}: {e}")
    params = list(model.parameters())
    return config, sum(p.numel() for p in params), len(params)


@pytest.mark.parametrize("name", sorted({**CONFIGS, **SMALL}))
def test_parameter_count_matches_transformers(name):
    fields = {**CONFIGS, **SMALL}[name]
    config, expected, _ = transformers_count(fields)
    # The config as transformers writes it (every default filled in), and as the fields alone.
    for given in (config.to_dict(), fields):
        spec = gpuops._C.model_from_config_json(json.dumps(given), name)
        assert spec.parameter_count == expected, (name, given is fields)
    # gpuops.estimate reads the same dict.
    breakdown = gpuops.estimate(config=fields, precision="bf16-mixed", micro_batch=1, seq_len=128)
    assert breakdown.total_bytes > expected


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_presets_are_the_same_models(name):
    _, expected, _ = transformers_count(CONFIGS[name])
    assert gpuops._C.model_by_name(name).parameter_count == expected


def test_moe_spec_and_the_assumptions_of_an_unknown_model_type():
    mixtral = gpuops._C.model_by_name("mixtral-8x7b")
    assert (mixtral.model_type, mixtral.num_experts, mixtral.experts_per_token) == ("mixtral", 8, 2)
    assert mixtral.assumptions == []
    foo = gpuops._C.model_from_config_json(json.dumps(dict(
        model_type="foo", vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128)), "foo")
    assert len(foo.assumptions) == 1 and "model_type 'foo' is not known" in foo.assumptions[0]
    # Same count as the Llama it is read as.
    llama = dict(model_type="llama", vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128)
    assert foo.parameter_count == transformers_count(llama)[1]


def test_bad_model_configs_name_the_key():
    base = dict(model_type="mixtral", vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="num_experts_per_tok must be from 1 to num_experts"):
        gpuops.estimate(config={**base, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="'num_local_experts'"):
        gpuops.estimate(config={k: v for k, v in base.items() if k != "num_local_experts"})
    with pytest.raises(ValueError, match="'intermediate_size'"):
        gpuops.estimate(config={**base, "model_type": "foo", "intermediate_size": 0})
    # LoRA on a MoE model: the attention projections only.
    with pytest.raises(ValueError, match="q,k,v,o"):
        gpuops.estimate("mixtral-8x7b", lora_rank=8, lora_targets=("gate",))
