//! The dimensions of a llama model, with DeepSeek's latent attention sized from them,
//! and the dimensions of each tensor such a model has.

use super::roles::Role;

/// The dimensions of a llama model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LlamaShape {
    pub n_layer: u64,
    pub n_embd: u64,
    pub n_ff: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    pub head_dim: u64,
    pub n_vocab: u64,
    /// Routed experts per layer; 0 for a dense model. `n_ff` is then each expert's
    /// feed-forward width, as llama.cpp reads it for a llama mixture of experts.
    pub n_expert: u64,
    /// Experts a token runs per layer (0 for a dense model).
    pub n_expert_used: u64,
    /// Shared experts per layer, which every token runs (`ffn_*_shexp`, `n_ff` wide
    /// each); 0 for the llama mixture of experts.
    pub n_expert_shared: u64,
    /// Leading layers with a dense feed-forward network in place of experts
    /// (DeepSeek's and GLM's first layers), as wide as what a token runs in the
    /// others: its experts and the shared ones. The size is planned as if every
    /// layer had experts (the file comes out a dense layer's difference smaller).
    pub n_layer_dense_lead: u64,
}

impl LlamaShape {
    /// The dimensions of a model's tensor, by its name without the `blk.N.` prefix;
    /// `None` for a tensor a llama model does not have.
    pub(super) fn dims(&self, role: &str) -> Option<Vec<u64>> {
        let q = self.n_head * self.head_dim;
        let kv = self.n_head_kv * self.head_dim;
        let mla = self.latent_attention();
        Some(match role {
            "token_embd.weight" | "output.weight" => vec![self.n_embd, self.n_vocab],
            "output_norm.weight" | "attn_norm.weight" | "ffn_norm.weight" => vec![self.n_embd],
            "rope_freqs.weight" => vec![self.head_dim / 2],
            "attn_q.weight" => vec![self.n_embd, q],
            "attn_k.weight" | "attn_v.weight" => vec![self.n_embd, kv],
            "attn_output.weight" => vec![q, self.n_embd],
            "attn_q.bias" => vec![q],
            "attn_k.bias" | "attn_v.bias" => vec![kv],
            "attn_output.bias" | "ffn_down.bias" => vec![self.n_embd],
            "ffn_gate.weight" | "ffn_up.weight" => vec![self.n_embd, self.dense_ff()],
            "ffn_gate.bias" | "ffn_up.bias" => vec![self.dense_ff()],
            "ffn_down.weight" => vec![self.dense_ff(), self.n_embd],
            "ffn_gate_inp.weight" if self.n_expert > 0 => vec![self.n_embd, self.n_expert],
            "ffn_gate_exps.weight" | "ffn_up_exps.weight" if self.n_expert > 0 => {
                vec![self.n_embd, self.n_ff, self.n_expert]
            }
            "ffn_down_exps.weight" if self.n_expert > 0 => {
                vec![self.n_ff, self.n_embd, self.n_expert]
            }
            // Other architectures' (`arch`).
            "attn_q_norm.weight" | "attn_k_norm.weight" => vec![self.head_dim],
            "attn_sinks.weight" => vec![self.n_head],
            "post_attention_norm.weight" => vec![self.n_embd],
            "ffn_gate_inp.bias" if self.n_expert > 0 => vec![self.n_expert],
            "ffn_gate_exps.bias" | "ffn_up_exps.bias" if self.n_expert > 0 => {
                vec![self.n_ff, self.n_expert]
            }
            "ffn_down_exps.bias" if self.n_expert > 0 => vec![self.n_embd, self.n_expert],
            "exp_probs_b.bias" if self.n_expert > 0 => vec![self.n_expert],
            "ffn_gate_shexp.weight" | "ffn_up_shexp.weight" if self.n_expert_shared > 0 => {
                vec![self.n_embd, self.n_ff * self.n_expert_shared]
            }
            "ffn_down_shexp.weight" if self.n_expert_shared > 0 => {
                vec![self.n_ff * self.n_expert_shared, self.n_embd]
            }
            // DeepSeek's latent attention (`LatentAttention`).
            "attn_q_a.weight" => vec![self.n_embd, mla.q_lora_rank],
            "attn_q_a_norm.weight" => vec![mla.q_lora_rank],
            "attn_q_b.weight" => vec![mla.q_lora_rank, self.n_head * mla.key_length()],
            "attn_kv_a_mqa.weight" => vec![self.n_embd, mla.kv_lora_rank + mla.rope_dim],
            "attn_kv_a_norm.weight" => vec![mla.kv_lora_rank],
            "attn_k_b.weight" => vec![mla.nope_dim, mla.kv_lora_rank, self.n_head],
            "attn_v_b.weight" => vec![mla.kv_lora_rank, mla.value_length, self.n_head],
            _ => return None,
        })
    }

