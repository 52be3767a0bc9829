//! Hand-computed checks of every estimator and loss. All tensors are f64 so the
//! expected numbers can be compared at 1e-6.

use tch::{Kind, Tensor};

use super::checks::*;
use super::*;

fn t2(rows: &[&[f64]]) -> Tensor {
    let cols = rows[0].len() as i64;
    let flat: Vec<f64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_slice(&flat).reshape([rows.len() as i64, cols])
}

fn t1(v: &[f64]) -> Tensor {
    Tensor::from_slice(v)
}

fn vals(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(t.to_kind(Kind::Double).flatten(0, -1)).expect("f64 tensor")
}

#[track_caller]
fn close(got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "length: got {got:?} want {want:?}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() < 1e-6,
            "index {i}: got {g}, want {w}\n got {got:?}\nwant {want:?}"
        );
    }
}

#[track_caller]
fn close1(got: f64, want: f64) {
    close(&[got], &[want]);
}

// Two groups interleaved: ids [7,4,7,4,7,4].
// group 7: rewards [1,2,3]; group 4: rewards [0,0,3].
// Response lengths [3,2,1,3,2,3] over T=3.
fn grouped() -> (Tensor, Tensor, Vec<usize>) {
    let rewards = t1(&[1.0, 0.0, 2.0, 0.0, 3.0, 3.0]);
    let mask = t2(&[
        &[1.0, 1.0, 1.0],
        &[1.0, 1.0, 0.0],
        &[1.0, 0.0, 0.0],
        &[1.0, 1.0, 1.0],
        &[1.0, 1.0, 0.0],
        &[1.0, 1.0, 1.0],
    ]);
    (rewards, mask, vec![7, 4, 7, 4, 7, 4])
}

#[test]
fn grpo_group_normalised_and_masked() {
    let (r, mask, ids) = grouped();
    let a = grpo_advantage(&r, &mask, &ids, &GrpoConfig::default()).unwrap();
    // group 7: mean 2, unbiased std sqrt((1+0+1)/2) = 1 → [-1, 0, 1]
    // group 4: mean 1, deviations [-1,-1,2], unbiased var 6/2 = 3, std 1.7320508
    //          → [-0.5773503, -0.5773503, 1.1547005]
    // (eps = 1e-6 changes these by < 2e-6)
    let (a7, a4) = (1.0 / (1.0 + 1e-6), 1.0 / (3f64.sqrt() + 1e-6));
    close(
        &vals(&a.advantages),
        &[
            -a7,
            -a7,
            -a7, // sample 0, group 7, r=1
            -a4,
            -a4,
            0.0, // sample 1, group 4, r=0, last token padded
            0.0,
            0.0,
            0.0, // sample 2, group 7, r=2 → 0
            -a4,
            -a4,
            -a4, // sample 3, group 4, r=0
            a7,
            a7,
            0.0, // sample 4, group 7, r=3
            2.0 * a4,
            2.0 * a4,
            2.0 * a4, // sample 5, group 4, r=3
        ],
    );
    close(&vals(&a.returns), &vals(&a.advantages));
}

#[test]
fn grpo_without_std_and_population_std() {
    let (r, mask, ids) = grouped();
    // Dr. GRPO: r − mean: group 7 [-1,0,1], group 4 [-1,-1,2]; first token of each row.
    let cfg = GrpoConfig {
        norm_by_std: false,
        ..Default::default()
    };
    let a = grpo_advantage(&r, &mask, &ids, &cfg).unwrap();
    close(
        &vals(&a.advantages.select(1, 0)),
        &[-1.0, -1.0, 0.0, -1.0, 1.0, 2.0],
    );
    // population std of group 7: sqrt(2/3) = 0.8164966 → ±1/0.8164966 = ±1.2247449
    let cfg = GrpoConfig {
        unbiased_std: false,
        eps: 0.0,
        ..Default::default()
    };
    let a = grpo_advantage(&r, &mask, &ids, &cfg).unwrap();
    let col = vals(&a.advantages.select(1, 0));
    close(&[col[0], col[2], col[4]], &[-1.2247449, 0.0, 1.2247449]);
}

#[test]
fn grpo_singleton_groups_get_zero() {
    let a = grpo_advantage(
        &t1(&[5.0, -2.0]),
        &t2(&[&[1.0, 1.0], &[1.0, 0.0]]),
        &[1, 2],
        &GrpoConfig::default(),
    )
    .unwrap();
    close(&vals(&a.advantages), &[0.0; 4]);
}

#[test]
fn rloo_leave_one_out() {
    let (r, mask, ids) = grouped();
    let a = rloo_advantage(&r, &mask, &ids).unwrap();
    // group 7 [1,2,3]: baselines (2+3)/2=2.5, (1+3)/2=2, (1+2)/2=1.5 → [-1.5, 0, 1.5]
    // group 4 [0,0,3]: baselines 1.5, 1.5, 0 → [-1.5, -1.5, 3]
    close(
        &vals(&a.advantages),
        &[
            -1.5, -1.5, -1.5, //
            -1.5, -1.5, 0.0, //
            0.0, 0.0, 0.0, //
            -1.5, -1.5, -1.5, //
            1.5, 1.5, 0.0, //
            3.0, 3.0, 3.0,
        ],
    );
    let single = rloo_advantage(&t1(&[4.0]), &t2(&[&[1.0]]), &[0]).unwrap();
    close(&vals(&single.advantages), &[0.0]);
}

