//! The names of the per-step metrics `yatt train` writes, verl-style (`group/name`).
//!
//! Writers and readers (the plots, the simulator's calibration, the live placement)
//! share these constants so that a renamed metric breaks the build, not a plot.

/// Prefix of every stage time; the rest of the name is the stage (`gen`, `ref`, ...).
pub const TIMING_PREFIX: &str = "timing_s/";
/// Seconds generating responses (the rollout).
pub const GEN_S: &str = "timing_s/gen";
/// Seconds scoring responses (reward model or rule).
pub const REWARD_S: &str = "timing_s/reward";
/// Seconds of the reference model's forward pass.
pub const REF_S: &str = "timing_s/ref";
/// Seconds of the critic's forward pass (PPO).
pub const VALUES_S: &str = "timing_s/values";
/// Seconds recomputing the policy's log-probabilities before the update.
pub const OLD_LOG_PROB_S: &str = "timing_s/old_log_prob";
/// Seconds computing advantages.
pub const ADV_S: &str = "timing_s/adv";
/// Seconds of the policy's training update.
pub const UPDATE_ACTOR_S: &str = "timing_s/update_actor";
/// Seconds of the critic's training update (PPO).
pub const UPDATE_CRITIC_S: &str = "timing_s/update_critic";
/// Seconds publishing the new weights to the rollout engines.
pub const WEIGHT_SYNC_S: &str = "timing_s/weight_sync";
/// Bytes the last weight sync exported (the whole model, or LoRA adapters alone).
pub const WEIGHT_SYNC_BYTES: &str = "perf/weight_sync_bytes";
/// Rollouts the step's weight sync reached through CUDA IPC (the others got bytes).
pub const WEIGHT_SYNC_CUDA_IPC: &str = "perf/weight_sync_cuda_ipc";
/// Rollouts the step's weight sync reached by NCCL broadcast.
pub const WEIGHT_SYNC_NCCL: &str = "perf/weight_sync_nccl";
/// Rollouts the step's weight sync reached from the policy's process in one hop (byte
/// buckets the policy's actor sent itself, not through the controller).
pub const WEIGHT_SYNC_DIRECT: &str = "perf/weight_sync_direct";
/// 1 when the policy replicas averaged the step's gradients through NCCL, 0 over the
/// QUIC ring (data-parallel replicas only).
pub const GRAD_ALLREDUCE_NCCL: &str = "perf/grad_allreduce_nccl";
/// A sharded policy (`job.policy_shards > 1`): the most training state one rank held
/// in the step, bytes: its shards of the f32 master weights, gradients and both AdamW
/// moments (16Ψ/N) plus the most gathered weights and gradients held at once.
pub const TRAIN_STATE_BYTES: &str = "memory/train_state_bytes";
/// The job process's resident memory at the end of the step, bytes (`VmRSS`). In an
/// embedded run this process holds every role; on a cluster, the controllers only.
pub const PROCESS_RSS_BYTES: &str = "perf/process_rss_bytes";
/// The most the job process has held resident since it started, bytes (`VmHWM`; not
/// reset per step, as that would also reset what `time -v` reports).
pub const PROCESS_PEAK_RSS_BYTES: &str = "perf/process_peak_rss_bytes";
/// A sharded policy: its ranks in the step (under the live placement's sharded pool,
/// the policy groups, which change as groups move).
pub const POLICY_SHARDS: &str = "perf/policy_shards";
/// A sharded policy: bytes one rank received in the step's all-gathers of weights
/// (each unit twice per micro-batch: forward and recompute), (N−1)/N of each.
pub const SHARD_GATHERED_BYTES: &str = "perf/shard_gathered_bytes";
/// A sharded policy: bytes one rank sent in the step's reduce-scatters of gradients.
pub const SHARD_REDUCED_BYTES: &str = "perf/shard_reduced_bytes";
/// Bytes one rank of a sharded policy sent averaging its gradient shards with its
/// peers in the other replicas (HSDP, `job.policy_replicas > 1`).
pub const SHARD_REPLICA_BYTES: &str = "perf/shard_replica_bytes";
/// A sharded policy: seconds the slowest rank spent in the step's all-gathers (on its
/// communication thread, much of it behind compute with prefetch).
pub const SHARD_GATHER_S: &str = "perf/shard_gather_s";
/// A sharded policy: seconds of those the slowest rank's compute waited for, the gather
/// time prefetch left exposed.
pub const SHARD_GATHER_EXPOSED_S: &str = "perf/shard_gather_exposed_s";
/// Seconds the step spent offloading roles between phases (`placement.time_share =
/// "offload"`: the policy, critic and reference before generation, the rollout after it).
pub const OFFLOAD_S: &str = "timing_s/offload";
/// Seconds the step spent reloading roles between phases (`placement.time_share =
/// "offload"`), the weight sync a reloaded rollout applies included.
pub const RELOAD_S: &str = "timing_s/reload";
/// Prefix of the bytes a role holds in device tensors while it sits a phase out
/// (`placement.time_share = "offload"`, measured after its offload): the rest of the
/// name is the role (`perf/resident_bytes/policy` is the policy's during generation).
pub const RESIDENT_BYTES_PREFIX: &str = "perf/resident_bytes/";
/// Prefix of the bytes a role held in device tensors just before its offload (its
/// loaded size, what a reload needs room for): the rest of the name is the role.
pub const RESIDENT_BYTES_LOADED_PREFIX: &str = "perf/resident_bytes_loaded/";
/// Wall seconds of the whole step.
pub const STEP_S: &str = "timing_s/step";
/// Prefix of one head's own values in a step of several data-parallel heads, where the
/// unprefixed metric is the mean over the heads: `head/1/timing_s/gen` is head 1's
/// generation time. Kept for the stage times ([`TIMING_PREFIX`]) and the pipeline's
/// [`OVERLAP_S`], [`GEN_AHEAD_S`] and [`SAMPLES_CARRIED`], which the live view draws
/// one timeline row per head from.
pub const HEAD_PREFIX: &str = "head/";

