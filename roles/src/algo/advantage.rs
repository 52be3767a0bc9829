//! Advantage estimators: GRPO, RLOO (outcome rewards, group baselines), REINFORCE++
//! (token returns, global normalisation) and PPO's GAE (critic values); plus
//! [`token_level_rewards`], which places a sequence reward on the last response token
//! and folds in a per-token KL penalty.

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::algo::checks::{check_b, check_bt, check_same_bt, AlgoError, Groups};

/// Advantages and returns, both `[B, T]`, zero on padding.
///
/// For the outcome estimators (GRPO, RLOO) `returns == advantages` (there is no critic);
/// for GAE `returns = A + V` (before whitening) are the critic's targets.
#[derive(Debug)]
pub struct Advantages {
    /// Per-token advantages `[B, T]`.
    pub advantages: Tensor,
    /// Per-token returns `[B, T]`.
    pub returns: Tensor,
}

/// GRPO options.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GrpoConfig {
    /// Divide by the group's standard deviation (GRPO). `false` gives Dr. GRPO: `r − mean_g`.
    pub norm_by_std: bool,
    /// Use the unbiased (n−1) standard deviation, as `torch.std` does. `false`: population std.
    pub unbiased_std: bool,
    /// Added to the std before dividing.
    pub eps: f64,
}

impl Default for GrpoConfig {
    fn default() -> Self {
        Self {
            norm_by_std: true,
            unbiased_std: true,
            eps: 1e-6,
        }
    }
}

/// GRPO group-normalised outcome advantages, broadcast over each response's tokens:
/// `A_i = (r_i − mean_g) / (std_g + eps)` (or `r_i − mean_g` with `norm_by_std = false`).
///
/// `rewards` `[B]`, `mask` `[B, T]`, `group_ids` one per sample. A group of one sample has
/// no baseline to compare with and gets advantage 0 (verl instead passes its raw reward
/// through; we prefer no signal to an unnormalised one).
pub fn grpo_advantage(
    rewards: &Tensor,
    mask: &Tensor,
    group_ids: &[usize],
    cfg: &GrpoConfig,
) -> Result<Advantages, AlgoError> {
    let (b, _) = check_bt(mask, "mask")?;
    check_b(rewards, "rewards", b)?;
    if cfg.eps.is_nan() || cfg.eps < 0.0 {
        return Err(AlgoError::Param {
            name: "eps",
            value: cfg.eps,
            reason: "must be >= 0",
        });
    }
    let rewards = rewards.to_kind(mask.kind());
    let g = Groups::new(group_ids, &rewards)?;
    let mean = g.group_sum(&rewards) / &g.size_of_sample;
    let centered = &rewards - mean;
    let adv = if cfg.norm_by_std {
        let dof = if cfg.unbiased_std {
            (&g.size_of_sample - 1.0).clamp_min(1.0)
        } else {
            g.size_of_sample.shallow_clone()
        };
        let std = (g.group_sum(&centered.square()) / dof).sqrt();
        &centered / (std + cfg.eps)
    } else {
        centered
    };
    let adv = adv.unsqueeze(1) * mask;
    Ok(Advantages {
        returns: adv.shallow_clone(),
        advantages: adv,
    })
}

/// RLOO leave-one-out advantages, broadcast over tokens: `A_i = r_i − mean_{j≠i} r_j`
/// within the prompt group. Groups of one sample get 0.
pub fn rloo_advantage(
    rewards: &Tensor,
    mask: &Tensor,
    group_ids: &[usize],
) -> Result<Advantages, AlgoError> {
    let (b, _) = check_bt(mask, "mask")?;
    check_b(rewards, "rewards", b)?;
    let rewards = rewards.to_kind(mask.kind());
    let g = Groups::new(group_ids, &rewards)?;
    let others = (&g.size_of_sample - 1.0).clamp_min(1.0);
    let baseline = (g.group_sum(&rewards) - &rewards) / others;
    let has_others = g.size_of_sample.gt(1.0).to_kind(rewards.kind());
    let adv = ((&rewards - baseline) * has_others).unsqueeze(1) * mask;
    Ok(Advantages {
        returns: adv.shallow_clone(),
        advantages: adv,
    })
}

