//! Who leads the directory, whether a join is admitted, and what a heartbeat means: the
//! deterministic core of fail-over. Pure: no I/O, time passed in; the node
//! (`node/failover.rs`) acts on what these functions decide.
//!
//! The rule: the directory's leader leads a *term*. When its members' failure detectors
//! find it silent for the bound, the live member that joined first (smallest join
//! epoch, then name) becomes the leader of the next term, after checking that no member
//! it can reach still hears the old leader. Every replica holds the same join order, so
//! every member picks the same successor without a vote; the directory is soft state
//! (rebuilt from the members' own reports when they follow the new leader), so nothing
//! needs a durable log. Where two leaders meet, the one of the higher term wins (at the
//! same term, the smaller name); the loser follows the winner and, once the winner has
//! declared its incarnation dead, rejoins under a new one. `docs/design.md` argues the
//! rule against a consensus log.

use std::collections::BTreeSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::actor::ExitReason;
use crate::directory::{Directory, Liveness};
use crate::membership::NodeInfo;

/// A leader and the term it leads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lead {
    /// The term: 1 for the founding seed, one more at each fail-over.
    pub term: u64,
    /// The leading node's name.
    pub leader: String,
}

impl Lead {
    /// Whether this lead replaces `other`: a higher term, or the same term led by a
    /// smaller name (two candidates that both took the term; the rule keeps one).
    pub fn supersedes(&self, other: &Lead) -> bool {
        self.term > other.term || (self.term == other.term && self.leader < other.leader)
    }

    /// Whether `node` leads by this lead: the founding seed's or a won term. A joining
    /// node names itself at term 0 only until the join tells it the leader.
    pub fn held_by(&self, node: &str) -> bool {
        self.term > 0 && self.leader == node
    }
}

/// The member that leads after the nodes in `excluded` (the silent leader, and any
/// successor that never took over): the live member that joined first, then by name,
/// among those whose certificate lets them lead.
pub fn successor(dir: &Directory, excluded: &BTreeSet<String>) -> Option<String> {
    dir.nodes()
        .filter(|n| {
            n.liveness == Liveness::Alive
                && n.info.kind.may_lead()
                && !excluded.contains(&n.info.name)
        })
        .min_by(|a, b| (a.joined, &a.info.name).cmp(&(b.joined, &b.info.name)))
        .map(|n| n.info.name.clone())
}

/// The leader's answer to a join.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// A new member, or a new life of a dead or departed one: it joins.
    Admit,
    /// The same life reporting again (it follows a new leader): its entry stays.
    Known,
    /// This incarnation was declared dead: it must rejoin under a new one.
    Dead {
        /// Why it was declared dead.
        reason: String,
    },
    /// The name belongs to a live member (another incarnation, heard from within the
    /// failure bound): refused.
    NameInUse {
        /// The live member's incarnation.
        incarnation: u64,
        /// How long ago the leader last heard from it.
        silent_for: Duration,
    },
}

/// Decides a join of `info`. `silent_for` is how long the leader has not heard from the
/// member now holding the name (`None`: not watched), `bound` the failure bound.
pub fn admit(
    dir: &Directory,
    info: &NodeInfo,
    silent_for: Option<Duration>,
    bound: Duration,
) -> Admission {
    let Some(entry) = dir.node(&info.name) else {
        return Admission::Admit;
    };
    let current = entry.info.incarnation;
    match &entry.liveness {
        Liveness::Alive if current == info.incarnation => Admission::Known,
        Liveness::Dead(reason) if current == info.incarnation => Admission::Dead {
            reason: describe(reason),
        },
        _ if current > info.incarnation => Admission::Dead {
            reason: format!(
                "incarnation {} was replaced by incarnation {current}",
                info.incarnation
            ),
        },
        Liveness::Alive => match silent_for {
            Some(s) if s <= bound => Admission::NameInUse {
                incarnation: current,
                silent_for: s,
            },
            // Silent past the bound: it is as good as declared dead.
            _ => Admission::Admit,
        },
        Liveness::Dead(_) => Admission::Admit,
    }
}

/// Why a node is dead, in words.
pub fn describe(reason: &ExitReason) -> String {
    match reason {
        ExitReason::Normal => "it left the cluster".into(),
        ExitReason::NodeDown(why) => why.clone(),
        other => format!("{other:?}"),
    }
}

