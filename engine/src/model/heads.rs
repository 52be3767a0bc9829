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
    /// What the head looks like, without its weights.
    pub fn shape(&self) -> HeadShape {
        HeadShape {
            prefix: self.prefix.clone(),
            bias: self.bias.is_some(),
        }
    }

    /// A head of `shape` that holds nothing (empty tensors): what a sharded rank's
    /// model carries between the runs of the unit that holds the head.
    pub fn empty(shape: &HeadShape, device: Device, kind: Kind) -> Self {
        let empty = || Tensor::empty([0], (kind, device));
        ScalarHead {
            prefix: shape.prefix.clone(),
            weight: empty(),
            bias: shape.bias.then(empty),
        }
    }

    /// Applies the head: `[.., hidden] → [..]`.
    pub fn forward(&self, h: &Tensor) -> Tensor {
        h.linear(&self.weight, self.bias.as_ref()).squeeze_dim(-1)
    }
}

/// A scalar head's shape without its weights: its name prefix and whether it has a
/// bias. With the model's config it lays the head out (`[1, hidden]`, and `[1]`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeadShape {
    /// HF name prefix (`v_head`, `score`).
    pub prefix: String,
    /// Whether it has a bias (value heads do).
    pub bias: bool,
}
