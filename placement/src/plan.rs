//! Placement plans: which groups serve which roles, and whether that fits in memory.
//!
//! A plan is a list of pools. A pool is a set of roles that time-share a set of groups
//! (offloading and reloading between phases when there is more than one). Full
//! colocation is one pool holding every role; disaggregated is one role per pool;
//! anything in between is partial colocation.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::inventory::{GroupId, Inventory};
use crate::profile::{gib, JobShape, Role, RoleSet, Sharding};

/// Roles sharing groups.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pool {
    /// The roles that time-share the groups.
    pub roles: RoleSet,
    /// The groups, in id order.
    pub groups: Vec<GroupId>,
}

/// How a plan shares groups between roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    /// Every role time-shares every group.
    FullColocation,
    /// Some roles share groups, others have their own.
    PartialColocation,
    /// Every role has groups of its own.
    Disaggregated,
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::FullColocation => "full colocation",
            Mode::PartialColocation => "partial colocation",
            Mode::Disaggregated => "disaggregated",
        })
    }
}

/// A placement plan: roles to groups.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// The pools, each a set of roles on a set of groups.
    pub pools: Vec<Pool>,
    /// Most sequences a rollout group decodes at once (none: as many as memory
    /// allows). Smaller batches cut the latency of the longest responses, and decoding
    /// long contexts is bound by KV-cache reads, so they cost little throughput.
    #[serde(default)]
    pub rollout_batch_cap: Option<u32>,
    /// Straggler lanes: rollout groups kept for the longest responses (none: every
    /// rollout group takes every response).
    #[serde(default)]
    pub lanes: Option<Lanes>,
}

/// Straggler lanes: the last `groups` groups of the rollout pool (in id order) decode
/// only responses that have generated `threshold` tokens, at most `batch` at once. A
/// response moves there from an ordinary rollout group when it passes the threshold
/// and a lane has room; it brings its KV cache over the interconnect or, with
/// `resume = "reprefill"`, prefills its prompt and tokens again. A small batch decodes
/// each token faster (the weights are read once per iteration and only a few
/// sequences' KV caches), so the longest responses, which hold a step back, finish
/// sooner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lanes {
    /// Rollout groups kept as lanes.
    pub groups: u32,
    /// Most responses one lane decodes at once.
    pub batch: u32,
    /// Generated tokens after which a response moves to a lane.
    pub threshold: u32,
}

impl fmt::Display for Lanes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} lane(s) ≤{} from {} tokens",
            self.groups, self.batch, self.threshold
        )
    }
}

/// One group changing hands between two plans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Move {
    /// The group.
    pub group: GroupId,
    /// The roles it served.
    pub from: RoleSet,
    /// The roles it will serve.
    pub to: RoleSet,
}

