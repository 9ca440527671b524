"""transformers' LlamaForCausalLM, MixtralForCausalLM, Qwen3ForCausalLM and Qwen3MoeForCausalLM as
the oracles for dtrain's Llama model, its mixture of experts and its per-head query/key norms
(tests/llama_test.cpp).

  python llama_oracle.py OUT [--tied] [--mixtral | --qwen3 | --qwen3-moe]
writes OUT/model (save_pretrained: config.json + model.safetensors) of a small random Llama with
grouped-query attention (its norms' weights drawn too, so they count), or with --mixtral a Mixtral
of 4 experts, top-2 (save_pretrained writes its experts one by one, as the Hub's checkpoints:
block_sparse_moe.experts.J.w1/w2/w3), with --qwen3 a Qwen3 (q_norm and k_norm, a head_dim of 12
where hidden_size / heads is 8), with --qwen3-moe a Qwen3-MoE of the same attention (4 experts,
top-2, its first layer dense by mlp_only_layers, norm_topk_prob false: the chosen scores as they
are; mlp.experts.J.gate_proj/up_proj/down_proj in the file), and OUT/expected.safetensors:
"ids" [2, 12] and the logits on them in float32 ("logits32", transformers as it is) and in float64
("logits64"), and in float64 the mean next-token cross-entropy ("loss64") and its gradients
("grad." and the file's tensor names). In float64 transformers' own float32 islands (LlamaRMSNorm
and the rotary tables compute in float32 whatever the model's dtype) are replaced by the same formulas in the input's
dtype, and attention is its "sdpa" implementation (its "eager" one takes the softmax in float32);
Mixtral's and Qwen3-MoE's routers, which take their softmax in float32, keep the input's dtype
too, and their experts are the loop over experts (torch's grouped_mm has no float64). The rest is
transformers' code."""
import sys

import torch
from safetensors.torch import save_file
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.models.llama import modeling_llama
from transformers.models.mixtral import modeling_mixtral
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe


def rms_norm_in_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def rotary_in_dtype(self, x, position_ids):
    dim = self.inv_freq.shape[0] * 2
    theta = self.config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), \
        (emb.sin() * self.attention_scaling).to(x.dtype)


def router_in_dtype(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    router_probs = router_logits.softmax(dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # (Mixtral's always)
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value, router_indices


def main():
    out = sys.argv[1]
    tied = "--tied" in sys.argv
    torch.manual_seed(0)
    mixtral = "--mixtral" in sys.argv
    qwen3 = "--qwen3" in sys.argv
    qwen3_moe = "--qwen3-moe" in sys.argv
    sizes = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                 rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=tied)
    if mixtral:
        config = MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **sizes)
        kind = MixtralForCausalLM
    elif qwen3:
        config = Qwen3Config(head_dim=12, **sizes)
        kind = Qwen3ForCausalLM
    elif qwen3_moe:
        config = Qwen3MoeConfig(head_dim=12, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=24, mlp_only_layers=[0],
                                norm_topk_prob=False, **sizes)
        kind = Qwen3MoeForCausalLM
    else:
        config = LlamaConfig(**sizes)
        kind = LlamaForCausalLM
    config._attn_implementation = "eager"
    model = kind(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.2)  # larger than the init's 0.02: logits that differ
    model.save_pretrained(out + "/model")
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits32 = model(ids).logits
        modeling_llama.LlamaRMSNorm.forward = rms_norm_in_dtype
        modeling_llama.LlamaRotaryEmbedding.forward = rotary_in_dtype
        modeling_mixtral.MixtralRMSNorm.forward = rms_norm_in_dtype
        modeling_mixtral.MixtralRotaryEmbedding.forward = rotary_in_dtype
        modeling_mixtral.MixtralTopKRouter.forward = router_in_dtype
        modeling_qwen3.Qwen3RMSNorm.forward = rms_norm_in_dtype
        modeling_qwen3.Qwen3RotaryEmbedding.forward = rotary_in_dtype
        modeling_qwen3_moe.Qwen3MoeRMSNorm.forward = rms_norm_in_dtype
        modeling_qwen3_moe.Qwen3MoeRotaryEmbedding.forward = rotary_in_dtype
        modeling_qwen3_moe.Qwen3MoeTopKRouter.forward = router_in_dtype
        model.config._experts_implementation = "eager"  # (grouped_mm has no float64)
        model.config._attn_implementation = "sdpa"
    model.double()
    logits64 = model(ids).logits
    # The mean next-token cross-entropy's gradients, under the file's names.
    loss = torch.nn.functional.cross_entropy(logits64[:, :-1].reshape(-1, logits64.shape[-1]),
                                             ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {}
    # transformers 5 stacks the experts the file holds one by one: Mixtral's as
    # block_sparse_moe.experts.J.w1/w3/w2, Qwen3-MoE's as mlp.experts.J.gate_proj/up_proj/down_proj.
    moe, (w_gate, w_up, w_down) = (("mlp.", ("gate_proj", "up_proj", "down_proj")) if qwen3_moe
                                   else ("block_sparse_moe.", ("w1", "w3", "w2")))
    for name, parameter in model.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[:-len("mlp.experts.gate_up_proj")] + moe + "experts."
            gate, up = parameter.grad.chunk(2, dim=1)
            for j in range(gate.shape[0]):
                grads[f"{prefix}{j}.{w_gate}.weight"] = gate[j]
                grads[f"{prefix}{j}.{w_up}.weight"] = up[j]
        elif name.endswith("experts.down_proj"):
            prefix = name[:-len("mlp.experts.down_proj")] + moe + "experts."
            for j in range(parameter.shape[0]):
                grads[f"{prefix}{j}.{w_down}.weight"] = parameter.grad[j]
        else:
            grads[name.replace("mlp.gate.", moe + "gate.")] = parameter.grad
    tensors = {"ids": ids, "logits32": logits32, "logits64": logits64.detach(), "loss64": loss.detach()}
    tensors.update({"grad." + name: g for name, g in grads.items()})
    save_file({name: t.contiguous() for name, t in tensors.items()}, out + "/expected.safetensors")


if __name__ == "__main__":
    main()
