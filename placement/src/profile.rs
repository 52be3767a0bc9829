//! Roles, hardware and model shapes, and what each role costs in memory and time.
//!
//! The time formulas are rooflines: decoding reads the weights once per iteration and
//! each sequence's KV cache once per token; prefill, scoring and training are bound by
//! FLOPs. The same formulas serve as the cost model's prior (with nominal
//! [`Efficiency`]) and as the simulator's ground truth (with the efficiencies a config
//! says the hardware really reaches), so the online fit has something real to find.

use std::fmt;

use serde::{Deserialize, Serialize};

/// An RLHF role that may need GPU groups, in pipeline order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Generates responses (decoding engine replicas).
    Rollout,
    /// Scores responses: a scalar reward model or a generative judge (GenRM).
    Reward,
    /// The frozen reference policy (log-probs for the KL term).
    Reference,
    /// The trained policy: old log-probs and the update.
    Policy,
    /// The value model of PPO: values and its own update.
    Critic,
}

impl Role {
    /// Every role, in pipeline order.
    pub const ALL: [Role; 5] = [
        Role::Rollout,
        Role::Reward,
        Role::Reference,
        Role::Policy,
        Role::Critic,
    ];

    /// The role's name, as in actor names and configs.
    pub fn name(self) -> &'static str {
        match self {
            Role::Rollout => "rollout",
            Role::Reward => "reward",
            Role::Reference => "reference",
            Role::Policy => "policy",
            Role::Critic => "critic",
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of roles (the roles that time-share one pool of groups).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct RoleSet(u8);

impl RoleSet {
    /// No role.
    pub const EMPTY: RoleSet = RoleSet(0);

    /// The set holding exactly these roles.
    pub fn of(roles: &[Role]) -> RoleSet {
        let mut s = RoleSet::EMPTY;
        for r in roles {
            s.insert(*r);
        }
        s
    }

    /// Adds a role.
    pub fn insert(&mut self, role: Role) {
        self.0 |= role.bit();
    }

    /// Whether the role is in the set.
    pub fn contains(self, role: Role) -> bool {
        self.0 & role.bit() != 0
    }

    /// How many roles.
    pub fn len(self) -> usize {
        self.0.count_ones() as usize
    }

    /// Whether it holds no role.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The roles in pipeline order.
    pub fn iter(self) -> impl Iterator<Item = Role> {
        Role::ALL.into_iter().filter(move |r| self.contains(*r))
    }

    /// The union of two sets.
    pub fn union(self, other: RoleSet) -> RoleSet {
        RoleSet(self.0 | other.0)
    }

    /// Whether the two sets share a role.
    pub fn intersects(self, other: RoleSet) -> bool {
        self.0 & other.0 != 0
    }
}

impl fmt::Display for RoleSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("(none)");
        }
        let names: Vec<&str> = self.iter().map(Role::name).collect();
        f.write_str(&names.join("+"))
    }
}

impl Serialize for RoleSet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for RoleSet {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let roles = Vec::<Role>::deserialize(d)?;
        Ok(RoleSet::of(&roles))
    }
}

/// One kind of accelerator: what the rooflines need.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    /// A name for reports, e.g. "h100".
    pub name: String,
    /// Device memory, bytes.
    pub memory_bytes: f64,
    /// Dense bf16 peak, FLOP/s.
    pub flops: f64,
    /// HBM bandwidth, bytes/s.
    pub hbm_bytes_per_s: f64,
    /// Host-device copy bandwidth per device (offload/reload), bytes/s.
    pub pcie_bytes_per_s: f64,
    /// Network bandwidth per device between nodes (weight sync, migration), bytes/s.
    pub net_bytes_per_s: f64,
    /// Host memory per device, for offloaded state, bytes.
    pub host_memory_bytes: f64,
}

impl GpuSpec {
    /// A named preset: `h100`, `h200`, `a100`.
    pub fn preset(name: &str) -> Option<GpuSpec> {
        let (mem, flops, hbm) = match name {
            "h100" => (80e9, 989e12, 3.35e12),
            "h200" => (141e9, 989e12, 4.8e12),
            "a100" => (80e9, 312e12, 2.0e12),
            _ => return None,
        };
        Some(GpuSpec {
            name: name.to_string(),
            memory_bytes: mem,
            flops,
            hbm_bytes_per_s: hbm,
            pcie_bytes_per_s: 25e9,
            net_bytes_per_s: 25e9,
            host_memory_bytes: 256e9,
        })
    }