/// Why a plan was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// A role that needs GPUs is in no pool.
    #[error("role {0} has no groups; put it in a pool (alone, or sharing with other roles)")]
    Unplaced(Role),
    /// A role is in two pools (a role's replicas form one pool).
    #[error("role {0} is in more than one pool; a role's groups must form one pool")]
    RoleTwice(Role),
    /// A role the job does not have (e.g. a critic for GRPO) is in a pool.
    #[error("role {0} is not part of this job; remove it from the plan")]
    UnknownRole(Role),
    /// A pool has no groups.
    #[error("pool {0} has no groups; give it at least one or merge it into another pool")]
    EmptyPool(RoleSet),
    /// A pool has no roles.
    #[error("a pool with groups {0:?} serves no role; give the groups to a pool that does")]
    NoRoles(Vec<GroupId>),
    /// A group is in two pools.
    #[error("group {0} is in more than one pool; a group belongs to one pool")]
    GroupTwice(GroupId),
    /// A group is not in the inventory (its node left).
    #[error("group {0} is not in the inventory (its node may have left); re-plan from the current inventory")]
    NoSuchGroup(GroupId),
    /// A role's memory does not fit a device.
    #[error("{role} in pool {pool} needs {need} per device but devices have {have}: {hint}")]
    DoesNotFit {
        /// The pool.
        pool: RoleSet,
        /// The role that does not fit.
        role: Role,
        /// What it needs per device, formatted.
        need: String,
        /// What a device has, formatted.
        have: String,
        /// How to make it fit.
        hint: String,
    },
    /// Straggler lanes were asked of a plan whose rollout cannot have them.
    #[error("lanes: {0}")]
    Lanes(String),
    /// A lane's batch of the longest responses does not fit its KV cache.
    #[error("lanes: a batch of {batch} responses of up to {context} tokens needs {need} of KV cache per lane but a lane group has {have}; lower the lane batch to at most {fits}")]
    LanesDoNotFit {
        /// The lane batch asked for.
        batch: u32,
        /// The longest context a lane holds (prompt and longest response), tokens.
        context: u32,
        /// KV-cache bytes the batch needs, formatted.
        need: String,
        /// KV-cache bytes a group has after the weights, formatted.
        have: String,
        /// The largest batch that fits.
        fits: u32,
    },
    /// Offloaded state of time-sharing roles does not fit host memory.
    #[error("pool {pool} offloads {need} per device to the host while one role runs, but the host has {have} per device: split the pool so fewer roles share it")]
    HostMemory {
        /// The pool.
        pool: RoleSet,
        /// Offloaded bytes per device, formatted.
        need: String,
        /// Host memory per device, formatted.
        have: String,
    },
}

impl Plan {
    /// Full colocation: every GPU role of `job` on every group.
    pub fn full_colocation(inv: &Inventory, job: &JobShape) -> Plan {
        Plan {
            pools: vec![Pool {
                roles: job.gpu_roles(),
                groups: inv.groups().map(|g| g.id).collect(),
            }],
            rollout_batch_cap: None,
            lanes: None,
        }
    }

    /// The groups kept as straggler lanes: the last `lanes.groups` of the rollout
    /// pool, in id order (none without lanes).
    pub fn lane_groups(&self) -> Vec<GroupId> {
        let (Some(l), Some(p)) = (self.lanes, self.pool_of(Role::Rollout)) else {
            return Vec::new();
        };
        let n = (l.groups as usize).min(p.groups.len());
        p.groups[p.groups.len() - n..].to_vec()
    }

    /// The plan's mode.
    pub fn mode(&self) -> Mode {
        if self.pools.len() == 1 {
            Mode::FullColocation
        } else if self.pools.iter().all(|p| p.roles.len() == 1) {
            Mode::Disaggregated
        } else {
            Mode::PartialColocation
        }
    }

    /// The pool serving `role`.
    pub fn pool_of(&self, role: Role) -> Option<&Pool> {
        self.pools.iter().find(|p| p.roles.contains(role))
    }

    /// The roles each group serves.
    pub fn roles_by_group(&self) -> BTreeMap<GroupId, RoleSet> {
        let mut m = BTreeMap::new();
        for p in &self.pools {
            for g in &p.groups {
                m.insert(*g, p.roles);
            }
        }
        m
    }

    /// The groups that change roles going from `self` to `to` (a group new in `to`
    /// comes from the empty set; one that `to` drops goes to it).
    pub fn moves_to(&self, to: &Plan) -> Vec<Move> {
        let a = self.roles_by_group();
        let b = to.roles_by_group();
        let ids: BTreeSet<GroupId> = a.keys().chain(b.keys()).copied().collect();
        ids.into_iter()
            .filter_map(|g| {
                let from = a.get(&g).copied().unwrap_or_default();
                let to = b.get(&g).copied().unwrap_or_default();
                (from != to).then_some(Move { group: g, from, to })
            })
            .collect()
    }