// Rows of lengths 3 and 2 (T=4), sequence rewards [1, -1], KL values (garbage on padding).
fn kl_rewards() -> (Tensor, Tensor, Tensor) {
    let mask = t2(&[&[1.0, 1.0, 1.0, 0.0], &[1.0, 1.0, 0.0, 0.0]]);
    let kl = t2(&[&[0.1, 0.2, 0.3, 9.0], &[0.5, 0.5, 9.0, 9.0]]);
    (t1(&[1.0, -1.0]), mask, kl)
}

#[test]
fn token_rewards_last_token_and_kl_penalty() {
    let (r, mask, kl) = kl_rewards();
    let plain = token_level_rewards(&r, &mask, None, 0.0).unwrap();
    close(&vals(&plain), &[0.0, 0.0, 1.0, 0.0, 0.0, -1.0, 0.0, 0.0]);
    // β = 0.5: row 0 [-0.05, -0.1, 1 − 0.15, 0]; row 1 [-0.25, -1 − 0.25, 0, 0]
    let with_kl = token_level_rewards(&r, &mask, Some(&kl), 0.5).unwrap();
    close(
        &vals(&with_kl),
        &[-0.05, -0.1, 0.85, 0.0, -0.25, -1.25, 0.0, 0.0],
    );
    // an empty response gets nothing (there is no token to carry the reward)
    let empty = token_level_rewards(&t1(&[3.0]), &t2(&[&[0.0, 0.0]]), None, 0.0).unwrap();
    close(&vals(&empty), &[0.0, 0.0]);
}

#[test]
fn reinforce_pp_returns_and_global_whitening() {
    let (r, mask, kl) = kl_rewards();
    let tr = token_level_rewards(&r, &mask, Some(&kl), 0.5).unwrap();
    let a = reinforce_pp_advantage(&tr, &mask, &ReinforcePpConfig::default()).unwrap();
    // γ = 1, row 0: G2 = 0.85, G1 = -0.1 + 0.85 = 0.75, G0 = -0.05 + 0.75 = 0.7
    //        row 1: G1 = -1.25, G0 = -0.25 - 1.25 = -1.5
    close(
        &vals(&a.returns),
        &[0.7, 0.75, 0.85, 0.0, -1.5, -1.25, 0.0, 0.0],
    );
    // 5 valid tokens: mean = -0.45/5 = -0.09; squared deviations
    // 0.79² + 0.84² + 0.94² + 1.41² + 1.16² = 5.547; unbiased var 1.38675, std 1.1776035
    // → (G + 0.09) / 1.1776035
    close(
        &vals(&a.advantages),
        &[
            0.6708540, 0.7133131, 0.7982313, 0.0, -1.1973470, -0.9850514, 0.0, 0.0,
        ],
    );
    // γ = 0.5, row 0: G2 = 0.85, G1 = -0.1 + 0.425 = 0.325, G0 = -0.05 + 0.1625 = 0.1125
    let a = reinforce_pp_advantage(
        &tr,
        &mask,
        &ReinforcePpConfig {
            gamma: 0.5,
            eps: 1e-8,
        },
    )
    .unwrap();
    close(&vals(&a.returns.select(0, 0)), &[0.1125, 0.325, 0.85, 0.0]);
}

// row 0: 3 valid tokens, reward 1 at the end, values [0.5, 0.6, 0.7]
// row 1: 2 valid tokens, reward 2 at t=1, values [0.2, 0.4, 9 (padding garbage)]
fn gae_inputs() -> (Tensor, Tensor, Tensor) {
    let r = t2(&[&[0.0, 0.0, 1.0], &[0.0, 2.0, 5.0]]);
    let v = t2(&[&[0.5, 0.6, 0.7], &[0.2, 0.4, 9.0]]);
    let m = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
    (r, v, m)
}

#[test]
fn gae_by_hand() {
    let (r, v, m) = gae_inputs();
    let cfg = GaeConfig {
        gamma: 1.0,
        lam: 0.5,
        norm: AdvantageNorm::None,
        eps: 1e-8,
    };
    let a = gae_advantage(&r, &v, &m, &cfg).unwrap();
    // row 0: δ2 = 1 − 0.7 = 0.3, A2 = 0.3
    //        δ1 = 0.7 − 0.6 = 0.1, A1 = 0.1 + 0.5·0.3 = 0.25
    //        δ0 = 0.6 − 0.5 = 0.1, A0 = 0.1 + 0.5·0.25 = 0.225
    // row 1: t2 padded → 0; δ1 = 2 − 0.4 = 1.6 (no bootstrap from the padded 9), A1 = 1.6
    //        δ0 = 0.4 − 0.2 = 0.2, A0 = 0.2 + 0.5·1.6 = 1.0
    close(&vals(&a.advantages), &[0.225, 0.25, 0.3, 1.0, 1.6, 0.0]);
    // returns = A + V on valid tokens
    close(&vals(&a.returns), &[0.725, 0.85, 1.0, 1.2, 2.0, 0.0]);

    // γ = 0.9, λ = 1 (Monte-Carlo): row 0 A0 = 0.81·1 − 0.5 = 0.31, A1 = 0.9 − 0.6 = 0.3, A2 = 0.3
    let cfg = GaeConfig {
        gamma: 0.9,
        lam: 1.0,
        norm: AdvantageNorm::None,
        eps: 1e-8,
    };
    let a = gae_advantage(&r, &v, &m, &cfg).unwrap();
    close(&vals(&a.advantages.select(0, 0)), &[0.31, 0.3, 0.3]);
}