    /// The names [`GpuSpec::preset`] knows.
    pub const PRESETS: [&'static str; 3] = ["h100", "h200", "a100"];
}

/// A decoder-only transformer's shape: what memory and time depend on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// A name for reports, e.g. "7b".
    pub name: String,
    /// Parameter count.
    pub params: f64,
    /// Transformer layers.
    pub layers: u32,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: u32,
    /// Dimension of one head.
    pub head_dim: u32,
}

impl ModelSpec {
    /// A Llama-family preset by size: `1b`, `3b`, `7b`, `8b`, `14b`, `32b`, `70b`.
    pub fn preset(name: &str) -> Option<ModelSpec> {
        let (params, layers, kv_heads, head_dim) = match name {
            "1b" => (1.24e9, 16, 8, 64),
            "3b" => (3.2e9, 28, 8, 128),
            "7b" => (7.6e9, 28, 4, 128),
            "8b" => (8.0e9, 32, 8, 128),
            "14b" => (14.8e9, 48, 8, 128),
            "32b" => (32.8e9, 64, 8, 128),
            "70b" => (70.6e9, 80, 8, 128),
            _ => return None,
        };
        Some(ModelSpec {
            name: name.to_string(),
            params,
            layers,
            kv_heads,
            head_dim,
        })
    }

    /// The names [`ModelSpec::preset`] knows.
    pub const PRESETS: [&'static str; 7] = ["1b", "3b", "7b", "8b", "14b", "32b", "70b"];

    /// bf16 weights, bytes.
    pub fn weight_bytes(&self) -> f64 {
        2.0 * self.params
    }

    /// Training state with mixed-precision Adam: bf16 weights and gradients, f32
    /// master weights and two moments, 16 bytes per parameter.
    pub fn train_state_bytes(&self) -> f64 {
        16.0 * self.params
    }

    /// KV cache per token (K and V, every layer, bf16), bytes.
    pub fn kv_bytes_per_token(&self) -> f64 {
        2.0 * f64::from(self.layers) * f64::from(self.kv_heads) * f64::from(self.head_dim) * 2.0
    }
}

/// Fractions of peak a kind of work reaches.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Efficiency {
    /// Fraction of HBM bandwidth decoding reaches.
    pub decode_hbm: f64,
    /// FLOP utilisation of a decoding iteration's matmuls.
    pub decode_mfu: f64,
    /// FLOP utilisation of prefill and scoring (forward only).
    pub forward_mfu: f64,
    /// FLOP utilisation of training (forward and backward).
    pub train_mfu: f64,
}

impl Default for Efficiency {
    /// The nominal values the cost model starts from before it has measured anything.
    fn default() -> Self {
        Efficiency {
            decode_hbm: 0.75,
            decode_mfu: 0.5,
            forward_mfu: 0.5,
            train_mfu: 0.4,
        }
    }
}

/// Per-iteration time of a decoding engine on one group (tensor-parallel over it):
/// `a + b·B + c·(sum of the B sequences' context lengths)` seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DecodeCoeffs {
    /// Seconds per iteration regardless of batch: reading the weights, TP latency.
    pub a: f64,
    /// Seconds per sequence in the batch: the matmul FLOPs of one token.
    pub b: f64,
    /// Seconds per context token held: reading the KV cache.
    pub c: f64,
    /// Group-seconds per prompt token of prefill.
    pub prefill: f64,
}

impl DecodeCoeffs {
    /// From the roofline of `model` on a group of `devices` devices of `gpu`.
    pub fn roofline(model: &ModelSpec, gpu: &GpuSpec, devices: u32, eff: &Efficiency) -> Self {
        let g = f64::from(devices.max(1));
        let hbm = g * gpu.hbm_bytes_per_s * eff.decode_hbm;
        // Two all-reduces per layer under tensor parallelism, ~8 µs each on NVLink.
        let tp = if devices > 1 {
            2.0 * f64::from(model.layers) * 8e-6
        } else {
            0.0
        };
        DecodeCoeffs {
            a: model.weight_bytes() / hbm + tp,
            b: 2.0 * model.params / (g * gpu.flops * eff.decode_mfu),
            c: model.kv_bytes_per_token() / hbm,
            prefill: 2.0 * model.params / (g * gpu.flops * eff.forward_mfu),
        }
    }

    /// Seconds of one iteration with `batch` sequences holding `context` tokens in all.
    pub fn iteration(&self, batch: f64, context: f64) -> f64 {
        self.a + self.b * batch + self.c * context
    }
}