    /// Group counts per pool, e.g. `rollout:12 reward:4 reference+policy:16`.
    pub fn summary(&self) -> String {
        let mut s = self
            .pools
            .iter()
            .map(|p| format!("{}:{}", p.roles, p.groups.len()))
            .collect::<Vec<_>>()
            .join(" ");
        if let Some(cap) = self.rollout_batch_cap {
            s.push_str(&format!(" (batch ≤{cap})"));
        }
        if let Some(l) = self.lanes {
            s.push_str(&format!(" ({l})"));
        }
        s
    }

    /// Checks that the plan places every role of `job` once, uses each group of `inv`
    /// at most once, and fits device and host memory by the roles' profiles.
    pub fn validate(&self, inv: &Inventory, job: &JobShape) -> Result<(), PlanError> {
        let wanted = job.gpu_roles();
        let mut placed = RoleSet::EMPTY;
        let mut seen = BTreeSet::new();
        for p in &self.pools {
            if p.roles.is_empty() {
                return Err(PlanError::NoRoles(p.groups.clone()));
            }
            for r in p.roles.iter() {
                if !wanted.contains(r) {
                    return Err(PlanError::UnknownRole(r));
                }
                if placed.contains(r) {
                    return Err(PlanError::RoleTwice(r));
                }
                placed.insert(r);
            }
            if p.groups.is_empty() {
                return Err(PlanError::EmptyPool(p.roles));
            }
            let mut mem = f64::INFINITY;
            let mut host = f64::INFINITY;
            let mut devices = 0;
            for g in &p.groups {
                if !seen.insert(*g) {
                    return Err(PlanError::GroupTwice(*g));
                }
                let group = inv.group(*g).ok_or(PlanError::NoSuchGroup(*g))?;
                mem = mem.min(group.device_memory_bytes);
                host = host.min(group.host_memory_per_device);
                devices += group.size();
            }
            check_pool_memory(job, p.roles, inv.group_size(), devices, mem, host)?;
        }
        if let Some(r) = wanted.iter().find(|r| !placed.contains(*r)) {
            return Err(PlanError::Unplaced(r));
        }
        if let Some(l) = self.lanes {
            let pool = self.pool_of(Role::Rollout).expect("every role is placed");
            let mem = pool
                .groups
                .iter()
                .filter_map(|g| inv.group(*g))
                .map(|g| g.device_memory_bytes)
                .fold(f64::INFINITY, f64::min);
            check_lanes(job, l, pool, inv.group_size(), mem)?;
        }
        Ok(())
    }
}

/// Checks straggler lanes `l` against the rollout pool `pool` (groups of
/// `group_devices` devices with `device_mem` bytes each): the rollout must have the
/// pool to itself and keep at least one ordinary group, and a lane must hold `batch`
/// responses of the longest context in its KV cache.
pub fn check_lanes(
    job: &JobShape,
    l: Lanes,
    pool: &Pool,
    group_devices: u32,
    device_mem: f64,
) -> Result<(), PlanError> {
    if l.groups == 0 || l.batch == 0 || l.threshold == 0 {
        return Err(PlanError::Lanes(format!(
            "groups ({}), batch ({}) and threshold ({}) must all be at least 1; leave lanes out for none",
            l.groups, l.batch, l.threshold
        )));
    }
    if pool.roles != RoleSet::of(&[Role::Rollout]) {
        return Err(PlanError::Lanes(format!(
            "the rollout shares pool {} with other roles; lanes need a rollout pool of its own",
            pool.roles
        )));
    }
    if l.groups as usize >= pool.groups.len() {
        return Err(PlanError::Lanes(format!(
            "{} lane(s) in a rollout pool of {} group(s) leave no group for ordinary decoding; use at most {}",
            l.groups,
            pool.groups.len(),
            pool.groups.len().saturating_sub(1)
        )));
    }
    check_lane_memory(job, l.batch, group_devices, device_mem)
}

