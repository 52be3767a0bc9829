//! DAPO extras: the dynamic-sampling filter (drop prompt groups whose rewards carry no
//! signal) and the soft overlong penalty. Clip-higher and the token-level loss live in
//! [`super::loss`] (`clip_high`, [`super::LossAgg::TokenMean`]).

use tch::{Kind, Tensor};

use crate::algo::checks::AlgoError;

/// Result of [`dynamic_sampling_filter`].
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicSampling {
    /// Group ids kept (some reward differs within the group), in first-seen order.
    pub keep_groups: Vec<usize>,
    /// Group ids dropped (all rewards equal), in first-seen order.
    pub dropped_groups: Vec<usize>,
    /// Indices of the samples belonging to kept groups, ascending.
    pub keep_samples: Vec<usize>,
    /// How many more prompt groups are needed to reach the target: `target − kept`, ≥ 0.
    pub prompts_needed: usize,
    /// Kept ÷ seen groups (0 when nothing was seen).
    pub keep_rate: f64,
    /// Prompts to generate next to fill the deficit at the observed keep rate
    /// (`ceil(prompts_needed / keep_rate)`); `None` when no group was kept, as the rate
    /// gives no estimate then.
    pub suggested_prompts: Option<usize>,
}

/// DAPO dynamic sampling: keeps the groups whose rewards are not all equal (within
/// `tolerance`; a group of one sample is "all equal"), and says how many more prompts
/// are needed to have `target_groups` kept groups. `rewards[i]` belongs to
/// `group_ids[i]`.
pub fn dynamic_sampling_filter(
    rewards: &[f64],
    group_ids: &[usize],
    target_groups: usize,
    tolerance: f64,
) -> Result<DynamicSampling, AlgoError> {
    if rewards.len() != group_ids.len() {
        return Err(AlgoError::Length {
            what: "rewards vs group_ids",
            a: rewards.len(),
            b: group_ids.len(),
        });
    }
    if tolerance.is_nan() || tolerance < 0.0 {
        return Err(AlgoError::Param {
            name: "tolerance",
            value: tolerance,
            reason: "must be >= 0",
        });
    }
    if let Some(r) = rewards.iter().find(|r| !r.is_finite()) {
        return Err(AlgoError::Param {
            name: "rewards",
            value: *r,
            reason: "rewards must be finite; check the reward function",
        });
    }
    // (group id, min, max) in first-seen order.
    let mut groups: Vec<(usize, f64, f64)> = Vec::new();
    for (r, g) in rewards.iter().zip(group_ids) {
        match groups.iter_mut().find(|e| e.0 == *g) {
            Some(e) => {
                e.1 = e.1.min(*r);
                e.2 = e.2.max(*r);
            }
            None => groups.push((*g, *r, *r)),
        }
    }
    let (mut keep_groups, mut dropped_groups) = (Vec::new(), Vec::new());
    for (g, lo, hi) in &groups {
        if hi - lo > tolerance {
            keep_groups.push(*g);
        } else {
            dropped_groups.push(*g);
        }
    }
    let keep_samples = group_ids
        .iter()
        .enumerate()
        .filter(|(_, g)| keep_groups.contains(g))
        .map(|(i, _)| i)
        .collect();
    let prompts_needed = target_groups.saturating_sub(keep_groups.len());
    let keep_rate = if groups.is_empty() {
        0.0
    } else {
        keep_groups.len() as f64 / groups.len() as f64
    };
    let suggested_prompts = if prompts_needed == 0 {
        Some(0)
    } else if keep_rate > 0.0 {
        Some((prompts_needed as f64 / keep_rate).ceil() as usize)
    } else {
        None
    };
    Ok(DynamicSampling {
        keep_groups,
        dropped_groups,
        keep_samples,
        prompts_needed,
        keep_rate,
        suggested_prompts,
    })
}

fn check_overlong(max_len: usize, cache_len: usize) -> Result<(), AlgoError> {
    if cache_len > max_len {
        return Err(AlgoError::Param {
            name: "cache_len",
            value: cache_len as f64,
            reason: "the overlong buffer must not exceed max_len (DAPO: max_len 20480, cache 4096)",
        });
    }
    Ok(())
}

/// DAPO soft overlong punishment for a response of `len` tokens: 0 up to
/// `max_len − cache_len`, then linear down to −1 at `max_len`, and −1 beyond.
/// With `cache_len = 0` it is a step: 0 up to `max_len`, −1 beyond.
pub fn overlong_penalty(len: usize, max_len: usize, cache_len: usize) -> Result<f64, AlgoError> {
    check_overlong(max_len, cache_len)?;
    let start = max_len - cache_len;
    Ok(if len <= start {
        0.0
    } else if len <= max_len {
        -((len - start) as f64) / cache_len as f64
    } else {
        -1.0
    })
}

/// [`overlong_penalty`] on a `[B]` tensor of response lengths (any numeric kind);
/// returns `[B]` float penalties on the same device.
pub fn overlong_penalty_tensor(
    lengths: &Tensor,
    max_len: usize,
    cache_len: usize,
) -> Result<Tensor, AlgoError> {
    check_overlong(max_len, cache_len)?;
    if lengths.dim() != 1 {
        return Err(AlgoError::Shape {
            what: "lengths",
            expected: "[B] (response length per sample)".into(),
            got: lengths.size(),
            hint: "sum the response mask over tokens: mask.sum_dim_intlist(1, false, Kind::Float)",
        });
    }
    let l = lengths.to_kind(Kind::Float);
    let start = (max_len - cache_len) as f64;
    if cache_len == 0 {
        return Ok(-l.gt(max_len as f64).to_kind(Kind::Float));
    }
    Ok(-((l - start) / cache_len as f64).clamp(0.0, 1.0))
}
