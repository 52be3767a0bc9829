//! Errors. `Unavailable` is what the caller logs before it falls back to QUIC;
//! `CollectiveError` names the operation, the ranks and the deadline so a stuck job
//! says who it was waiting for.

use std::time::Duration;

/// NCCL (or the CUDA driver, or a GPU) cannot be used in this process.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("NCCL unavailable: {reason}")]
pub struct Unavailable {
    /// Why, with the places that were searched.
    pub reason: String,
}

impl Unavailable {
    pub(crate) fn new(reason: impl Into<String>) -> Self {
        Unavailable {
            reason: reason.into(),
        }
    }
}

/// A collective operation (or communicator set-up) failed.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error(transparent)]
    Unavailable(#[from] Unavailable),
    /// The operation did not finish in time; the communicator was aborted.
    #[error(
        "NCCL {op} on rank {rank} of {nranks} missed its deadline of {deadline:?} \
         waiting for peer ranks {peers}; the communicator was aborted"
    )]
    Deadline {
        op: &'static str,
        rank: usize,
        nranks: usize,
        peers: String,
        deadline: Duration,
    },
    /// NCCL reported an error.
    #[error("NCCL {op} failed on rank {rank} of {nranks} (peers {peers}): {message}")]
    Nccl {
        op: &'static str,
        rank: usize,
        nranks: usize,
        peers: String,
        message: String,
    },
    /// A CUDA driver call failed (bad pointer, bad stream, device error).
    #[error("CUDA error during NCCL {op} on rank {rank} of {nranks}: {message}")]
    Cuda {
        op: &'static str,
        rank: usize,
        nranks: usize,
        message: String,
    },
    /// An earlier failure aborted this communicator; build a new one.
    #[error(
        "NCCL {op} on rank {rank} of {nranks}: the communicator was aborted after an \
         earlier failure ({cause}); create a new one"
    )]
    Dead {
        op: &'static str,
        rank: usize,
        nranks: usize,
        cause: String,
    },
    #[error("NCCL {op}: invalid argument: {message}")]
    InvalidArgument { op: &'static str, message: String },
}

/// The peers of `rank`, written for an error message (short for large groups).
pub(crate) fn peers_of(rank: usize, nranks: usize) -> String {
    let peers: Vec<String> = (0..nranks)
        .filter(|&r| r != rank)
        .map(|r| r.to_string())
        .collect();
    if peers.is_empty() {
        "none".to_string()
    } else if peers.len() <= 16 {
        format!("[{}]", peers.join(", "))
    } else {
        format!("0..{nranks} except {rank}")
    }
}

/// A backend failure before the communicator adds the operation and ranks.
#[derive(Debug)]
#[cfg_attr(not(feature = "nccl"), allow(dead_code))] // the stub only reports Unavailable
pub(crate) enum Failure {
    Unavailable(Unavailable),
    Nccl(String),
    Cuda(String),
}

impl From<Unavailable> for Failure {
    fn from(u: Unavailable) -> Self {
        Failure::Unavailable(u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_are_listed_without_self() {
        assert_eq!(peers_of(0, 2), "[1]");
        assert_eq!(peers_of(1, 3), "[0, 2]");
        assert_eq!(peers_of(0, 1), "none");
        assert_eq!(peers_of(5, 64), "0..64 except 5");
    }

    #[test]
    fn deadline_error_names_op_ranks_and_deadline() {
        let e = CollectiveError::Deadline {
            op: "init",
            rank: 0,
            nranks: 2,
            peers: peers_of(0, 2),
            deadline: Duration::from_secs(3),
        };
        let s = e.to_string();
        assert!(
            s.contains("init")
                && s.contains("rank 0 of 2")
                && s.contains("[1]")
                && s.contains("3s"),
            "{s}"
        );
    }
}