/// `[B, T]` one-hot of each row's last valid token (all zero for an empty row).
fn last_token_one_hot(mask: &Tensor) -> Tensor {
    let t = mask.size()[1];
    let pos1 = Tensor::arange_start(1, t + 1, (mask.kind(), mask.device())); // 1..=T
    let valid = mask.gt(0.0).to_kind(mask.kind());
    let last = (&valid * &pos1).amax(1, true); // [B,1], 0 for an empty row
    pos1.unsqueeze(0).eq_tensor(&last).to_kind(mask.kind()) * valid
}

/// Token-level rewards from sequence rewards: `r_i` on the last valid token of row `i`,
/// minus `kl_coef · kl_t` on every valid token when `kl` (`[B, T]`, e.g. from
/// [`super::kl_estimate`]) is given (KL-in-reward, as in PPO-RLHF and REINFORCE++).
pub fn token_level_rewards(
    seq_rewards: &Tensor,
    mask: &Tensor,
    kl: Option<&Tensor>,
    kl_coef: f64,
) -> Result<Tensor, AlgoError> {
    let (b, t) = check_bt(mask, "mask")?;
    check_b(seq_rewards, "seq_rewards", b)?;
    let mut r = last_token_one_hot(mask) * seq_rewards.to_kind(mask.kind()).unsqueeze(1);
    if let Some(kl) = kl {
        check_same_bt(kl, "kl", b, t)?;
        r -= kl.to_kind(mask.kind()) * mask * kl_coef;
    }
    Ok(r)
}

/// `(x − mean) / (std + eps)` over valid tokens (unbiased std), zero on padding.
pub(crate) fn masked_whiten(x: &Tensor, mask: &Tensor, eps: f64) -> Tensor {
    let centered = masked_center(x, mask);
    let n = mask.sum(mask.kind());
    let var = centered.square().sum(mask.kind()) / (n - 1.0).clamp_min(1.0);
    centered / (var.sqrt() + eps)
}

/// `x − mean` over valid tokens, zero on padding.
fn masked_center(x: &Tensor, mask: &Tensor) -> Tensor {
    let n = mask.sum(mask.kind());
    let mean = (x * mask).sum(mask.kind()) / n.clamp_min(1.0);
    (x - mean) * mask
}

/// REINFORCE++ options.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReinforcePpConfig {
    /// Discount γ of the cumulative return (1 = undiscounted).
    pub gamma: f64,
    /// Added to the global std when normalising.
    pub eps: f64,
}

impl Default for ReinforcePpConfig {
    fn default() -> Self {
        Self {
            gamma: 1.0,
            eps: 1e-8,
        }
    }
}

/// REINFORCE++: discounted returns `G_t = r_t + γ G_{t+1}` of token rewards (build them
/// with [`token_level_rewards`], KL penalty included), then normalised over all valid
/// tokens of the whole batch: `(G − mean) / (std + eps)`. `returns` holds the raw `G`.
pub fn reinforce_pp_advantage(
    token_rewards: &Tensor,
    mask: &Tensor,
    cfg: &ReinforcePpConfig,
) -> Result<Advantages, AlgoError> {
    let (b, t) = check_bt(mask, "mask")?;
    check_same_bt(token_rewards, "token_rewards", b, t)?;
    check_discount(cfg.gamma, "gamma")?;
    let r = token_rewards.to_kind(mask.kind());
    let mut running = Tensor::zeros([b], (mask.kind(), mask.device()));
    let mut cols = Vec::with_capacity(t as usize);
    for i in (0..t).rev() {
        // A masked token (padding, or an observation inside a multi-turn response) is
        // stepped over: the return flows through it from the model's next token.
        let mi = mask.select(1, i);
        let stepped = r.select(1, i) + &running * cfg.gamma;
        running = &stepped * &mi + &running * (1.0 - &mi);
        cols.push(&running * &mi);
    }
    cols.reverse();
    let returns = if t == 0 {
        r.zeros_like()
    } else {
        Tensor::stack(&cols, 1)
    };
    let advantages = masked_whiten(&returns, mask, cfg.eps);
    Ok(Advantages {
        advantages,
        returns,
    })
}