    /// The width of a dense feed-forward network: `n_ff`, or in a mixture of experts
    /// (its dense leading layers) what a token runs in the others.
    pub(in crate::model::synth) fn dense_ff(&self) -> u64 {
        if self.n_expert == 0 {
            self.n_ff
        } else {
            self.n_ff * (self.n_expert_used + self.n_expert_shared)
        }
    }

    /// The latent attention of a model of this shape, were it DeepSeek's.
    pub fn latent_attention(&self) -> LatentAttention {
        LatentAttention::for_head(self.head_dim)
    }

    /// Parameters (elements) of all tensors.
    pub(super) fn n_params(&self, globals: &[Role], layer: &[Role]) -> u64 {
        let count = |role: &Role| self.dims(&role.name).map_or(0, |d| d.iter().product());
        globals.iter().map(count).sum::<u64>() + self.n_layer * layer.iter().map(count).sum::<u64>()
    }
}

/// DeepSeek's multi-head latent attention (MLA), as llama.cpp loads it: queries
/// through a low-rank pair (`attn_q_a`, `attn_q_b`), keys and values compressed into
/// one latent row per token plus a shared rotated key part (`attn_kv_a_mqa`), and
/// expanded per head by `attn_k_b` and `attn_v_b`. The ranks are DeepSeek-V3's in
/// proportion to the head: with 128-wide value heads it has a 1536 query rank, a 512
/// latent, 128 unrotated and 64 rotated key dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatentAttention {
    pub q_lora_rank: u64,
    pub kv_lora_rank: u64,
    /// Key dimensions without rotation, per head.
    pub nope_dim: u64,
    /// Rotated key dimensions, shared by all heads.
    pub rope_dim: u64,
    /// Value dimensions per head.
    pub value_length: u64,
}

impl LatentAttention {
    pub(in crate::model::synth) fn for_head(head_dim: u64) -> LatentAttention {
        LatentAttention {
            q_lora_rank: 12 * head_dim,
            kv_lora_rank: 4 * head_dim,
            nope_dim: head_dim,
            rope_dim: head_dim / 2,
            value_length: head_dim,
        }
    }

    /// Key dimensions per head, as attention sees them (`key_length_mla`).
    pub fn key_length(&self) -> u64 {
        self.nope_dim + self.rope_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dense_network_in_a_mixture_is_as_wide_as_what_a_token_runs() {
        let shape = LlamaShape {
            n_layer: 4,
            n_embd: 64,
            n_ff: 32,
            n_head: 2,
            n_head_kv: 2,
            head_dim: 32,
            n_vocab: 100,
            n_expert: 16,
            n_expert_used: 2,
            n_expert_shared: 1,
            n_layer_dense_lead: 1,
        };
        assert_eq!(shape.dims("ffn_down.weight"), Some(vec![96, 64]));
        assert_eq!(shape.dims("ffn_up_shexp.weight"), Some(vec![64, 32]));
        assert_eq!(shape.dims("attn_k_b.weight"), Some(vec![32, 128, 2]));
        assert_eq!(shape.dims("attn_q_b.weight"), Some(vec![384, 96]));
        let dense = LlamaShape {
            n_expert: 0,
            n_expert_used: 0,
            ..shape
        };
        assert_eq!(dense.dims("ffn_down.weight"), Some(vec![32, 64]));
    }
}
