//! Scalar heads on the final hidden state: a critic's value head, a reward model's score.

use tch::{Device, Kind, Tensor};

/// A scalar head on the final hidden state (value head or reward head).
#[derive(Debug)]
pub struct ScalarHead {
    /// HF name prefix (`score` for reward models, `v_head` for critics).
    pub prefix: String,
    /// `[1, hidden]`.
    pub weight: Tensor,
    /// `[1]`, if any.
    pub bias: Option<Tensor>,
}

impl ScalarHead {
    /// A zero-initialised head (`bias` included for value heads).
    pub fn new(prefix: &str, hidden: i64, with_bias: bool, device: Device, kind: Kind) -> Self {
        let weight = Tensor::zeros([1, hidden], (kind, device));
        let bias = with_bias.then(|| Tensor::zeros([1], (kind, device)));
        ScalarHead {
            prefix: prefix.to_string(),
            weight,
            bias,
        }
    }
    /// Applies the head: `[.., hidden] → [..]`.
    pub fn forward(&self, h: &Tensor) -> Tensor {
        h.linear(&self.weight, self.bias.as_ref()).squeeze_dim(-1)
    }
}