#[test]
fn gae_whitening_is_over_valid_tokens_only() {
    let (r, v, m) = gae_inputs();
    let cfg = GaeConfig {
        gamma: 1.0,
        lam: 0.5,
        norm: AdvantageNorm::Whiten,
        eps: 0.0,
    };
    let a = gae_advantage(&r, &v, &m, &cfg).unwrap();
    // raw valid advantages [0.225, 0.25, 0.3, 1.0, 1.6]: mean 0.675, deviations
    // [-0.45, -0.425, -0.375, 0.325, 0.925], Σ² = 1.485, unbiased var 0.37125, std 0.6093029
    let s = 0.37125f64.sqrt();
    close(
        &vals(&a.advantages),
        &[-0.45 / s, -0.425 / s, -0.375 / s, 0.325 / s, 0.925 / s, 0.0],
    );
    // returns are not whitened
    close(&vals(&a.returns), &[0.725, 0.85, 1.0, 1.2, 2.0, 0.0]);
    // centred: the same deviations, unscaled
    let cfg = GaeConfig {
        norm: AdvantageNorm::Center,
        ..cfg
    };
    let a = gae_advantage(&r, &v, &m, &cfg).unwrap();
    close(
        &vals(&a.advantages),
        &[-0.45, -0.425, -0.375, 0.325, 0.925, 0.0],
    );
    close(&vals(&a.returns), &[0.725, 0.85, 1.0, 1.2, 2.0, 0.0]);
}

/// The PPO baseline's collapse (docs/benchmarks.md): in a batch whose rewards are all
/// 0, GAE's advantages are only the critic's errors (here ±0.01); whitening scales them
/// to unit size, as large as a real signal, while centring keeps them at 0.01.
#[test]
fn whitening_blows_a_rewardless_batch_up_to_unit_scale_centring_does_not() {
    let r = t2(&[&[0.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
    let v = t2(&[&[0.01, -0.01, 0.01], &[-0.01, 0.01, -0.01]]);
    let m = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 1.0]]);
    let at = |norm| {
        let cfg = GaeConfig {
            gamma: 1.0,
            lam: 1.0,
            norm,
            eps: 1e-8,
        };
        let a = gae_advantage(&r, &v, &m, &cfg).unwrap();
        let a = vals(&a.advantages);
        let mean = a.iter().sum::<f64>() / a.len() as f64;
        let std = (a.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (a.len() - 1) as f64).sqrt();
        (mean, std)
    };
    // λ = 1, γ = 1, no reward: A_t = −V_t; raw std 0.01095 over the 6 tokens.
    let (mean, std) = at(AdvantageNorm::Whiten);
    assert!(
        mean.abs() < 1e-6 && (std - 1.0).abs() < 1e-4,
        "{mean} {std}"
    );
    let (mean, std) = at(AdvantageNorm::Center);
    assert!(
        mean.abs() < 1e-9 && (std - 0.010954).abs() < 1e-5,
        "{mean} {std}"
    );
}

#[test]
fn kl_estimators() {
    let logp = t2(&[&[-1.0, -2.0, -3.0]]);
    let refp = t2(&[&[-1.5, -1.0, 40.0]]);
    let mask = t2(&[&[1.0, 1.0, 0.0]]);
    // d = logp − ref = [0.5, −1.0]; padded token → 0 whatever the values
    close(
        &vals(&kl_estimate(&logp, &refp, &mask, KlEstimator::K1).unwrap()),
        &[0.5, -1.0, 0.0],
    );
    // ½ d² = [0.125, 0.5]
    close(
        &vals(&kl_estimate(&logp, &refp, &mask, KlEstimator::K2).unwrap()),
        &[0.125, 0.5, 0.0],
    );
    // log r = ref − logp = [−0.5, 1]; e^−0.5 + 0.5 − 1 = 0.1065307; e − 1 − 1 = 0.7182818
    close(
        &vals(&kl_estimate(&logp, &refp, &mask, KlEstimator::K3).unwrap()),
        &[0.1065307, 0.7182818, 0.0],
    );
    // k3 is clamped at 10 (log r = 15 would give e^15 − 16)
    let big = kl_estimate(
        &t2(&[&[-16.0]]),
        &t2(&[&[-1.0]]),
        &t2(&[&[1.0]]),
        KlEstimator::K3,
    )
    .unwrap();
    close(&vals(&big), &[10.0]);
}

