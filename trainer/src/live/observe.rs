//! What a step tells the placement policy: stage times, lengths, decode iterations.

use std::collections::BTreeMap;

use yatt_placement::GroupId;
use yatt_placement::GroupUse;
use yatt_placement::Role as PRole;
use yatt_placement::{Stage, StageObs};
use yatt_roles::Sample;

use crate::controller::report::StepReport;
use crate::error::JobError;
use crate::live::build::rollout_slots;
use crate::live::build::rset;
use crate::live::state::LivePlacement;
use crate::live::state::Observed;
use yatt_metrics::names;

impl LivePlacement {
    /// What the step did, as the cost model reads it, and each group's busy seconds.
    pub(crate) fn observe(&self, reports: &[StepReport], wall: f64) -> Result<Observed, JobError> {
        let (routes_r, routes_p) = self.routes()?;
        let get = |r: &StepReport, k: &str| r.metrics.get(k).unwrap_or(0.0);
        let mut gen_busy: BTreeMap<GroupId, f64> = BTreeMap::new();
        let mut pol_busy: BTreeMap<GroupId, (f64, f64)> = BTreeMap::new();
        let update = reports
            .first()
            .map_or(0.0, |r| get(r, names::UPDATE_ACTOR_S));
        for (i, r) in reports.iter().enumerate() {
            // Heads sharing a replica queue on it: the last to finish saw it busy all along.
            let g = routes_r[i].0;
            let e = gen_busy.entry(g).or_insert(0.0);
            *e = e.max(get(r, names::GEN_S));
            // The update's wall time keeps every policy group busy (a shared policy
            // computes the heads' gradients one after the other within it).
            let g = routes_p[i].0;
            let e = pol_busy.entry(g).or_insert((0.0, update));
            e.0 = e.0.max(get(r, names::OLD_LOG_PROB_S));
        }
        let samples: Vec<&Sample> = reports.iter().flat_map(|r| &r.samples).collect();
        let n = samples.len().max(1) as f64;
        let lens: Vec<f64> = samples.iter().map(|s| s.response_len() as f64).collect();
        let prompts: Vec<f64> = samples
            .iter()
            .map(|s| s.prompt_tokens.len() as f64)
            .collect();
        let tokens: f64 = lens.iter().sum();
        let all_tokens: f64 = tokens + prompts.iter().sum::<f64>();
        let ctx: f64 = lens
            .iter()
            .zip(&prompts)
            .map(|(l, p)| p * l + l * l / 2.0)
            .sum();
        let slots = rollout_slots(&self.job) as usize;
        let iterations: f64 = reports
            .iter()
            .map(|r| {
                let lens: Vec<usize> = r.samples.iter().map(Sample::response_len).collect();
                decode_iterations(&lens, slots) as f64
            })
            .sum();
        let logs: Vec<f64> = lens.iter().map(|l| l.max(1.0).ln()).collect();
        let log_mean = logs.iter().sum::<f64>() / n;
        let log_std = (logs.iter().map(|x| (x - log_mean).powi(2)).sum::<f64>() / n).sqrt();
        let obs = |stage, group_s, tokens| StageObs {
            stage,
            group_s,
            group_devices: 1,
            tokens,
            iterations: None,
            context_tokens: None,
            prefill_tokens: None,
        };
        let stages = vec![
            StageObs {
                iterations: Some(iterations),
                context_tokens: Some(ctx),
                prefill_tokens: Some(prompts.iter().sum()),
                ..obs(Stage::Gen, gen_busy.values().sum(), tokens)
            },
            obs(
                Stage::OldLogProb,
                pol_busy.values().map(|b| b.0).sum(),
                all_tokens,
            ),
            obs(
                Stage::TrainActor,
                pol_busy.values().map(|b| b.1).sum(),
                all_tokens,
            ),
        ];
        let sync = reports
            .iter()
            .map(|r| get(r, names::WEIGHT_SYNC_S))
            .fold(0.0, f64::max);
        let mut groups = Vec::new();
        for (g, b) in &gen_busy {
            groups.push(GroupUse {
                group: *g,
                roles: rset(PRole::Rollout),
                busy_s: *b,
            });
        }
        for (g, b) in &pol_busy {
            groups.push(GroupUse {
                group: *g,
                roles: rset(PRole::Policy),
                busy_s: b.0 + b.1,
            });
        }
        groups.sort_by_key(|u| u.group);
        Ok(Observed {
            metrics: yatt_placement::StepMetrics {
                step: reports.first().map_or(0, |r| r.metrics.step),
                step_s: wall,
                stages,
                response_len_mean: tokens / n,
                response_log_mean: log_mean,
                response_log_std: log_std,
                prompt_len_mean: prompts.iter().sum::<f64>() / n,
                weight_sync_s: Some(sync),
                weight_sync_local: false,
                ..Default::default()
            },
            groups,
        })
    }
}

/// Decoding iterations of a continuous batch of `slots` over sequences of `lens`
/// tokens, each slot taking the next sequence as soon as it is free.
pub(crate) fn decode_iterations(lens: &[usize], slots: usize) -> usize {
    let mut free = vec![0usize; slots.max(1)];
    for l in lens {
        let (i, _) = free
            .iter()
            .enumerate()
            .min_by_key(|(_, t)| **t)
            .expect("at least one slot");
        free[i] += l;
    }
    free.into_iter().max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::decode_iterations;

    #[test]
    fn decode_iterations_follow_the_slots() {
        assert_eq!(decode_iterations(&[5, 9, 3], 8), 9);
        assert_eq!(decode_iterations(&[5, 9, 3], 1), 17);
        assert_eq!(decode_iterations(&[5, 9, 3, 4], 2), 12);
        assert_eq!(decode_iterations(&[], 2), 0);
    }
}