/// The metric a name stands for with any [`HEAD_PREFIX`] taken off
/// (`head/1/timing_s/gen` → `timing_s/gen`); other names are their own.
pub fn without_head(name: &str) -> &str {
    name.strip_prefix(HEAD_PREFIX)
        .and_then(|rest| rest.split_once('/'))
        .filter(|(i, _)| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
        .map_or(name, |(_, metric)| metric)
}

/// Whether a head's own value of `name` goes into the step's record.
pub fn kept_per_head(name: &str) -> bool {
    name.starts_with(TIMING_PREFIX)
        || name == OVERLAP_S
        || name == GEN_AHEAD_S
        || name == SAMPLES_CARRIED
}
/// Wall seconds of the step as the live placement measures it (including migrations).
pub const STEP_WALL_S: &str = "timing_s/step_wall";

/// Mean response length of the step's samples, tokens.
pub const RESPONSE_LENGTH_MEAN: &str = "response_length/mean";
/// Mean prompt length of the step's samples, tokens.
pub const PROMPT_LENGTH_MEAN: &str = "prompt_length/mean";
/// Prompt + response tokens of the samples trained on.
pub const TOTAL_NUM_TOKENS: &str = "perf/total_num_tokens";
/// Trained tokens per second per device.
pub const THROUGHPUT: &str = "perf/throughput";
/// Generated tokens per second.
pub const GEN_TOKENS_PER_S: &str = "perf/gen_tokens_per_s";
/// Multi-turn rollouts: prompt positions whose KV the rollout kept from the episode's
/// previous turn instead of prefilling them again (present when there were any).
pub const PREFILL_REUSED_TOKENS: &str = "perf/prefill_reused_tokens";

/// Mean reward per sample.
pub const REWARDS_MEAN: &str = "critic/rewards/mean";
/// Mean score per sample before any KL penalty.
pub const SCORE_MEAN: &str = "critic/score/mean";
/// Mean advantage.
pub const ADVANTAGES_MEAN: &str = "critic/advantages/mean";
/// Mean return (PPO).
pub const RETURNS_MEAN: &str = "critic/returns/mean";
/// Mean value estimate (PPO).
pub const VALUES_MEAN: &str = "critic/values/mean";
/// The critic's value loss (PPO).
pub const VF_LOSS: &str = "critic/vf_loss";
/// Fraction of value predictions clipped (PPO).
pub const VF_CLIPFRAC: &str = "critic/vf_clipfrac";
/// Mean value prediction during the critic's update (PPO).
pub const VPRED_MEAN: &str = "critic/vpred_mean";
/// The critic's gradient norm (PPO).
pub const CRITIC_GRAD_NORM: &str = "critic/grad_norm";
/// Mean per-step score of process rewards.
pub const STEP_SCORES_MEAN: &str = "reward/step_scores/mean";
/// Step credit: failed steps per judged response.
pub const STEP_CREDIT_FAILED_STEPS: &str = "step_credit/failed_steps_mean";
/// Step credit: steps per judged response.
pub const STEP_CREDIT_STEPS: &str = "step_credit/steps_mean";
/// Step credit: share of the step's response tokens whose advantage was lowered.
pub const STEP_CREDIT_PENALISED_SHARE: &str = "step_credit/penalised_token_share";
/// Step credit: responses whose verdicts numbered other steps than the response has
/// (no credit applied to them).
pub const STEP_CREDIT_MISMATCHED: &str = "step_credit/mismatched";
/// Step credit: responses with steps but no step verdicts (the reward gave none).
pub const STEP_CREDIT_UNJUDGED: &str = "step_credit/unjudged";

/// KL to the reference, nats per token.
pub const KL: &str = "actor/kl";
/// The KL term of the policy loss.
pub const KL_LOSS: &str = "actor/kl_loss";
/// Mean entropy of the policy's token distributions.
pub const ENTROPY: &str = "actor/entropy";
/// Fraction of policy-gradient ratios clipped.
pub const PG_CLIPFRAC: &str = "actor/pg_clipfrac";
/// The policy's gradient norm.
pub const GRAD_NORM: &str = "actor/grad_norm";
/// The policy-gradient loss.
pub const PG_LOSS: &str = "actor/pg_loss";
/// Approximate KL between the old and the updated policy.
pub const PPO_KL: &str = "actor/ppo_kl";
/// The learning rate.
pub const LR: &str = "actor/lr";

/// The weights version the step trained.
pub const WEIGHTS_VERSION: &str = "training/weights_version";
/// Samples dropped for lagging the weights beyond the staleness bound.
pub const DROPPED_SAMPLES: &str = "training/dropped_samples";
/// Asynchronous RL: the largest lag of a trained sample, in policy versions from the
/// version its generation started with (the simulator's definition).
pub const STALENESS_MAX: &str = "async/staleness_max";
/// Asynchronous RL: the mean lag of the step's samples.
pub const STALENESS_MEAN: &str = "async/staleness_mean";
/// Samples trained in a later step than the one they were generated in.
pub const SAMPLES_CARRIED: &str = "async/samples_carried";
/// Samples whose generation a weight sync interrupted: later chunks decoded on newer
/// weights (partial rollouts).
pub const SAMPLES_INTERRUPTED: &str = "async/samples_interrupted";
/// Batches generated ahead and waiting at the end of the step.
pub const PENDING_BATCHES: &str = "async/pending_batches";
/// Seconds generation of later batches ran alongside this step's training.
pub const OVERLAP_S: &str = "async/overlap_s";
/// Seconds this step spent generating and rewarding the batches of later steps, beside
/// its training (from when the training of its own batch began).
pub const GEN_AHEAD_S: &str = "async/gen_ahead_s";
/// Mean importance weight π_old/π_rollout per token (before the cap).
pub const IS_WEIGHT_MEAN: &str = "off_policy/is_weight_mean";
/// Largest importance weight π_old/π_rollout.
pub const IS_WEIGHT_MAX: &str = "off_policy/is_weight_max";
/// Share of tokens whose importance weight the cap truncated or masked.
pub const IS_CAPPED_FRAC: &str = "off_policy/is_capped_frac";
/// Mean |old − rollout| log-prob difference per token.
pub const LOGPROB_DIFF_MEAN: &str = "rollout/logprob_diff_mean";
/// Largest |old − rollout| log-prob difference.
pub const LOGPROB_DIFF_MAX: &str = "rollout/logprob_diff_max";
/// Sequences the rollouts' paged KV cache preempted when its blocks ran out (each
/// resumed later by recomputing its prefix): a budget too small for the batch.
pub const KV_PREEMPTIONS: &str = "rollout/kv_preemptions";
/// Most bytes of KV blocks a rollout's live sequences held at once: the live tokens
/// rounded up to 16-position blocks, a group's shared prompt counted once.
pub const KV_BYTES_HELD: &str = "rollout/kv_bytes_held";
/// Generation rounds dynamic sampling needed to fill the batch.
pub const DAPO_GEN_ROUNDS: &str = "dapo/gen_rounds";
/// Prompt groups dynamic sampling dropped.
pub const DAPO_GROUPS_DROPPED: &str = "dapo/groups_dropped";
/// Fraction of prompt groups dynamic sampling kept.
pub const DAPO_KEEP_RATE: &str = "dapo/keep_rate";
/// 1 on a step where no prompt group had differing rewards in any round, so it trained
/// on flat groups (no policy-gradient signal); 0 otherwise.
pub const DAPO_WITHOUT_SIGNAL: &str = "dapo/without_signal";
/// Samples rewarded while generation was still running (streaming).
pub const REWARDED_DURING_GEN: &str = "stream/rewarded_during_gen";

/// The live placement's predicted seconds per step for the plan in force.
pub const PLACEMENT_PREDICTED_S: &str = "placement/predicted_s";
/// After a migration, the predicted seconds per step had the plan not changed.
pub const PLACEMENT_NO_MOVE_S: &str = "placement/no_move_s";
/// Samples requeued onto another group (a lost node, a migration).
pub const PLACEMENT_REQUEUED: &str = "placement/requeued";
/// Roles a disaggregated step spawned again on surviving nodes after losing theirs
/// (present only on a step that recovered).
pub const RECOVERY_RESPAWNED: &str = "recovery/respawned_roles";
/// 1 on a step whose update a surviving policy replica had already taken when its peer
/// was lost: the step ran again for its ledger without a second update, so its batch
/// was generated anew on the updated weights and it has no `actor/*` loss statistics.
pub const RECOVERY_UPDATE_COMMITTED: &str = "recovery/update_committed";
/// Critic updates given again to a critic that replaced a lost one (its updates since
/// the last checkpoint; present only on a step that replaced the critic).
pub const RECOVERY_CRITIC_REPLAYED: &str = "recovery/critic_replayed";
/// Policy updates given again to a policy that replaced a lost one (its updates since
/// the last checkpoint; present only on the step that ran again after the loss).
pub const RECOVERY_POLICY_REPLAYED: &str = "recovery/policy_replayed";
/// Samples the step's ledgers closed on as trained (every head's, summed): each was
/// accounted for at every stage exactly once.
pub const LEDGER_TRAINED: &str = "ledger/samples_trained";
/// Groups generating.
pub const PLACEMENT_ROLLOUT_GROUPS: &str = "placement/rollout_groups";
/// Groups training the policy.
pub const PLACEMENT_POLICY_GROUPS: &str = "placement/policy_groups";
/// Routing version controllers follow (bumped by every migration).
pub const PLACEMENT_ROUTING_VERSION: &str = "placement/routing_version";

/// Multi-turn episodes: mean model turns per episode.
pub const ENV_TURNS_MEAN: &str = "env/turns_mean";
/// Multi-turn episodes: tool calls per episode (mean).
pub const ENV_TOOL_CALLS_MEAN: &str = "env/tool_calls_mean";
/// Multi-turn episodes: share of episodes with at least one tool call.
pub const ENV_TOOL_CALL_RATE: &str = "env/tool_call_rate";
/// Multi-turn episodes: share of episodes whose first turn the environment opened with
/// a tool call (`rollout.env.call_prefix`).
pub const ENV_PREFIXED_SHARE: &str = "env/prefixed_share";
/// Multi-turn episodes the environment did not open a call for: share that called a
/// tool by themselves (with `call_prefix = "guide"`, the rate the guidance teaches).
pub const ENV_OWN_TOOL_CALL_RATE: &str = "env/own_tool_call_rate";
/// Multi-turn episodes: tool calls that failed (malformed, unknown tool, tool error), in all.
pub const ENV_TOOL_ERRORS: &str = "env/tool_errors";
/// Multi-turn episodes: episodes the environment failed (a crash, a missed deadline).
pub const ENV_FAILED: &str = "env/episodes_failed";
/// Multi-turn episodes: seconds spent inside environments, summed over episodes.
pub const ENV_SECONDS: &str = "timing_s/env";
/// Multi-turn episodes: share of response tokens that are the model's own (the rest are
/// observations, masked out of the loss).
pub const ENV_MODEL_TOKEN_SHARE: &str = "env/model_token_share";
/// Multi-turn episodes: mean environment reward per episode.
pub const ENV_REWARD_MEAN: &str = "env/reward_mean";
/// Evaluation during training (`eval.jsonl`): greedy accuracy on held-out prompts.
pub const EVAL_ACCURACY: &str = "eval/accuracy";
/// Evaluation during training (`eval.jsonl`): mean reward of the greedy answers.
pub const EVAL_MEAN_REWARD: &str = "eval/mean_reward";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heads_value_names_its_metric() {
        assert_eq!(without_head("head/1/timing_s/gen"), GEN_S);
        assert_eq!(without_head("head/12/async/overlap_s"), OVERLAP_S);
        assert_eq!(without_head(GEN_S), GEN_S);
        assert_eq!(without_head("head/x/timing_s/gen"), "head/x/timing_s/gen");
        assert_eq!(without_head("head//timing_s/gen"), "head//timing_s/gen");
        assert!(kept_per_head(GEN_S) && kept_per_head(GEN_AHEAD_S));
        assert!(!kept_per_head(REWARDS_MEAN));
    }
}