/// `algorithm.advantage_norm`: how GAE's advantages are normalised over the valid
/// tokens of the batch (the returns, the critic's targets, stay raw).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum AdvantageNorm {
    /// `(A − mean) / (std + eps)`: unit scale whatever the batch holds, verl's and
    /// OpenRLHF's default. A batch whose rewards are all equal holds nothing but the
    /// critic's errors in `A`, and this blows them up to the size of a real signal.
    #[default]
    Whiten,
    /// `A − mean`: the scale stays in reward units, so a batch without a reward signal
    /// moves the policy only as far as its critic's small errors.
    Center,
    /// The raw GAE advantages.
    None,
}

/// GAE options.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GaeConfig {
    /// Discount γ.
    pub gamma: f64,
    /// GAE λ.
    pub lam: f64,
    /// How the advantages are normalised over the batch (returns stay raw).
    pub norm: AdvantageNorm,
    /// Added to the std when whitening.
    pub eps: f64,
}

impl Default for GaeConfig {
    fn default() -> Self {
        Self {
            gamma: 1.0,
            lam: 0.95,
            norm: AdvantageNorm::Whiten,
            eps: 1e-8,
        }
    }
}

fn check_discount(v: f64, name: &'static str) -> Result<(), AlgoError> {
    if (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(AlgoError::Param {
            name,
            value: v,
            reason: "must be in [0, 1]",
        })
    }
}

/// PPO generalised advantage estimation.
///
/// `δ_t = r_t + γ V_{t+1} − V_t`, `A_t = δ_t + γλ A_{t+1}`, where `V_{t+1}` and `A_{t+1}`
/// count only when token `t+1` is valid (no bootstrap past the last valid token). A
/// masked token between valid ones (an environment's observation) is stepped over: `t+1`
/// is then the next valid token.
/// `returns = A + V` (critic targets). `token_rewards`, `values`, `mask` are `[B, T]`.
pub fn gae_advantage(
    token_rewards: &Tensor,
    values: &Tensor,
    mask: &Tensor,
    cfg: &GaeConfig,
) -> Result<Advantages, AlgoError> {
    let (b, t) = check_bt(mask, "mask")?;
    check_same_bt(token_rewards, "token_rewards", b, t)?;
    check_same_bt(values, "values", b, t)?;
    check_discount(cfg.gamma, "gamma")?;
    check_discount(cfg.lam, "lam")?;
    let k = mask.kind();
    let (r, v) = (token_rewards.to_kind(k), values.to_kind(k));
    let zeros = Tensor::zeros([b], (k, mask.device()));
    let (mut next_adv, mut next_v, mut next_valid) =
        (zeros.shallow_clone(), zeros.shallow_clone(), zeros);
    let mut cols = Vec::with_capacity(t as usize);
    for i in (0..t).rev() {
        let (ri, vi, mi) = (r.select(1, i), v.select(1, i), mask.select(1, i));
        let delta = ri + &next_v * &next_valid * cfg.gamma - &vi;
        let adv = (delta + &next_adv * &next_valid * (cfg.gamma * cfg.lam)) * &mi;
        cols.push(adv.shallow_clone());
        // A masked token (padding, or an observation inside a multi-turn response) is
        // stepped over: the model's token before it bootstraps from the model's next one.
        let keep = 1.0 - &mi;
        next_adv = &adv + &next_adv * &keep;
        next_v = &vi * &mi + &next_v * &keep;
        next_valid = &mi + &next_valid * &keep;
    }
    cols.reverse();
    let adv = if t == 0 {
        r.zeros_like()
    } else {
        Tensor::stack(&cols, 1)
    };
    let returns = (&adv + &v) * mask;
    let advantages = match cfg.norm {
        AdvantageNorm::Whiten => masked_whiten(&adv, mask, cfg.eps),
        AdvantageNorm::Center => masked_center(&adv, mask),
        AdvantageNorm::None => adv,
    };
    Ok(Advantages {
        advantages,
        returns,
    })
}