/// Most sequences a decoding engine runs at once, whatever memory allows (vLLM's
/// `max_num_seqs` is of this order).
pub const MAX_SEQS_PER_GROUP: u32 = 512;

/// Device memory a decoding engine leaves for its KV cache on a group, bytes.
pub fn kv_capacity_bytes(model: &ModelSpec, gpu: &GpuSpec, devices: u32) -> f64 {
    let g = f64::from(devices.max(1));
    // 10% for the allocator, CUDA graphs and activations.
    0.9 * g * gpu.memory_bytes - model.weight_bytes()
}

/// Concurrent sequences a group can decode when each holds `context` tokens on average.
pub fn decode_slots(model: &ModelSpec, gpu: &GpuSpec, devices: u32, context: f64) -> u32 {
    let cap = kv_capacity_bytes(model, gpu, devices);
    if cap <= 0.0 {
        return 0;
    }
    let per_seq = model.kv_bytes_per_token() * context.max(1.0);
    ((cap / per_seq).floor() as u32).min(MAX_SEQS_PER_GROUP)
}

/// Device-seconds per token of a forward pass (scoring, reference, old log-probs).
pub fn forward_s_per_token(model: &ModelSpec, gpu: &GpuSpec, eff: &Efficiency) -> f64 {
    2.0 * model.params / (gpu.flops * eff.forward_mfu)
}

/// Device-seconds per token of a training pass (forward and backward).
pub fn train_s_per_token(model: &ModelSpec, gpu: &GpuSpec, eff: &Efficiency) -> f64 {
    6.0 * model.params / (gpu.flops * eff.train_mfu)
}

/// How the reward is computed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind", deny_unknown_fields)]
pub enum RewardKind {
    /// A rule-based verifier on CPU: needs no group.
    Rule,
    /// A scalar reward model: one forward pass per sample.
    Scalar {
        /// The reward model.
        model: ModelSpec,
    },
    /// A generative judge: decodes a verdict per sample.
    Generative {
        /// The judge model.
        model: ModelSpec,
    },
}

/// The roles of a job and the models behind them: what placement plans for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobShape {
    /// The policy (rollout, reference and policy roles run this model).
    pub policy: ModelSpec,
    /// How rewards are computed.
    pub reward: RewardKind,
    /// The critic model, for PPO; none for critic-free algorithms (GRPO, RLOO, ...).
    pub critic: Option<ModelSpec>,
    /// Whether there is a reference model (a KL term).
    pub reference: bool,
    /// Training passes over each batch (PPO epochs).
    pub train_epochs: u32,
    /// Longest response, tokens (the rollout's KV cache must hold it).
    pub max_response: u32,
    /// Mean prompt length, tokens.
    pub prompt_len: u32,
}

impl JobShape {
    /// A critic-free job with a reference model (GRPO and friends), one training pass
    /// per batch, 512-token prompts and responses of at most `max_response` tokens.
    pub fn new(policy: ModelSpec, reward: RewardKind, max_response: u32) -> Self {
        JobShape {
            policy,
            reward,
            critic: None,
            reference: true,
            train_epochs: 1,
            max_response,
            prompt_len: 512,
        }
    }

    /// The roles that need GPU groups, in pipeline order.
    pub fn gpu_roles(&self) -> RoleSet {
        let mut s = RoleSet::of(&[Role::Rollout, Role::Policy]);
        if !matches!(self.reward, RewardKind::Rule) {
            s.insert(Role::Reward);
        }
        if self.reference {
            s.insert(Role::Reference);
        }
        if self.critic.is_some() {
            s.insert(Role::Critic);
        }
        s
    }

    /// The model a role runs, if it runs one on a GPU.
    pub fn model(&self, role: Role) -> Option<&ModelSpec> {
        match role {
            Role::Rollout | Role::Policy => Some(&self.policy),
            Role::Reference => self.reference.then_some(&self.policy),
            Role::Critic => self.critic.as_ref(),
            Role::Reward => match &self.reward {
                RewardKind::Rule => None,
                RewardKind::Scalar { model } | RewardKind::Generative { model } => Some(model),
            },
        }
    }

    /// Whether a role decodes (its work is sequences in a continuous batch) rather than
    /// running fixed-size forward or training passes.
    pub fn decodes(&self, role: Role) -> bool {
        role == Role::Rollout
            || (role == Role::Reward && matches!(self.reward, RewardKind::Generative { .. }))
    }

