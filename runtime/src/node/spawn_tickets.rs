//! Remote spawns a caller gave up on. A caller that times out, or whose spawn future is
//! dropped (a sibling of a `try_join!` failed), never learns the actor's id; if the
//! hosting node went on to start it, nothing would ever stop it (a linked one only when
//! its caller leaves the cluster), and it would hold its name and, for a role, its
//! model. Each spawn carries a ticket; a caller that gives up cancels its ticket, and
//! the hosting node undoes the spawn whether it is still running or already done.
//!
//! No I/O: the node's system handler drives this and releases what it answers.

use std::collections::{HashMap, VecDeque};

use crate::addr::ActorId;

/// How many tickets a node remembers. A ticket older than this is forgotten: a cancel
/// for it arriving after that many later spawns finds nothing to undo.
const REMEMBERED: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
enum TicketState {
    Running,
    Done(ActorId),
    Cancelled,
}

/// What a spawn that finished should do with its actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Finished {
    /// Answer the caller with it.
    Keep,
    /// Its caller cancelled meanwhile: release it and answer with an error.
    Undo,
}

/// The spawns of the last [`REMEMBERED`] tickets, by caller and ticket (a caller can
/// only cancel its own: the caller's name comes from its certificate).
#[derive(Debug, Default)]
pub(super) struct SpawnTickets {
    states: HashMap<(String, u64), TicketState>,
    order: VecDeque<(String, u64)>,
}

impl SpawnTickets {
    /// A spawn starts. False when its caller already cancelled it (the cancel overtook
    /// the request): do not start it.
    pub(super) fn begin(&mut self, from: &str, ticket: u64) -> bool {
        let key = (from.to_string(), ticket);
        if self.states.get(&key) == Some(&TicketState::Cancelled) {
            return false;
        }
        self.insert(key, TicketState::Running);
        true
    }

    /// A spawn started `id`.
    pub(super) fn finish(&mut self, from: &str, ticket: u64, id: &ActorId) -> Finished {
        let key = (from.to_string(), ticket);
        match self.states.get_mut(&key) {
            Some(TicketState::Cancelled) => Finished::Undo,
            Some(state) => {
                *state = TicketState::Done(id.clone());
                Finished::Keep
            }
            // Forgotten (many later spawns): nobody can cancel it any more.
            None => Finished::Keep,
        }
    }

    /// The caller gave up on `ticket`: the actor to release, if its spawn is done.
    /// A spawn still running (or not yet begun) is undone when it finishes.
    pub(super) fn cancel(&mut self, from: &str, ticket: u64) -> Option<ActorId> {
        let key = (from.to_string(), ticket);
        match self.states.get_mut(&key) {
            Some(state) => match std::mem::replace(state, TicketState::Cancelled) {
                TicketState::Done(id) => Some(id),
                TicketState::Running | TicketState::Cancelled => None,
            },
            None => {
                self.insert(key, TicketState::Cancelled);
                None
            }
        }
    }

    fn insert(&mut self, key: (String, u64), state: TicketState) {
        if self.states.insert(key.clone(), state).is_none() {
            self.order.push_back(key);
        }
        while self.order.len() > REMEMBERED {
            if let Some(old) = self.order.pop_front() {
                self.states.remove(&old);
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.states.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::addr::ActorName;

    fn id(replica: u32) -> ActorId {
        ActorId {
            name: ActorName::new("host", "role", replica).unwrap(),
            incarnation: 7,
        }
    }

    #[test]
    fn a_spawn_nobody_cancels_is_kept() {
        let mut t = SpawnTickets::default();
        assert!(t.begin("caller", 1));
        assert_eq!(t.finish("caller", 1, &id(0)), Finished::Keep);
    }

    #[test]
    fn a_cancel_during_the_spawn_undoes_it_when_it_finishes() {
        let mut t = SpawnTickets::default();
        assert!(t.begin("caller", 1));
        assert_eq!(t.cancel("caller", 1), None);
        assert_eq!(t.finish("caller", 1, &id(0)), Finished::Undo);
    }

    #[test]
    fn a_cancel_after_the_spawn_releases_its_actor_once() {
        let mut t = SpawnTickets::default();
        assert!(t.begin("caller", 1));
        assert_eq!(t.finish("caller", 1, &id(3)), Finished::Keep);
        assert_eq!(t.cancel("caller", 1), Some(id(3)));
        assert_eq!(t.cancel("caller", 1), None);
    }

    #[test]
    fn a_cancel_that_overtakes_its_request_refuses_the_spawn() {
        let mut t = SpawnTickets::default();
        assert_eq!(t.cancel("caller", 1), None);
        assert!(!t.begin("caller", 1));
    }

    #[test]
    fn a_caller_cannot_cancel_another_callers_spawn() {
        let mut t = SpawnTickets::default();
        assert!(t.begin("caller", 1));
        assert_eq!(t.finish("caller", 1, &id(0)), Finished::Keep);
        assert_eq!(t.cancel("intruder", 1), None);
        assert_eq!(t.cancel("caller", 1), Some(id(0)));
    }

    #[test]
    fn old_tickets_are_forgotten() {
        let mut t = SpawnTickets::default();
        for ticket in 0..(REMEMBERED as u64 + 10) {
            assert!(t.begin("caller", ticket));
        }
        assert_eq!(t.len(), REMEMBERED);
        // The oldest is gone: its spawn, finishing now, is kept.
        assert_eq!(t.finish("caller", 0, &id(0)), Finished::Keep);
        assert_eq!(t.cancel("caller", 0), None);
    }
}