#[test]
fn aggregation_modes() {
    // padded entries hold 100 to prove they are ignored; row 2 is an empty response
    let loss = t2(&[
        &[1.0, 2.0, 3.0],
        &[4.0, 100.0, 100.0],
        &[100.0, 100.0, 100.0],
    ]);
    let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
    // token-mean: (1+2+3+4)/4 = 2.5
    close1(
        scalar(&aggregate_loss(&loss, &mask, LossAgg::TokenMean).unwrap()),
        2.5,
    );
    // seq-mean-token-mean: rows 2 and 4 (the empty row is left out) → 3
    close1(
        scalar(&aggregate_loss(&loss, &mask, LossAgg::SeqMeanTokenMean).unwrap()),
        3.0,
    );
    // seq-mean-token-sum-norm, max_len 4: (6/4 + 4/4 + 0)/3 = 2.5/3
    let agg = LossAgg::SeqMeanTokenSumNorm { max_len: 4.0 };
    close1(
        scalar(&aggregate_loss(&loss, &mask, agg).unwrap()),
        2.5 / 3.0,
    );
    assert!(aggregate_loss(&loss, &mask, LossAgg::SeqMeanTokenSumNorm { max_len: 0.0 }).is_err());
}

// row 0: a (A=+1, ρ=1.5), b (A=+1, ρ=0.5), e (A=+1, ρ=1.1)
// row 1: c (A=−1, ρ=0.5), d (A=−1, ρ=5), padding (garbage)
fn ppo_inputs() -> (Tensor, Tensor, Tensor, Tensor) {
    let ln = |x: f64| x.ln();
    let old = t2(&[&[-1.0, -1.0, -1.0], &[-1.0, -1.0, -1.0]]);
    let logp = t2(&[
        &[-1.0 + ln(1.5), -1.0 + ln(0.5), -1.0 + ln(1.1)],
        &[-1.0 + ln(0.5), -1.0 + ln(5.0), 30.0],
    ]);
    let adv = t2(&[&[1.0, 1.0, 1.0], &[-1.0, -1.0, 1000.0]]);
    let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
    (logp, old, adv, mask)
}

#[test]
fn ppo_clip_higher_and_dual_clip() {
    let (logp, old, adv, mask) = ppo_inputs();
    let cfg = PolicyLossConfig {
        kind: PolicyLossKind::Ppo,
        clip_low: 0.2,
        clip_high: 0.28,
        dual_clip: None,
        agg: LossAgg::TokenMean,
    };
    let (loss, st) = ppo_policy_loss(&logp, &old, &adv, &mask, &cfg).unwrap();
    // a: max(−1.5, −1.28) = −1.28 (clipped at 1+0.28)
    // b: max(−0.5, −0.8) = −0.5 (A>0 below 1−ε: not clipped)
    // e: −1.1 (inside)
    // c: max(0.5, 0.8) = 0.8 (A<0 below 1−0.2: clipped)
    // d: max(5, 1.28) = 5 (A<0 above 1+ε: unclipped)
    // token-mean = (−1.28 − 0.5 − 1.1 + 0.8 + 5)/5 = 2.92/5 = 0.584; clipped: a, c → 2/5
    close1(scalar(&loss), 0.584);
    close1(st.clip_frac, 0.4);
    close1(st.dual_clip_frac, 0.0);
    // approx_kl = −mean(ln ρ) = −(ln1.5 + 2 ln0.5 + ln1.1 + ln5)/5 = −0.7239188/5
    close1(st.approx_kl, -0.7239188 / 5.0);
    // ratio_mean = (1.5 + 0.5 + 1.1 + 0.5 + 5)/5 = 1.72
    close1(st.ratio_mean, 1.72);

    // dual clip c = 3: d becomes min(5, 3) = 3 → (2.92 − 2)/5 = 0.184
    let dual = PolicyLossConfig {
        dual_clip: Some(3.0),
        ..cfg
    };
    let (loss, st) = ppo_policy_loss(&logp, &old, &adv, &mask, &dual).unwrap();
    close1(scalar(&loss), 0.184);
    close1(st.dual_clip_frac, 0.2);

    // symmetric ε = 0.2: a becomes −1.2 → (2.92 + 0.08)/5 = 0.6
    let sym = PolicyLossConfig {
        clip_high: 0.2,
        ..cfg
    };
    close1(
        scalar(&ppo_policy_loss(&logp, &old, &adv, &mask, &sym).unwrap().0),
        0.6,
    );

    // seq-mean-token-mean: row 0 (−1.28 − 0.5 − 1.1)/3 = −0.96, row 1 (0.8 + 5)/2 = 2.9 → 0.97
    let seq = PolicyLossConfig {
        agg: LossAgg::SeqMeanTokenMean,
        ..cfg
    };
    close1(
        scalar(&ppo_policy_loss(&logp, &old, &adv, &mask, &seq).unwrap().0),
        0.97,
    );
}

