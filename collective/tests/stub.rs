//! Without the `nccl` feature every constructor says so instead of failing later.
#![cfg(not(feature = "nccl"))]

use std::time::Duration;
use yatt_collective::{availability, locate_nccl, CollectiveError, Communicator, UniqueId};

#[test]
fn everything_is_unavailable_without_the_feature() {
    let reason = "built without the nccl feature";
    assert_eq!(availability().unwrap_err().reason, reason);
    assert_eq!(locate_nccl().unwrap_err().reason, reason);
    match UniqueId::new() {
        Err(CollectiveError::Unavailable(u)) => assert_eq!(u.reason, reason),
        other => panic!("{other:?}"),
    }
    let id = UniqueId::from_bytes([7; 128]);
    match Communicator::init(0, 2, &id, 0, Duration::from_secs(1)) {
        Err(CollectiveError::Unavailable(u)) => assert_eq!(u.reason, reason),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        Communicator::init(2, 2, &id, 0, Duration::ZERO),
        Err(CollectiveError::InvalidArgument { .. })
    ));
}