/// A heartbeat: who sends it, which life, and whom it follows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Beat {
    /// The sender.
    pub node: String,
    /// The sender's incarnation.
    pub incarnation: u64,
    /// The leader the sender follows (itself, when it leads).
    pub lead: Lead,
}

/// The answer to a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum BeatReply {
    /// Heard.
    Ok,
    /// The sender follows an old lead: this is the current one.
    Follow(Lead),
    /// The leader declared the sender's incarnation dead: rejoin under a new one.
    Dead {
        /// Why.
        reason: String,
    },
}

/// What a heartbeat's receiver does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BeatOutcome {
    /// The answer to send back.
    pub reply: BeatReply,
    /// Whether the sender counts as heard from (it is this node's leader, or a live
    /// member of the term this node leads).
    pub heard: bool,
    /// A newer lead this node should follow.
    pub follow: Option<Lead>,
}

/// Judges `beat` at node `me`, which follows `mine` and holds `dir`.
pub fn judge_beat(me: &str, mine: &Lead, dir: &Directory, beat: &Beat) -> BeatOutcome {
    let outcome = |reply, heard, follow| BeatOutcome {
        reply,
        heard,
        follow,
    };
    if beat.lead.supersedes(mine) {
        let from_leader = beat.lead.leader == beat.node;
        return outcome(BeatReply::Ok, from_leader, Some(beat.lead.clone()));
    }
    if *mine != beat.lead {
        return outcome(BeatReply::Follow(mine.clone()), false, None);
    }
    if mine.leader != me {
        // A follower hears only from its leader.
        return outcome(BeatReply::Ok, beat.node == mine.leader, None);
    }
    match dir.node(&beat.node) {
        Some(e) if e.info.incarnation == beat.incarnation && e.liveness == Liveness::Alive => {
            outcome(BeatReply::Ok, true, None)
        }
        Some(e) if e.info.incarnation == beat.incarnation => {
            let reason = match &e.liveness {
                Liveness::Dead(r) => describe(r),
                Liveness::Alive => String::new(),
            };
            outcome(BeatReply::Dead { reason }, false, None)
        }
        Some(e) => outcome(
            BeatReply::Dead {
                reason: format!(
                    "incarnation {} is not the member's current one ({})",
                    beat.incarnation, e.info.incarnation
                ),
            },
            false,
            None,
        ),
        None => outcome(
            BeatReply::Dead {
                reason: "not a member of the directory".into(),
            },
            false,
            None,
        ),
    }
}

/// What a member does about its leader's silence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Nothing (yet).
    Wait,
    /// This node is next in line: lead the next term, deposing `depose` (after
    /// checking that no member still hears it, unless `announced`).
    TakeOver {
        /// The silent (or departed) leader.
        depose: String,
        /// The leader announced its own departure (graceful leave): no check needed.
        announced: bool,
    },
    /// Another member is next in line: wait for it to announce the new term.
    Await(String),
}

/// A member's view of a succession in progress: whom it found silent, and until when
/// it waits for the next in line before passing over it too.
#[derive(Debug, Clone, Default)]
pub struct Succession {
    /// The silent leader this succession replaces.
    deposed: Option<String>,
    /// Whether that leader announced its own departure.
    announced: bool,
    /// Passed over: the silent leader and successors that never took over.
    passed: BTreeSet<String>,
    /// The awaited successor and the deadline for its announcement.
    awaiting: Option<(String, Instant)>,
}

impl Succession {
    /// Whether a succession is in progress.
    pub fn in_progress(&self) -> bool {
        self.deposed.is_some()
    }

    /// The successor this member waits for, if any.
    pub fn awaiting(&self) -> Option<&str> {
        self.awaiting.as_ref().map(|(n, _)| n.as_str())
    }

    /// The leader `leader` fell silent (or `announced` its departure) at `now`. `patience`
    /// is how long to wait for the successor's announcement before passing over it
    /// (it needs up to the failure bound to notice the silence itself).
    pub fn leader_lost(
        &mut self,
        dir: &Directory,
        me: &str,
        leader: &str,
        announced: bool,
        now: Instant,
        patience: Duration,
    ) -> Step {
        if self.deposed.as_deref() != Some(leader) {
            *self = Succession {
                deposed: Some(leader.to_string()),
                announced,
                passed: BTreeSet::from([leader.to_string()]),
                awaiting: None,
            };
        }
        self.next(dir, me, now, patience)
    }