#[test]
fn ppo_clip_boundaries() {
    // just inside and just outside both boundaries (ε_low 0.2, ε_high 0.28)
    let old = t2(&[&[0.0, 0.0, 0.0, 0.0]]);
    let logp = t2(&[&[1.27f64.ln(), 1.29f64.ln(), 0.81f64.ln(), 0.79f64.ln()]]);
    let mask = t2(&[&[1.0, 1.0, 1.0, 1.0]]);
    let cfg = PolicyLossConfig {
        kind: PolicyLossKind::Ppo,
        clip_low: 0.2,
        clip_high: 0.28,
        dual_clip: None,
        agg: LossAgg::TokenMean,
    };
    // A > 0 on the upper side: −1.27 (inside), −1.28 (clipped from 1.29)
    let pos = t2(&[&[1.0, 1.0, 1.0, 1.0]]);
    // A > 0 on the lower side is never clipped: −0.81, −0.79
    let (loss, st) = ppo_policy_loss(&logp, &old, &pos, &mask, &cfg).unwrap();
    close1(scalar(&loss), (-1.27 - 1.28 - 0.81 - 0.79) / 4.0);
    close1(st.clip_frac, 0.25);
    // A < 0: upper side never clipped: 1.27, 1.29; lower: 0.81 inside, 0.79 → 0.8 clipped
    let neg = t2(&[&[-1.0, -1.0, -1.0, -1.0]]);
    let (loss, st) = ppo_policy_loss(&logp, &old, &neg, &mask, &cfg).unwrap();
    close1(scalar(&loss), (1.27 + 1.29 + 0.81 + 0.8) / 4.0);
    close1(st.clip_frac, 0.25);
}

#[test]
fn ppo_gradients_skip_padding_and_clipped_tokens() {
    let (logp, old, adv, mask) = ppo_inputs();
    let logp = logp.set_requires_grad(true);
    let cfg = PolicyLossConfig {
        kind: PolicyLossKind::Ppo,
        clip_low: 0.2,
        clip_high: 0.28,
        dual_clip: Some(3.0),
        agg: LossAgg::TokenMean,
    };
    let (loss, _) = ppo_policy_loss(&logp, &old, &adv, &mask, &cfg).unwrap();
    loss.backward();
    // d/dlogp of −A·ρ/5 is −A·ρ/5 where unclipped, 0 where clipped or padded:
    // a clipped → 0; b −0.5/5 = −0.1; e −1.1/5 = −0.22; c clipped → 0; d dual-clipped → 0; pad 0
    close(&vals(&logp.grad()), &[0.0, -0.1, -0.22, 0.0, 0.0, 0.0]);
}

#[test]
fn ppo_rejects_bad_params_and_shapes() {
    let (logp, old, adv, mask) = ppo_inputs();
    let bad = PolicyLossConfig {
        dual_clip: Some(0.5),
        ..Default::default()
    };
    let e = ppo_policy_loss(&logp, &old, &adv, &mask, &bad)
        .unwrap_err()
        .to_string();
    assert!(e.contains("dual_clip"), "{e}");
    let e = ppo_policy_loss(&logp, &old, &adv.select(1, 0), &mask, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("advantages") && e.contains("[2, 3]"), "{e}");
    let ints = Tensor::from_slice(&[1i64, 2]).reshape([1, 2]);
    assert!(matches!(
        aggregate_loss(&ints, &ints, LossAgg::TokenMean),
        Err(AlgoError::NotFloat { .. })
    ));
    let e = grpo_advantage(
        &t1(&[1.0, 2.0]),
        &t2(&[&[1.0], &[1.0]]),
        &[0],
        &GrpoConfig::default(),
    )
    .unwrap_err();
    assert!(matches!(e, AlgoError::GroupIds { batch: 2, got: 1 }), "{e}");
}

#[test]
fn value_loss_clipping() {
    let values = t2(&[&[1.0, 2.0, 0.0]]);
    let old = t2(&[&[0.8, 1.0, 5.0]]);
    let ret = t2(&[&[1.5, 3.0, 9.0]]);
    let mask = t2(&[&[1.0, 1.0, 0.0]]);
    let cfg = ValueLossConfig {
        clip: Some(0.5),
        agg: LossAgg::TokenMean,
    };
    let (loss, st) = value_loss(&values, &old, &ret, &mask, &cfg).unwrap();
    // t0: v 1.0 within 0.8 ± 0.5 → (1 − 1.5)² = 0.25 both ways
    // t1: v 2.0 clipped to 1.5: max((2 − 3)², (1.5 − 3)²) = max(1, 2.25) = 2.25 (clipped)
    // ½ · (0.25 + 2.25)/2 = 0.625
    close1(scalar(&loss), 0.625);
    close1(st.clip_frac, 0.5);
    close1(st.value_mean, 1.5);
    // unclipped: ½ · (0.25 + 1)/2 = 0.3125
    let (loss, st) = value_loss(
        &values,
        &old,
        &ret,
        &mask,
        &ValueLossConfig { clip: None, ..cfg },
    )
    .unwrap();
    close1(scalar(&loss), 0.3125);
    close1(st.clip_frac, 0.0);
}

