#pragma once
// A GPT-2-style language model in LibTorch (learned positions, pre-norm blocks with causal attention and a
// GELU MLP, final norm, head tied to the embedding): the built-in model of the batch-size tuning tool.
#include <torch/torch.h>

namespace bench {

struct Gpt2Config {
  int64_t vocab = 8192, positions = 1024, width = 256, heads = 4, layers = 4;
};

struct Gpt2BlockImpl : torch::nn::Module {
  explicit Gpt2BlockImpl(const Gpt2Config& c)
      : heads(c.heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})))),
        attn(register_module("attn", torch::nn::Linear(c.width, 3 * c.width))),
        attn_out(register_module("attn_out", torch::nn::Linear(c.width, c.width))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})))),
        fc(register_module("fc", torch::nn::Linear(c.width, 4 * c.width))),
        fc_out(register_module("fc_out", torch::nn::Linear(4 * c.width, c.width))) {}

  torch::Tensor forward(const torch::Tensor& x) {
    const auto b = x.size(0), s = x.size(1), w = x.size(2);
    const auto qkv = attn(ln1(x)).view({b, s, 3, heads, w / heads}).permute({2, 0, 3, 1, 4});
    const auto y = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], {}, 0.0, /*is_causal=*/true);
    const auto h = x + attn_out(y.transpose(1, 2).reshape({b, s, w}));
    return h + fc_out(torch::gelu(fc(ln2(h)), "tanh"));
  }

  int64_t heads;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear attn, attn_out;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc, fc_out;
};
TORCH_MODULE(Gpt2Block);

struct Gpt2LMImpl : torch::nn::Module {
  explicit Gpt2LMImpl(const Gpt2Config& c)
      : tokens(register_module("tokens", torch::nn::Embedding(c.vocab, c.width))),
        positions(register_module("positions", torch::nn::Embedding(c.positions, c.width))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.width})))) {
    for (int64_t i = 0; i < c.layers; ++i) blocks->push_back(Gpt2Block(c));
  }

  /// Mean next-token cross-entropy of a (batch, sequence) token tensor.
  torch::Tensor loss(const torch::Tensor& ids) {
    auto h = tokens(ids) + positions(torch::arange(ids.size(1), ids.options()));
    for (const auto& block : *blocks) h = block->as<Gpt2Block>()->forward(h);
    const auto logits = torch::matmul(ln_f(h), tokens->weight.t());  // tied head
    return torch::nn::functional::cross_entropy(logits.slice(1, 0, -1).flatten(0, 1).to(torch::kFloat),
                                                ids.slice(1, 1).flatten());
  }

  torch::nn::Embedding tokens, positions;
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm ln_f;
};
TORCH_MODULE(Gpt2LM);

}  // namespace bench