    /// Called on a timer: when the awaited successor missed its deadline, passes over it.
    pub fn tick(&mut self, dir: &Directory, me: &str, now: Instant, patience: Duration) -> Step {
        match &self.awaiting {
            Some((late, deadline)) if now >= *deadline => {
                self.passed.insert(late.clone());
                self.next(dir, me, now, patience)
            }
            _ => Step::Wait,
        }
    }

    /// A leader was followed (or this node took over): the succession is over.
    pub fn settle(&mut self) {
        *self = Succession::default();
    }

    fn next(&mut self, dir: &Directory, me: &str, now: Instant, patience: Duration) -> Step {
        let Some(deposed) = self.deposed.clone() else {
            return Step::Wait;
        };
        // This node is always a candidate for itself, whatever its replica says.
        let next = successor(dir, &self.passed).unwrap_or_else(|| me.to_string());
        if next == me {
            self.awaiting = None;
            return Step::TakeOver {
                depose: deposed,
                announced: self.announced,
            };
        }
        self.awaiting = Some((next.clone(), now + patience));
        Step::Await(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::directory::Change;

    fn node(name: &str, incarnation: u64) -> NodeInfo {
        NodeInfo::for_tests(name, incarnation)
    }

    /// A directory whose members joined in the given order, all alive.
    fn joined(names: &[&str]) -> Directory {
        let mut d = Directory::default();
        d.begin_term(1);
        for n in names {
            d.apply(Change::NodeUp(node(n, 1))).unwrap();
        }
        d
    }

    fn down(d: &mut Directory, name: &str) {
        d.apply(Change::NodeDown {
            node: name.into(),
            reason: ExitReason::NodeDown("silent".into()),
        })
        .unwrap();
    }

    fn lead(term: u64, leader: &str) -> Lead {
        Lead {
            term,
            leader: leader.into(),
        }
    }

    /// Regression: every node that joined a cluster logged "a newer term leads the
    /// directory: stepping down" (a warning) when it learnt the leader, because it took
    /// its placeholder for a lead it had held.
    #[test]
    fn a_joining_nodes_placeholder_is_not_a_lead_it_held() {
        assert!(!lead(0, "joiner").held_by("joiner"));
        assert!(lead(1, "seed").held_by("seed"));
        assert!(!lead(1, "seed").held_by("joiner"));
        assert!(lead(2, "joiner").held_by("joiner"));
    }

    #[test]
    fn successor_is_the_oldest_live_member() {
        // Join order, not name order: "z" joined before "b".
        let mut d = joined(&["seed", "z", "b", "client"]);
        let mut out = BTreeSet::from(["seed".to_string()]);
        assert_eq!(successor(&d, &out).as_deref(), Some("z"));
        out.insert("z".into());
        assert_eq!(successor(&d, &out).as_deref(), Some("b"));
        down(&mut d, "b");
        assert_eq!(successor(&d, &out).as_deref(), Some("client"));
        // A node that rejoins under a new incarnation goes to the back.
        d.apply(Change::NodeUp(node("z", 2))).unwrap();
        out.remove("z");
        assert_eq!(successor(&d, &out).as_deref(), Some("client"));
    }

    #[test]
    fn a_trainer_never_succeeds_even_when_it_joined_first() {
        let mut d = joined(&["seed"]);
        let mut trainer = node("train", 1);
        trainer.kind = crate::cert_kind::CertKind::Trainer;
        d.apply(Change::NodeUp(trainer)).unwrap();
        d.apply(Change::NodeUp(node("b", 1))).unwrap();
        let out = BTreeSet::from(["seed".to_string()]);
        assert_eq!(successor(&d, &out).as_deref(), Some("b"));
        down(&mut d, "b");
        assert_eq!(successor(&d, &out), None, "only a trainer is left");
    }

    #[test]
    fn leads_order_by_term_then_name() {
        assert!(lead(3, "z").supersedes(&lead(2, "a")));
        assert!(!lead(2, "a").supersedes(&lead(3, "z")));
        assert!(lead(2, "a").supersedes(&lead(2, "b")));
        assert!(!lead(2, "b").supersedes(&lead(2, "b")), "irreflexive");
    }

    #[test]
    fn joins_are_admitted_unless_the_name_is_live() {
        let bound = Duration::from_secs(2);
        let mut d = joined(&["a", "b"]);
        let ms = Duration::from_millis;
        assert_eq!(admit(&d, &node("c", 7), None, bound), Admission::Admit);
        assert_eq!(
            admit(&d, &node("b", 1), Some(ms(10)), bound),
            Admission::Known
        );
        // Another life of b while b is heard from: refused, whatever its incarnation.
        assert_eq!(
            admit(&d, &node("b", 9), Some(ms(300)), bound),
            Admission::NameInUse {
                incarnation: 1,
                silent_for: ms(300)
            }
        );
        // b went silent past the bound (about to be declared dead): the new life joins.
        assert_eq!(
            admit(&d, &node("b", 9), Some(ms(2001)), bound),
            Admission::Admit
        );
        down(&mut d, "b");
        assert_eq!(
            admit(&d, &node("b", 9), Some(ms(1)), bound),
            Admission::Admit
        );
        assert!(matches!(
            admit(&d, &node("b", 1), Some(ms(1)), bound),
            Admission::Dead { reason } if reason.contains("silent")
        ));
        d.apply(Change::NodeUp(node("b", 9))).unwrap();
        assert!(matches!(
            admit(&d, &node("b", 1), None, bound),
            Admission::Dead { reason } if reason.contains("replaced by incarnation 9")
        ));
    }

    #[test]
    fn heartbeats_are_judged_by_term_and_incarnation() {
        let mut d = joined(&["a", "b", "c"]);
        let beat = |node: &str, inc, l: Lead| Beat {
            node: node.into(),
            incarnation: inc,
            lead: l,
        };
        // The leader hears its live members.
        let o = judge_beat("a", &lead(1, "a"), &d, &beat("b", 1, lead(1, "a")));
        assert_eq!((o.reply, o.heard, o.follow), (BeatReply::Ok, true, None));
        // A member declared dead (it stalled past the bound) is told so.
        down(&mut d, "c");
        let o = judge_beat("a", &lead(1, "a"), &d, &beat("c", 1, lead(1, "a")));
        assert!(matches!(o.reply, BeatReply::Dead { reason } if reason.contains("silent")));
        assert!(!o.heard);
        let o = judge_beat("a", &lead(1, "a"), &d, &beat("x", 1, lead(1, "a")));
        assert!(matches!(o.reply, BeatReply::Dead { .. }));
        // A deposed leader that wakes up is told who leads now.
        let o = judge_beat("b", &lead(2, "b"), &d, &beat("a", 1, lead(1, "a")));
        assert_eq!(o.reply, BeatReply::Follow(lead(2, "b")));
        // A follower learns of a new term from the new leader's heartbeat.
        let o = judge_beat("c", &lead(1, "a"), &d, &beat("b", 1, lead(2, "b")));
        assert_eq!((o.heard, o.follow), (true, Some(lead(2, "b"))));
        // A follower hears its leader, not other followers.
        assert!(judge_beat("c", &lead(2, "b"), &d, &beat("b", 1, lead(2, "b"))).heard);
        assert!(!judge_beat("c", &lead(2, "b"), &d, &beat("d", 1, lead(2, "b"))).heard);
    }

    #[test]
    fn succession_takes_over_or_waits_then_passes_over() {
        let t0 = Instant::now();
        let patience = Duration::from_secs(4);
        let d = joined(&["a", "b", "c"]);
        // b is next after a.
        let mut s = Succession::default();
        assert_eq!(
            s.leader_lost(&d, "b", "a", false, t0, patience),
            Step::TakeOver {
                depose: "a".into(),
                announced: false
            }
        );
        // c waits for b, then passes over it when b never announces.
        let mut s = Succession::default();
        assert_eq!(
            s.leader_lost(&d, "c", "a", false, t0, patience),
            Step::Await("b".into())
        );
        assert_eq!(s.awaiting(), Some("b"));
        assert_eq!(
            s.tick(&d, "c", t0 + Duration::from_secs(3), patience),
            Step::Wait
        );
        assert_eq!(
            s.tick(&d, "c", t0 + patience, patience),
            Step::TakeOver {
                depose: "a".into(),
                announced: false
            }
        );
        // Losing the same leader again keeps what was learned; settling forgets it.
        assert!(matches!(
            s.leader_lost(&d, "c", "a", false, t0 + patience, patience),
            Step::TakeOver { .. }
        ));
        s.settle();
        assert!(!s.in_progress());
        assert_eq!(s.tick(&d, "c", t0 + patience * 2, patience), Step::Wait);
        // A graceful leave is announced: no check of the others needed.
        let mut s = Succession::default();
        assert_eq!(
            s.leader_lost(&d, "b", "a", true, t0, patience),
            Step::TakeOver {
                depose: "a".into(),
                announced: true
            }
        );
    }
}