#[test]
fn entropy_and_kl_loss() {
    // token 0: uniform over 2 → ln 2 = std::f64::consts::LN_2
    // token 1: p = [0.25, 0.75] → 0.25 ln 4 + 0.75 ln(4/3) = 0.5623351
    // token 2: padding
    let logits = Tensor::from_slice(&[0.0f64, 0.0, 0.0, 3f64.ln(), 5.0, -5.0]).reshape([1, 3, 2]);
    let h = entropy_from_logits(&logits).unwrap();
    close(
        &vals(&h.narrow(1, 0, 2)),
        &[std::f64::consts::LN_2, 0.5623351],
    );
    let mask = t2(&[&[1.0, 1.0, 0.0]]);
    let (loss, st) = entropy_loss(&h, &mask, 0.01, LossAgg::TokenMean).unwrap();
    // −0.01 · (std::f64::consts::LN_2 + 0.5623351)/2
    close1(
        scalar(&loss),
        -0.01 * (std::f64::consts::LN_2 + 0.5623351) / 2.0,
    );
    close1(st.entropy_mean, (std::f64::consts::LN_2 + 0.5623351) / 2.0);
    assert!(entropy_from_logits(&t2(&[&[1.0]])).is_err());

    // k3 per token [0.1065307, 0.7182818] (see kl_estimators) × β = 0.1, token-mean
    let logp = t2(&[&[-1.0, -2.0, -3.0]]);
    let refp = t2(&[&[-1.5, -1.0, 40.0]]);
    let (loss, st) = kl_loss(
        &logp,
        &refp,
        &mask,
        KlEstimator::K3,
        0.1,
        LossAgg::TokenMean,
    )
    .unwrap();
    close1(scalar(&loss), 0.1 * (0.1065307 + 0.7182818) / 2.0);
    close1(st.kl_mean, (0.1065307 + 0.7182818) / 2.0);
}

#[test]
fn dapo_dynamic_sampling() {
    // groups: 10 [1,1] all equal → drop; 20 [0,1] keep; 30 [0,0] drop; 40 [1,0] keep;
    // 50 [0.5] single → drop
    let rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.5];
    let ids = [10, 20, 10, 20, 30, 30, 40, 40, 50];
    let d = dynamic_sampling_filter(&rewards, &ids, 4, 0.0).unwrap();
    assert_eq!(d.keep_groups, vec![20, 40]);
    assert_eq!(d.dropped_groups, vec![10, 30, 50]);
    assert_eq!(d.keep_samples, vec![1, 3, 6, 7]);
    assert_eq!(d.prompts_needed, 2);
    close1(d.keep_rate, 0.4);
    // 2 more kept groups at a 40 % keep rate: ceil(2 / 0.4) = 5 prompts
    assert_eq!(d.suggested_prompts, Some(5));
    // enough kept → nothing needed
    let d = dynamic_sampling_filter(&rewards, &ids, 2, 0.0).unwrap();
    assert_eq!((d.prompts_needed, d.suggested_prompts), (0, Some(0)));
    // nothing kept → no estimate
    let d = dynamic_sampling_filter(&[1.0, 1.0], &[0, 0], 3, 0.0).unwrap();
    assert_eq!((d.prompts_needed, d.suggested_prompts), (3, None));
    // tolerance: 1.0 vs 1.0000001 counts as equal with tol 1e-3
    let d = dynamic_sampling_filter(&[1.0, 1.0000001], &[0, 0], 1, 1e-3).unwrap();
    assert!(d.keep_groups.is_empty());
    assert!(dynamic_sampling_filter(&[1.0], &[0, 1], 1, 0.0).is_err());
    assert!(dynamic_sampling_filter(&[f64::NAN], &[0], 1, 0.0).is_err());
}

#[test]
fn dapo_overlong_penalty() {
    // L_max 20, L_cache 4: 0 up to 16, then −(len − 16)/4, −1 beyond 20
    let want = [
        (10, 0.0),
        (16, 0.0),
        (17, -0.25),
        (18, -0.5),
        (20, -1.0),
        (25, -1.0),
    ];
    for (len, p) in want {
        close1(overlong_penalty(len, 20, 4).unwrap(), p);
    }
    let lens = Tensor::from_slice(&[10i64, 16, 17, 18, 20, 25]);
    close(
        &vals(&overlong_penalty_tensor(&lens, 20, 4).unwrap()),
        &want.map(|w| w.1),
    );
    // no buffer: a step at L_max
    close1(overlong_penalty(20, 20, 0).unwrap(), 0.0);
    close1(overlong_penalty(21, 20, 0).unwrap(), -1.0);
    close(
        &vals(&overlong_penalty_tensor(&Tensor::from_slice(&[20i64, 21]), 20, 0).unwrap()),
        &[0.0, -1.0],
    );
    assert!(overlong_penalty(5, 4, 8).is_err());
}

#[test]
fn group_ids_tensor_conversion() {
    assert_eq!(
        group_ids_from_tensor(&Tensor::from_slice(&[3i64, 3, 1])).unwrap(),
        vec![3, 3, 1]
    );
    assert!(group_ids_from_tensor(&Tensor::from_slice(&[-1i64])).is_err());
    assert!(group_ids_from_tensor(&Tensor::from_slice(&[1.0f32])).is_err());
}

#[test]
fn f32_inputs_work_too() {
    let (r, mask, ids) = grouped();
    let a = grpo_advantage(
        &r.to_kind(Kind::Float),
        &mask.to_kind(Kind::Float),
        &ids,
        &GrpoConfig::default(),
    )
    .unwrap();
    assert_eq!(a.advantages.kind(), Kind::Float);
    let v = vals(&a.advantages);
    assert!((v[15] - 2.0 / 3f64.sqrt()).abs() < 1e-4);
}

// Dr. GRPO, GSPO, CISPO.

