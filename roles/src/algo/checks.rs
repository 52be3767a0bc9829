//! The algorithms' error type, shape checks on their tensors and prompt-group indexing.

use tch::{Kind, Tensor};

/// What is wrong with the tensors or parameters handed to an algorithm.
#[derive(Debug, thiserror::Error)]
pub enum AlgoError {
    /// GAE was asked for without the critic's values.
    #[error("GAE needs the critic's values; run the critic before computing advantages")]
    MissingValues,
    /// A tensor has the wrong shape for its role.
    #[error("{what}: expected shape {expected}, got {got:?}; {hint}")]
    Shape {
        /// Which argument, e.g. "mask".
        what: &'static str,
        /// The expected shape in words, e.g. "[B, T] = [2, 3]".
        expected: String,
        /// The shape that was passed.
        got: Vec<i64>,
        /// How to fix it.
        hint: &'static str,
    },
    /// A tensor must hold floating-point values (f32/f64/bf16/f16).
    #[error("{what}: expected a floating-point tensor, got {kind:?}; convert with .to_kind(Kind::Float)")]
    NotFloat {
        /// Which argument.
        what: &'static str,
        /// The kind that was passed.
        kind: Kind,
    },
    /// The group ids do not have one entry per sample.
    #[error(
        "group ids: {got} entries for a batch of {batch} samples; pass one group id per sample"
    )]
    GroupIds {
        /// Number of samples in the batch.
        batch: i64,
        /// Number of group ids passed.
        got: usize,
    },
    /// A group-id tensor holds a negative id or is not an integer tensor.
    #[error("group id tensor: {0}")]
    GroupIdTensor(String),
    /// A hyper-parameter is out of its valid range.
    #[error("parameter {name} = {value}: {reason}")]
    Param {
        /// Parameter name as in the config struct.
        name: &'static str,
        /// The value passed.
        value: f64,
        /// The valid range / why it is rejected.
        reason: &'static str,
    },
    /// A response's step ends are not increasing or run past its tokens.
    #[error("step ends {ends:?} do not fit a response of {tokens} tokens; they must rise and end at most at its length")]
    StepEnds {
        /// The step ends passed.
        ends: Vec<u32>,
        /// The response's tokens.
        tokens: usize,
    },
    /// Two per-sample slices disagree in length.
    #[error("{what}: {a} vs {b} entries; both must have one entry per sample")]
    Length {
        /// Which pair of arguments.
        what: &'static str,
        /// First length.
        a: usize,
        /// Second length.
        b: usize,
    },
}

pub(crate) fn check_float(t: &Tensor, what: &'static str) -> Result<(), AlgoError> {
    if t.is_floating_point() {
        Ok(())
    } else {
        Err(AlgoError::NotFloat {
            what,
            kind: t.kind(),
        })
    }
}

/// Checks `t` is `[B, T]` and floating point; returns `(B, T)`.
pub(crate) fn check_bt(t: &Tensor, what: &'static str) -> Result<(i64, i64), AlgoError> {
    check_float(t, what)?;
    match t.size().as_slice() {
        [b, t_] => Ok((*b, *t_)),
        other => Err(AlgoError::Shape {
            what,
            expected: "[B, T] (batch × response tokens)".into(),
            got: other.to_vec(),
            hint: "token-level tensors are 2-D; unsqueeze a single sequence to [1, T]",
        }),
    }
}

/// Checks `t` has exactly the shape `[b, t]` and is floating point.
pub(crate) fn check_same_bt(
    t: &Tensor,
    what: &'static str,
    b: i64,
    t_: i64,
) -> Result<(), AlgoError> {
    check_float(t, what)?;
    if t.size() != [b, t_] {
        return Err(AlgoError::Shape {
            what,
            expected: format!("[B, T] = [{b}, {t_}] (same as the mask)"),
            got: t.size(),
            hint: "all token-level tensors of one batch share the mask's shape",
        });
    }
    Ok(())
}

/// Checks `t` is `[b]` and floating point.
pub(crate) fn check_b(t: &Tensor, what: &'static str, b: i64) -> Result<(), AlgoError> {
    check_float(t, what)?;
    if t.size() != [b] {
        return Err(AlgoError::Shape {
            what,
            expected: format!("[B] = [{b}] (one value per sample)"),
            got: t.size(),
            hint: "sequence-level tensors are 1-D with one entry per row of the mask",
        });
    }
    Ok(())
}

/// Converts a `[B]` integer tensor of group ids (any device) into `Vec<usize>`.
pub fn group_ids_from_tensor(ids: &Tensor) -> Result<Vec<usize>, AlgoError> {
    if ids.is_floating_point() || ids.dim() != 1 {
        return Err(AlgoError::GroupIdTensor(format!(
            "expected a 1-D integer tensor [B], got {:?} of shape {:?}",
            ids.kind(),
            ids.size()
        )));
    }
    let v: Vec<i64> = Vec::<i64>::try_from(ids.to_kind(Kind::Int64).to_device(tch::Device::Cpu))
        .map_err(|e| AlgoError::GroupIdTensor(e.to_string()))?;
    v.into_iter()
        .map(|x| {
            usize::try_from(x).map_err(|_| {
                AlgoError::GroupIdTensor(format!("negative group id {x}; ids must be >= 0"))
            })
        })
        .collect()
}

/// Dense group structure: the membership matrix `[G, B]` on the rewards' device.
pub(crate) struct Groups {
    /// `[G, B]`, 1 where sample b belongs to group g.
    pub member: Tensor,
    /// `[B]` size of each sample's group.
    pub size_of_sample: Tensor,
}

impl Groups {
    pub(crate) fn new(ids: &[usize], like: &Tensor) -> Result<Self, AlgoError> {
        let b = like.size()[0];
        if ids.len() as i64 != b {
            return Err(AlgoError::GroupIds {
                batch: b,
                got: ids.len(),
            });
        }
        let mut dense: Vec<usize> = Vec::with_capacity(ids.len());
        let mut seen: Vec<usize> = Vec::new();
        for id in ids {
            let g = match seen.iter().position(|s| s == id) {
                Some(g) => g,
                None => {
                    seen.push(*id);
                    seen.len() - 1
                }
            };
            dense.push(g);
        }
        let g = seen.len();
        let mut m = vec![0f32; g * ids.len()];
        for (i, gi) in dense.iter().enumerate() {
            m[gi * ids.len() + i] = 1.0;
        }
        let member = Tensor::from_slice(&m)
            .reshape([g as i64, b])
            .to_kind(like.kind())
            .to_device(like.device());
        // size_of_sample[b] = Σ_g member[g,b] · |g|
        let sizes = member.sum_dim_intlist(1, false, like.kind());
        let size_of_sample = member.transpose(0, 1).matmul(&sizes);
        Ok(Self {
            member,
            size_of_sample,
        })
    }

    /// Per-sample sum over the sample's group: `[B] -> [B]`.
    pub(crate) fn group_sum(&self, x: &Tensor) -> Tensor {
        self.member.transpose(0, 1).matmul(&self.member.matmul(x))
    }
}

/// Reads a 0-d tensor as f64 (moves to CPU if needed).
pub(crate) fn scalar(t: &Tensor) -> f64 {
    t.to_device(tch::Device::Cpu)
        .to_kind(Kind::Double)
        .double_value(&[])
}
