//! What a mixture of experts synth writes: how many experts, how wide, and how its
//! routers choose among them.

use super::super::router::RouterLocality;
use super::super::SynthError;

/// A mixture of experts in place of each layer's feed-forward network, as llama.cpp
/// runs it for the llama architecture (Mixtral's layout): a router `ffn_gate_inp` and
/// the merged expert tensors `ffn_{gate,up,down}_exps`, expert index outermost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeSpec {
    /// Routed experts per layer.
    pub experts: u64,
    /// Experts a token runs per layer.
    pub used: u64,
    /// Each expert's feed-forward width over the embedding width; `None` keeps the
    /// small model's ratio (coarse experts, as Mixtral). Fine-grained models (OLMoE,
    /// Qwen3-MoE) have many experts of a fraction of it (0.25-0.5).
    pub ff_ratio: Option<f64>,
    /// How unevenly the router spreads tokens over a layer's experts: the spread of
    /// the log of its rows' scales (see `Fill::Router`). 0 gives every expert about the
    /// same share.
    pub skew: f32,
    /// How much each layer's router follows the one before it (see `Fill::Router`),
    /// 0 to 1: 0 draws every layer's router afresh, so which experts a token picks in
    /// one layer says nothing of the next; above 0, each expert of layer l + 1 has a
    /// predecessor in layer l whose router row it shares this part of, so tokens that
    /// pick one tend to pick the other, as in trained routers (inter-layer expert
    /// affinity).
    pub affinity: f32,
    /// Routing that follows the text, token and recent context (`router`); `None`
    /// picks nearly independently from token to token.
    pub locality: Option<RouterLocality>,
}

impl MoeSpec {
    /// The most experts synth writes per layer (real models: 8-256).
    pub const MAX_EXPERTS: u64 = 512;

    pub(super) fn check(&self) -> Result<(), SynthError> {
        if self.experts < 2 || self.experts > Self::MAX_EXPERTS {
            return Err(SynthError::Unsupported(format!(
                "{} experts per layer: synth writes 2 to {}",
                self.experts,
                Self::MAX_EXPERTS
            )));
        }
        if self.used == 0 || self.used > self.experts {
            return Err(SynthError::Unsupported(format!(
                "{} experts used per token of {}: must be 1 to {}",
                self.used, self.experts, self.experts
            )));
        }
        if let Some(ratio) = self
            .ff_ratio
            .filter(|r| !(r.is_finite() && *r > 0.0 && *r <= 16.0))
        {
            return Err(SynthError::Unsupported(format!(
                "expert feed-forward ratio {ratio}: must be above 0 and at most 16"
            )));
        }
        if !(self.skew.is_finite() && (0.0..=8.0).contains(&self.skew)) {
            return Err(SynthError::Unsupported(format!(
                "router skew {}: must be 0 to 8",
                self.skew
            )));
        }
        if !(self.affinity.is_finite() && (0.0..=1.0).contains(&self.affinity)) {
            return Err(SynthError::Unsupported(format!(
                "router affinity {}: must be 0 to 1",
                self.affinity
            )));
        }
        self.locality.as_ref().map_or(Ok(()), RouterLocality::check)
    }
}