#[test]
fn dr_grpo_advantages_skip_the_std_and_the_loss_does_not_divide_by_length() {
    // One group, rewards [3, 0, 0]: mean 1 → A = r − mean = [2, −1, −1]
    // (GRPO would divide by the unbiased std √3: [1.1547, −0.5774, −0.5774]).
    // Response lengths 1, 2, 4 over T = 4.
    let rewards = t1(&[3.0, 0.0, 0.0]);
    let mask = t2(&[
        &[1.0, 0.0, 0.0, 0.0],
        &[1.0, 1.0, 0.0, 0.0],
        &[1.0, 1.0, 1.0, 1.0],
    ]);
    let alg = Algorithm::DrGrpo;
    let adv = alg
        .estimator(GaeConfig::default())
        .compute(&AdvantageInputs {
            scores: &rewards,
            rewards: &rewards,
            mask: &mask,
            groups: &[0, 0, 0],
            kl: None,
            values: None,
        })
        .unwrap()
        .advantages;
    close(
        &vals(&adv),
        &[2., 0., 0., 0., -1., -1., 0., 0., -1., -1., -1., -1.],
    );
    assert_eq!(alg.policy_loss(), PolicyLossKind::Ppo);
    assert_eq!(alg.default_loss_agg(), LossAggMode::SeqMeanTokenSumNorm);
    let cfg = PolicyLossConfig {
        agg: alg.default_loss_agg().with_max_len(4),
        ..Default::default()
    };
    // On-policy (ratio 1): per-token loss −A. Sequence sums −2, 2, 4; each ÷ max_len 4
    // → −0.5, 0.5, 1; mean over the 3 sequences = 1/3.
    // (token-mean would give 4/7, seq-mean-token-mean 0.)
    let logp = Tensor::zeros([3, 4], (Kind::Double, tch::Device::Cpu)).set_requires_grad(true);
    let (loss, _) = policy_loss(&logp, &logp.detach(), &adv, &mask, &cfg).unwrap();
    close1(scalar(&loss), 1.0 / 3.0);
    loss.backward();
    // ∂/∂logp_t = −A_t·ρ / (max_len · B) = −A_t / 12 on every valid token: the same
    // weight for a token of a 2-token and of a 4-token response (no length bias).
    let g = 1.0 / 12.0;
    close(
        &vals(&logp.grad()),
        &[-2.0 * g, 0., 0., 0., g, g, 0., 0., g, g, g, g],
    );
}

