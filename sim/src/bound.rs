//! The lower bound every placement is measured against.

use yatt_placement::{
    decode_slots, forward_s_per_token, train_s_per_token, DecodeCoeffs, RewardKind, World,
};

/// Each step's lower bound: the minimal prompt groups that fill its batch (the same
/// groups every strategy draws first), their work at full efficiency, over all devices.
pub fn lower_bound(w: &World) -> Vec<f64> {
    let job = &w.job;
    let g = f64::from(w.group_devices);
    let devices = f64::from(w.groups) * g;
    let gen = DecodeCoeffs::roofline(&job.policy, &w.gpu, w.group_devices, &w.truth);
    let judge_model = match &job.reward {
        RewardKind::Generative { model } | RewardKind::Scalar { model } => Some(model.clone()),
        RewardKind::Rule => None,
    };
    let judge = judge_model
        .as_ref()
        .map(|m| DecodeCoeffs::roofline(m, &w.gpu, w.group_devices, &w.truth));
    let fwd = forward_s_per_token(&job.policy, &w.gpu, &w.truth);
    let train = train_s_per_token(&job.policy, &w.gpu, &w.truth);
    let critic = job.critic.as_ref().map(|c| {
        (
            forward_s_per_token(c, &w.gpu, &w.truth),
            train_s_per_token(c, &w.gpu, &w.truth),
        )
    });
    let decode = |c: &DecodeCoeffs, slots: f64, ctx0: f64, len: f64| {
        g * (c.a * len / slots
            + c.b * len
            + c.c * (ctx0 * len + len * (len + 1.0) / 2.0)
            + c.prefill * ctx0)
    };
    (0..w.workload.steps)
        .map(|k| {
            let f = w.workload.forecast_at(k);
            let slots = f64::from(
                decode_slots(
                    &job.policy,
                    &w.gpu,
                    w.group_devices,
                    f.params.prompt_len + f.mean_len(),
                )
                .max(1),
            );
            let jslots = judge_model.as_ref().map(|m| {
                let ctx =
                    f.params.prompt_len + f.mean_len() + f.params.judge_prompt + f.mean_judge_len();
                f64::from(decode_slots(m, &w.gpu, w.group_devices, ctx).max(1))
            });
            let mut kept = 0;
            let mut work = 0.0;
            let mut i = 0;
            while kept < w.workload.prompts_per_step {
                let pg = w.workload.group(k, i);
                i += 1;
                let p = f64::from(pg.prompt_len);
                let mut tokens = 0.0;
                for (s, &l) in pg.lengths.iter().enumerate() {
                    let l = f64::from(l);
                    tokens += p + l;
                    work += decode(&gen, slots, p, l);
                    match (&job.reward, &judge, jslots) {
                        (RewardKind::Generative { .. }, Some(jc), Some(js)) => {
                            let j = f64::from(pg.judge.get(s).copied().unwrap_or(1));
                            work += decode(jc, js, p + l + f64::from(w.workload.judge_prompt), j);
                        }
                        (RewardKind::Scalar { model }, _, _) => {
                            work += (p + l) * forward_s_per_token(model, &w.gpu, &w.truth);
                        }
                        _ => {}
                    }
                }
                if pg.keep {
                    kept += 1;
                    let epochs = f64::from(job.train_epochs.max(1));
                    let reference = if job.reference { fwd } else { 0.0 };
                    work += tokens * (reference + fwd + train * epochs);
                    if let Some((cf, ct)) = critic {
                        work += tokens * (cf + ct * epochs);
                    }
                }
            }
            work / devices
        })
        .collect()
}