/// Checks that a lane of `group_devices` devices with `device_mem` bytes each holds
/// `batch` responses of the longest context (prompt and longest response) in its KV
/// cache beside the policy's weights.
pub fn check_lane_memory(
    job: &JobShape,
    batch: u32,
    group_devices: u32,
    device_mem: f64,
) -> Result<(), PlanError> {
    let context = job.prompt_len + job.max_response;
    let per_seq = job.policy.kv_bytes_per_token() * f64::from(context);
    let have = 0.9 * f64::from(group_devices) * device_mem - job.policy.weight_bytes();
    let need = per_seq * f64::from(batch);
    if need > have {
        return Err(PlanError::LanesDoNotFit {
            batch,
            context,
            need: gib(need),
            have: gib(have.max(0.0)),
            fits: (have.max(0.0) / per_seq).floor() as u32,
        });
    }
    Ok(())
}

/// Whether roles sharing a pool must offload and reload to take turns: a decoding
/// role wants every free byte for its KV cache, and other roles take turns only when
/// their states do not fit side by side.
pub fn needs_offload(
    job: &JobShape,
    roles: RoleSet,
    group_devices: u32,
    pool_devices: u32,
    device_mem: f64,
) -> bool {
    if roles.len() < 2 {
        return false;
    }
    if roles.iter().any(|r| job.decodes(r)) {
        return true;
    }
    let total: f64 = roles
        .iter()
        .filter_map(|r| job.memory(r))
        .map(|m| m.per_device(group_devices, pool_devices))
        .sum();
    total > device_mem
}