// Sequence ratios: row 0 log-ratios [0.3, −0.1, 0.1] → mean 0.1, s0 = e^0.1 = 1.1051709;
// row 1 [−0.02, 0.0, pad 5.0] → mean −0.01, s1 = e^−0.01 = 0.9900498 (the pad is ignored).
fn gspo_inputs() -> (Tensor, Tensor, Tensor) {
    let logp = t2(&[&[0.3, -0.1, 0.1], &[-0.02, 0.0, 5.0]]);
    let old = t2(&[&[0.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
    let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
    (logp, old, mask)
}

#[test]
fn gspo_clips_the_sequence_ratio_with_the_papers_range() {
    let (logp, old, mask) = gspo_inputs();
    let logp = logp.set_requires_grad(true);
    let adv = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
    let alg = Algorithm::Gspo;
    assert_eq!(alg.default_clip(), (3e-4, 4e-4));
    let cfg = PolicyLossConfig {
        kind: alg.policy_loss(),
        clip_low: 3e-4,
        clip_high: 4e-4,
        dual_clip: None,
        agg: alg.default_loss_agg().with_max_len(3),
    };
    let (loss, st) = policy_loss(&logp, &old, &adv, &mask, &cfg).unwrap();
    // row 0, A = 1: max(−1.1051709, −1.0004) = −1.0004 (clipped at 1 + 4e-4)
    // row 1, A = 1: max(−0.9900498, −0.9997) = −0.9900498 (A > 0 below 1 − ε: unclipped)
    // mean over the 2 sequences = −0.9952249
    close1(scalar(&loss), -0.995_224_916_874_584);
    // clipped: the 3 tokens of row 0 of 5 → 0.6; ratio_mean (3·s0 + 2·s1)/5
    close1(st.clip_frac, 0.6);
    close1(
        st.ratio_mean,
        (3.0 * 1.105_170_918_075_647_7 + 2.0 * 0.990_049_833_749_168) / 5.0,
    );
    // approx_kl = −mean token log-ratio = −(0.3 − 0.1 + 0.1 − 0.02)/5 = −0.056
    close1(st.approx_kl, -0.056);
    loss.backward();
    // row 0 clipped → 0. Row 1: loss = ½·(−s1), s1 = exp((lp0 + lp1)/2) →
    // ∂/∂lp_t = −s1/4 = −0.2475125 on both valid tokens, 0 on the pad.
    let g1 = -0.247_512_458_437_292;
    close(&vals(&logp.grad()), &[0., 0., 0., g1, g1, 0.]);
}

#[test]
fn gspo_gradient_is_the_sequence_ratios_and_gspo_token_weighs_token_advantages() {
    let (logp, old, mask) = gspo_inputs();
    // token advantages, mean 1 on both rows (row 1's pad 7 is not counted)
    let adv = t2(&[&[1.0, 0.0, 2.0], &[1.0, 1.0, 7.0]]);
    let wide = PolicyLossConfig {
        kind: PolicyLossKind::Gspo,
        clip_low: 0.2,
        clip_high: 0.2,
        dual_clip: None,
        agg: LossAgg::SeqMeanTokenMean,
    };
    let (s0, s1) = (1.105_170_918_075_647_7, 0.990_049_833_749_168);
    for (kind, row0) in [
        // GSPO: A_i = 1 → loss_0 = −s0 = −A·exp(mean lp) → ∂/∂lp_t = −s0/(2·3) each
        (PolicyLossKind::Gspo, [-s0 / 6.0; 3]),
        // GSPO-token: ∂/∂lp_t = −A_t·s0/(2·3) → [−s0/6, 0, −2·s0/6]
        (PolicyLossKind::GspoToken, [-s0 / 6.0, 0.0, -s0 / 3.0]),
    ] {
        let lp = logp.copy().set_requires_grad(true);
        let cfg = PolicyLossConfig { kind, ..wide };
        let (loss, st) = policy_loss(&lp, &old, &adv, &mask, &cfg).unwrap();
        // both unclipped; the value is the same: (−s0 − s1)/2 = −1.0476104
        close1(scalar(&loss), -1.047_610_375_912_408);
        close1(st.clip_frac, 0.0);
        loss.backward();
        // row 1: −s1/4 per valid token (PPO's token ratios would give e^0.3 etc.)
        let g1 = -s1 / 4.0;
        close(&vals(&lp.grad()), &[row0[0], row0[1], row0[2], g1, g1, 0.0]);
    }
}

#[test]
fn cispo_clips_the_weight_and_keeps_every_tokens_gradient() {
    // ratios: row 0 [1.5, 0.5, 1.1], row 1 [2, pad, pad]; A row 0 [1, 1, −1], row 1 [−1]
    let logp = t2(&[
        &[1.5f64.ln(), 0.5f64.ln(), 1.1f64.ln()],
        &[2f64.ln(), 0.0, 0.0],
    ]);
    let old = t2(&[&[0.0, 0.0, 0.0], &[0.0, 0.0, 0.0]]);
    let adv = t2(&[&[1.0, 1.0, -1.0], &[-1.0, 0.0, 0.0]]);
    let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 0.0, 0.0]]);
    let cfg = PolicyLossConfig {
        kind: Algorithm::Cispo.policy_loss(),
        clip_low: 0.2,
        clip_high: 0.28,
        dual_clip: None,
        agg: Algorithm::Cispo.default_loss_agg().with_max_len(3),
    };
    let lp = logp.copy().set_requires_grad(true);
    let (loss, st) = policy_loss(&lp, &old, &adv, &mask, &cfg).unwrap();
    // weights clip(ρ, 0.8, 1.28) = [1.28, 0.8, 1.1], [1.28]; per token −w·A·log π:
    // −1.28·ln1.5 = −0.5189953, −0.8·ln0.5 = 0.5545177, 1.1·ln1.1 = 0.1048412,
    // 1.28·ln2 = 0.8872284; token-mean over 4 = 0.2568980
    close1(scalar(&loss), 0.256_897_998_742_748_3);
    // weight clipped on 1.5, 0.5 and 2 → 3/4
    close1(st.clip_frac, 0.75);
    close1(st.ratio_mean, 1.275);
    loss.backward();
    // ∂/∂log π = −w·A/4 on every valid token, the clipped ones included (PPO would give
    // 0 at 1.5 and 2): [−0.32, −0.2, 0.275], [0.32]. Without the stop-gradient on the
    // weight the unclipped 1.1 would get −A·ρ·(1 + log π)/4 = 0.3012 instead.
    close(&vals(&lp.grad()), &[-0.32, -0.2, 0.275, 0.32, 0.0, 0.0]);

    // clip_low = 1 (MiniMax-M1: no lower bound): weight 0.5 stays 0.5
    let no_low = PolicyLossConfig {
        clip_low: 1.0,
        ..cfg
    };
    let lp = logp.copy().set_requires_grad(true);
    let (loss, st) = policy_loss(&lp, &old, &adv, &mask, &no_low).unwrap();
    close1(scalar(&loss), 0.204_911_960_200_752_4);
    close1(st.clip_frac, 0.5);
    loss.backward();
    close(&vals(&lp.grad()), &[-0.32, -0.125, 0.275, 0.32, 0.0, 0.0]);
}

#[test]
fn gspo_and_cispo_reject_bad_clip_ranges_and_the_dual_clip() {
    let (logp, old, mask) = gspo_inputs();
    let adv = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
    for (kind, clip_low, dual_clip, key) in [
        (PolicyLossKind::Gspo, 1.0, None, "clip_low"),
        (PolicyLossKind::Cispo, 1.5, None, "clip_low"),
        (PolicyLossKind::Cispo, 0.2, Some(3.0), "dual_clip"),
    ] {
        let cfg = PolicyLossConfig {
            kind,
            clip_low,
            dual_clip,
            ..Default::default()
        };
        let e = policy_loss(&logp, &old, &adv, &mask, &cfg)
            .unwrap_err()
            .to_string();
        assert!(e.contains(key), "{kind:?}: {e}");
    }
    let cfg = PolicyLossConfig {
        kind: PolicyLossKind::Cispo,
        ..Default::default()
    };
    let e = policy_loss(&logp, &old, &adv.select(1, 0), &mask, &cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("advantages"), "{e}");
}