    /// What `role` holds in device memory, the unit of the plan's memory check.
    pub fn memory(&self, role: Role) -> Option<MemoryProfile> {
        let model = self.model(role)?;
        let ctx = f64::from(self.prompt_len + self.max_response);
        Some(match role {
            Role::Policy | Role::Critic => MemoryProfile {
                resident_bytes: model.train_state_bytes(),
                sharding: Sharding::Pool,
                // Activations of one micro-batch with checkpointing: a few GB.
                peak_extra_bytes: 4e9,
                offloadable: true,
            },
            _ if self.decodes(role) => MemoryProfile {
                resident_bytes: model.weight_bytes(),
                sharding: Sharding::Group,
                // Room for the KV cache of a handful of longest sequences; the engine
                // takes whatever else is free.
                peak_extra_bytes: 8.0 * model.kv_bytes_per_token() * ctx,
                offloadable: true,
            },
            _ => MemoryProfile {
                resident_bytes: model.weight_bytes(),
                sharding: Sharding::Group,
                peak_extra_bytes: 2e9,
                offloadable: true,
            },
        })
    }
}

/// How a role's resident state is spread over devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Sharding {
    /// Split over the devices of one group (tensor parallel); every group holds a copy.
    Group,
    /// Split over every device of the pool (ZeRO-3 / FSDP data parallel). Training
    /// then moves about 3·(N−1)/N of the weights through each device's link per
    /// micro-batch ([`crate::ShardedStep`]).
    Pool,
}

/// What a role needs in device memory: the planner's view of the role's resource
/// profile (`yatt_roles::ResourceProfile` reports the same fields live).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MemoryProfile {
    /// State held while loaded (weights, optimizer), bytes in all, before sharding.
    pub resident_bytes: f64,
    /// How the resident state is split over devices.
    pub sharding: Sharding,
    /// Extra per device at peak (activations, KV cache), bytes.
    pub peak_extra_bytes: f64,
    /// Whether the role can move its state to host memory between phases.
    pub offloadable: bool,
}

impl MemoryProfile {
    /// Bytes per device on a pool of `pool_devices` devices in groups of `group_devices`.
    pub fn per_device(&self, group_devices: u32, pool_devices: u32) -> f64 {
        let over = match self.sharding {
            Sharding::Group => group_devices,
            Sharding::Pool => pool_devices,
        };
        self.resident_bytes / f64::from(over.max(1)) + self.peak_extra_bytes
    }

    /// The resident part alone, per device (what offloading moves to the host).
    pub fn resident_per_device(&self, group_devices: u32, pool_devices: u32) -> f64 {
        let over = match self.sharding {
            Sharding::Group => group_devices,
            Sharding::Pool => pool_devices,
        };
        self.resident_bytes / f64::from(over.max(1))
    }
}

/// Formats bytes as GiB for messages.
pub fn gib(bytes: f64) -> String {
    format!("{:.1} GiB", bytes / f64::from(1u32 << 30))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roleset_orders_and_formats() {
        let s = RoleSet::of(&[Role::Policy, Role::Rollout, Role::Reference]);
        assert_eq!(s.to_string(), "rollout+reference+policy");
        assert_eq!(s.len(), 3);
        assert!(!s.contains(Role::Reward));
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(json, r#"["rollout","reference","policy"]"#);
        assert_eq!(serde_json::from_str::<RoleSet>(&json).unwrap(), s);
    }

    #[test]
    fn roofline_orders_of_magnitude() {
        let m = ModelSpec::preset("7b").unwrap();
        let g = GpuSpec::preset("h100").unwrap();
        let d = DecodeCoeffs::roofline(&m, &g, 2, &Efficiency::default());
        // Reading 15 GB of weights over two GPUs at 75% of 3.35 TB/s: about 3 ms.
        assert!(d.a > 2e-3 && d.a < 4e-3, "{}", d.a);
        // A full batch decodes thousands of tokens per second per GPU.
        let slots = decode_slots(&m, &g, 2, 3000.0);
        assert!(slots > 100, "{slots}");
        let t = d.iteration(f64::from(slots), f64::from(slots) * 3000.0);
        let per_gpu = f64::from(slots) / t / 2.0;
        assert!(per_gpu > 2000.0 && per_gpu < 20000.0, "{per_gpu}");
    }

    #[test]
    fn no_kv_room_means_no_slots() {
        let m = ModelSpec::preset("70b").unwrap();
        let g = GpuSpec::preset("h100").unwrap();
        // 141 GB of weights do not fit on one 80 GB device.
        assert_eq!(decode_slots(&m, &g, 1, 1000.0), 0);
        assert!(decode_slots(&m, &g, 8, 1000.0) > 0);
    }
}