/// Checks that `roles` fit when they time-share a pool of `pool_devices` devices in
/// groups of `group_devices`, each device with `device_mem` bytes and `host_mem` bytes
/// of host memory. Roles that share a pool take turns: one is loaded, the others are
/// offloaded to the host.
pub fn check_pool_memory(
    job: &JobShape,
    roles: RoleSet,
    group_devices: u32,
    pool_devices: u32,
    device_mem: f64,
    host_mem: f64,
) -> Result<(), PlanError> {
    let mut pinned = 0.0;
    let mut offloaded_total = 0.0;
    let mut offloaded_min = f64::INFINITY;
    let mut largest: f64 = 0.0;
    for r in roles.iter() {
        let Some(m) = job.memory(r) else { continue };
        let need = m.per_device(group_devices, pool_devices);
        if need > device_mem {
            // The fewest devices to split the resident state over so it fits.
            let room = device_mem - m.peak_extra_bytes;
            let min_devices = if room > 0.0 {
                (m.resident_bytes / room).ceil() as u32
            } else {
                u32::MAX
            };
            let hint = match m.sharding {
                Sharding::Pool => format!(
                    "{r}'s state ({}) is sharded over the pool's {pool_devices} device(s); give the pool at least {} group(s) of {group_devices}",
                    gib(m.resident_bytes),
                    min_devices.div_ceil(group_devices.max(1))
                ),
                Sharding::Group => format!(
                    "{r}'s weights ({}) are split over one group's {group_devices} device(s); use groups of at least {min_devices} device(s)",
                    gib(m.resident_bytes)
                ),
            };
            return Err(PlanError::DoesNotFit {
                pool: roles,
                role: r,
                need: gib(need),
                have: gib(device_mem),
                hint,
            });
        }
        if m.offloadable && roles.len() > 1 {
            let res = m.resident_per_device(group_devices, pool_devices);
            offloaded_total += res;
            offloaded_min = offloaded_min.min(res);
            largest = largest.max(need);
        } else {
            pinned += need;
        }
    }
    if pinned + largest > device_mem {
        return Err(PlanError::DoesNotFit {
            pool: roles,
            role: roles.iter().next().unwrap_or(Role::Rollout),
            need: gib(pinned + largest),
            have: gib(device_mem),
            hint: "roles that cannot offload stay resident beside the running one; give them a pool of their own".into(),
        });
    }
    // Worst case: the role with the least state runs and every other one is offloaded.
    if offloaded_total.is_finite() && offloaded_min.is_finite() {
        let host_need = offloaded_total - offloaded_min;
        if host_need > host_mem {
            return Err(PlanError::HostMemory {
                pool: roles,
                need: gib(host_need),
                have: gib(host_mem),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{GpuSpec, ModelSpec, RewardKind};

    pub(crate) fn job(model: &str, genrm: bool) -> JobShape {
        let m = ModelSpec::preset(model).unwrap();
        let reward = if genrm {
            RewardKind::Generative { model: m.clone() }
        } else {
            RewardKind::Rule
        };
        JobShape::new(m, reward, 8192)
    }

    fn inv(gpus: u32, group: u32) -> Inventory {
        let h = GpuSpec::preset("h100").unwrap();
        Inventory::uniform(gpus / 8, 8, group, h.memory_bytes, h.host_memory_bytes).unwrap()
    }

    fn split(inv: &Inventory, parts: &[(&[Role], usize)]) -> Plan {
        let mut ids = inv.groups().map(|g| g.id);
        Plan {
            rollout_batch_cap: None,
            lanes: None,
            pools: parts
                .iter()
                .map(|(roles, n)| Pool {
                    roles: RoleSet::of(roles),
                    groups: ids.by_ref().take(*n).collect(),
                })
                .collect(),
        }
    }

    #[test]
    fn modes() {
        let inv = inv(16, 2);
        let j = job("7b", true);
        let full = Plan::full_colocation(&inv, &j);
        assert_eq!(full.mode(), Mode::FullColocation);
        full.validate(&inv, &j).unwrap();
        let partial = split(
            &inv,
            &[
                (&[Role::Rollout, Role::Reference, Role::Policy], 6),
                (&[Role::Reward], 2),
            ],
        );
        assert_eq!(partial.mode(), Mode::PartialColocation);
        partial.validate(&inv, &j).unwrap();
        let dis = split(
            &inv,
            &[
                (&[Role::Rollout], 3),
                (&[Role::Reward], 1),
                (&[Role::Reference], 1),
                (&[Role::Policy], 3),
            ],
        );
        assert_eq!(dis.mode(), Mode::Disaggregated);
        dis.validate(&inv, &j).unwrap();
        assert_eq!(dis.summary(), "rollout:3 reward:1 reference:1 policy:3");
    }

    #[test]
    fn refuses_a_policy_pool_too_small_with_the_reason() {
        // 70B training state is 1.1 TB: one group of 8 x 80 GB cannot hold it.
        let inv = inv(64, 8);
        let j = job("70b", false);
        let p = split(
            &inv,
            &[(&[Role::Rollout, Role::Reference], 7), (&[Role::Policy], 1)],
        );
        let err = p.validate(&inv, &j).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                PlanError::DoesNotFit {
                    role: Role::Policy,
                    ..
                }
            ),
            "{msg}"
        );
        assert!(
            msg.contains("give the pool at least 2 group(s) of 8"),
            "{msg}"
        );
        let ok = split(
            &inv,
            &[(&[Role::Rollout, Role::Reference], 6), (&[Role::Policy], 2)],
        );
        ok.validate(&inv, &j).unwrap();
    }

    #[test]
    fn refuses_weights_that_need_bigger_groups() {
        let inv = inv(8, 1);
        let j = job("70b", false);
        let err = Plan::full_colocation(&inv, &j)
            .validate(&inv, &j)
            .unwrap_err()
            .to_string();
        assert!(err.contains("use groups of at least"), "{err}");
    }

    #[test]
    fn refuses_structural_mistakes() {
        let inv = inv(16, 2);
        let j = job("7b", false);
        let missing = split(&inv, &[(&[Role::Rollout], 4), (&[Role::Policy], 4)]);
        assert_eq!(
            missing.validate(&inv, &j),
            Err(PlanError::Unplaced(Role::Reference))
        );
        let twice = split(
            &inv,
            &[
                (&[Role::Rollout, Role::Reference], 4),
                (&[Role::Policy, Role::Reference], 4),
            ],
        );
        assert_eq!(
            twice.validate(&inv, &j),
            Err(PlanError::RoleTwice(Role::Reference))
        );
        let unknown = split(
            &inv,
            &[
                (&[Role::Rollout, Role::Reference, Role::Critic], 4),
                (&[Role::Policy], 4),
            ],
        );
        assert_eq!(
            unknown.validate(&inv, &j),
            Err(PlanError::UnknownRole(Role::Critic))
        );
        let mut dup = split(
            &inv,
            &[(&[Role::Rollout, Role::Reference], 4), (&[Role::Policy], 4)],
        );
        dup.pools[1].groups[0] = dup.pools[0].groups[0];
        assert!(matches!(
            dup.validate(&inv, &j),
            Err(PlanError::GroupTwice(_))
        ));
    }

    #[test]
    fn moves_between_plans() {
        let inv = inv(8, 2);
        let a = split(&inv, &[(&[Role::Rollout], 2), (&[Role::Policy], 2)]);
        let b = split(&inv, &[(&[Role::Rollout], 3), (&[Role::Policy], 1)]);
        let m = a.moves_to(&b);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].group, GroupId(2));
        assert_eq!(
            (m[0].from, m[0].to),
            (RoleSet::of(&[Role::Policy]), RoleSet::of(&[Role::Rollout]))
        );
    }

    #[test]
    fn lanes_that_do_not_fit_or_have_no_rollout_of_their_own_are_refused_with_the_reason() {
        let inv = inv(16, 1);
        let j = job("7b", true);
        let mut p = split(
            &inv,
            &[
                (&[Role::Rollout], 6),
                (&[Role::Reward], 4),
                (&[Role::Reference, Role::Policy], 6),
            ],
        );
        p.lanes = Some(Lanes {
            groups: 2,
            batch: 8,
            threshold: 2048,
        });
        p.validate(&inv, &j).unwrap();
        assert_eq!(p.lane_groups(), vec![GroupId(4), GroupId(5)]);
        assert!(p.summary().ends_with("(2 lane(s) ≤8 from 2048 tokens)"));
        // 7B on one H100 keeps about 57 GB for KV cache: 8,704-token contexts at
        // 57 KB a token fit about 114 responses, not 400.
        p.lanes = Some(Lanes {
            groups: 2,
            batch: 400,
            threshold: 2048,
        });
        let err = p.validate(&inv, &j).unwrap_err();
        let msg = err.to_string();
        let PlanError::LanesDoNotFit {
            batch,
            context,
            fits,
            ..
        } = err
        else {
            panic!("{msg}");
        };
        assert_eq!((batch, context), (400, 512 + 8192));
        assert!((100..130).contains(&fits), "{msg}");
        assert!(
            msg.contains(&format!("lower the lane batch to at most {fits}")),
            "{msg}"
        );
        p.lanes = Some(Lanes {
            groups: 2,
            batch: fits,
            threshold: 2048,
        });
        p.validate(&inv, &j).unwrap();
        // Every rollout group a lane: nothing left to decode the rest.
        p.lanes = Some(Lanes {
            groups: 6,
            batch: 4,
            threshold: 2048,
        });
        let msg = p.validate(&inv, &j).unwrap_err().to_string();
        assert!(msg.contains("use at most 5"), "{msg}");
        // A rollout that takes turns with other roles has no lanes.
        let mut shared = split(
            &inv,
            &[
                (&[Role::Rollout, Role::Reward], 10),
                (&[Role::Reference, Role::Policy], 6),
            ],
        );
        shared.lanes = Some(Lanes {
            groups: 1,
            batch: 4,
            threshold: 2048,
        });
        let msg = shared.validate(&inv, &j).unwrap_err().to_string();
        assert!(
            msg.contains("lanes need a rollout pool of its own"),
            "{msg}"
        );
    }
}
