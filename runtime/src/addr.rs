//! Actor addressing: `node/role/replica` names plus incarnations.
//!
//! A name says *where and what* an actor is; the incarnation says *which life* of that
//! name. When an actor dies and is replaced, its successor gets a new incarnation, so a
//! message addressed to the old one is refused instead of reaching the successor.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// Errors from parsing or validating names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddrError {
    /// The text did not have the three `/`-separated parts `node/role/replica`.
    #[error("actor name {0:?} is not of the form node/role/replica (e.g. \"gpu-0/rollout/1\")")]
    Shape(String),
    /// A node or role segment was empty or had a character outside `[A-Za-z0-9_.-]`.
    #[error("{what} {value:?} is invalid: use 1 to 63 characters from A-Z a-z 0-9 _ . -")]
    Segment {
        /// Which segment was wrong (`node` or `role`).
        what: &'static str,
        /// The offending value.
        value: String,
    },
    /// The replica part was not a non-negative integer.
    #[error("replica {0:?} is not a non-negative integer")]
    Replica(String),
    /// The incarnation after `#` was not a positive integer.
    #[error("incarnation {0:?} is not a positive integer")]
    Incarnation(String),
}

/// Checks a node or role name: 1–63 characters of `[A-Za-z0-9_.-]`.
pub fn validate_segment(what: &'static str, value: &str) -> Result<(), AddrError> {
    let ok = !value.is_empty()
        && value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(AddrError::Segment {
            what,
            value: value.to_string(),
        })
    }
}

/// Where and what an actor is: `node/role/replica`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ActorName {
    /// The node that hosts the actor.
    pub node: String,
    /// The role (group) the actor serves, e.g. `rollout`.
    pub role: String,
    /// The replica index within the role on that node.
    pub replica: u32,
}

impl ActorName {
    /// A validated name.
    pub fn new(node: &str, role: &str, replica: u32) -> Result<Self, AddrError> {
        validate_segment("node", node)?;
        validate_segment("role", role)?;
        Ok(ActorName {
            node: node.to_string(),
            role: role.to_string(),
            replica,
        })
    }
}

impl fmt::Display for ActorName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.node, self.role, self.replica)
    }
}

impl FromStr for ActorName {
    type Err = AddrError;
    fn from_str(s: &str) -> Result<Self, AddrError> {
        let mut parts = s.split('/');
        let (Some(node), Some(role), Some(replica), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(AddrError::Shape(s.to_string()));
        };
        let replica = replica
            .parse::<u32>()
            .map_err(|_| AddrError::Replica(replica.to_string()))?;
        ActorName::new(node, role, replica)
    }
}

/// One life of an actor: its name plus an incarnation number unique on its node.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ActorId {
    /// The actor's name.
    pub name: ActorName,
    /// Which life of that name; strictly increasing on a node, also across restarts.
    pub incarnation: u64,
}

impl fmt::Display for ActorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.name, self.incarnation)
    }
}

impl FromStr for ActorId {
    type Err = AddrError;
    fn from_str(s: &str) -> Result<Self, AddrError> {
        let (name, inc) = s
            .split_once('#')
            .ok_or_else(|| AddrError::Shape(s.to_string()))?;
        let incarnation = inc
            .parse::<u64>()
            .ok()
            .filter(|i| *i > 0)
            .ok_or_else(|| AddrError::Incarnation(inc.to_string()))?;
        Ok(ActorId {
            name: name.parse()?,
            incarnation,
        })
    }
}

/// A fresh incarnation number for this process.
///
/// Seeded from the wall clock in microseconds at first use and then incremented, so a
/// node that restarts hands out larger numbers than its previous life did (unless the
/// clock went back by more than the number of spawns in between).
pub fn next_incarnation() -> u64 {
    static NEXT: OnceLock<AtomicU64> = OnceLock::new();
    NEXT.get_or_init(|| {
        let micros = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(1);
        AtomicU64::new(micros.max(1))
    })
    .fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_round_trip() {
        let n: ActorName = "gpu-0/rollout/3".parse().unwrap();
        assert_eq!(n, ActorName::new("gpu-0", "rollout", 3).unwrap());
        assert_eq!(n.to_string(), "gpu-0/rollout/3");
        let id = ActorId {
            name: n,
            incarnation: 42,
        };
        assert_eq!(id.to_string().parse::<ActorId>().unwrap(), id);
    }

    #[test]
    fn bad_names_name_the_problem() {
        assert!(matches!(
            "a/b".parse::<ActorName>(),
            Err(AddrError::Shape(_))
        ));
        assert!(matches!(
            "a/b/c/d".parse::<ActorName>(),
            Err(AddrError::Shape(_))
        ));
        assert!(matches!(
            "a/b/x".parse::<ActorName>(),
            Err(AddrError::Replica(_))
        ));
        assert!(matches!(
            "a b/r/0".parse::<ActorName>(),
            Err(AddrError::Segment { what: "node", .. })
        ));
        assert!(matches!(
            "n//0".parse::<ActorName>(),
            Err(AddrError::Segment { what: "role", .. })
        ));
        assert!(matches!(
            "n/r/0#0".parse::<ActorId>(),
            Err(AddrError::Incarnation(_))
        ));
        assert!(matches!(
            "n/r/0".parse::<ActorId>(),
            Err(AddrError::Shape(_))
        ));
        let long = "x".repeat(64);
        assert!(ActorName::new(&long, "r", 0).is_err());
    }

    #[test]
    fn incarnations_increase() {
        let a = next_incarnation();
        let b = next_incarnation();
        assert!(b > a && a > 0);
    }
}
