//! A receiver's side of weight sync from a sharded policy: each rank sends its own
//! slice ([`WeightSlice`]), and the weights are written only once every rank's slice of
//! a version has come, so a sync that fails part-way leaves the model on the version it
//! had, never a mix of two. At most one version's slices are held: a newer version's
//! first slice drops an older version's incomplete set (its sync failed).

use tch::{Device, Tensor};

use super::scoring::{bucket_tensors, weights_error};
use crate::role::{RoleError, WeightSlice, WeightsUpdate};

/// The slices of one version received so far.
#[derive(Default)]
pub(crate) struct SliceAssembly {
    pending: Option<Pending>,
}

struct Pending {
    version: u64,
    world: u32,
    got: Vec<Option<WeightsUpdate>>,
}

impl SliceAssembly {
    /// Takes `update`, one rank's slice; answers every rank's slice of its version, in
    /// rank order, once the last has come.
    pub(crate) fn offer(
        &mut self,
        update: WeightsUpdate,
        slice: WeightSlice,
    ) -> Result<Option<Vec<WeightsUpdate>>, RoleError> {
        let WeightSlice { rank, world } = slice;
        if world == 0 || rank >= world {
            return Err(RoleError::BadRequest(format!(
                "weights v{}: a slice of rank {rank} of {world} ranks; the rank must be below the rank count",
                update.version
            )));
        }
        let p = match &mut self.pending {
            Some(p) if p.version == update.version && p.world == world => p,
            Some(p) if p.version > update.version => {
                return Err(RoleError::BadRequest(format!(
                    "weights v{}: a slice older than the v{} being assembled",
                    update.version, p.version
                )))
            }
            // A newer version, or the same one over another rank count (a replica
            // resharded after a failed sync): what was held is moot.
            _ => self.pending.insert(Pending {
                version: update.version,
                world,
                got: (0..world).map(|_| None).collect(),
            }),
        };
        // A rank's slice sent again (a retried push) replaces the first.
        p.got[rank as usize] = Some(update);
        if p.got.iter().any(Option::is_none) {
            return Ok(None);
        }
        let done = self.pending.take().expect("pending");
        Ok(Some(done.got.into_iter().flatten().collect()))
    }
}

/// Writes a version's every slice ([`SliceAssembly::offer`]'s answer) with `write`
/// (given the rank count and each slice tensor with its rank), read in place from the
/// buckets for a model on `device`.
pub(crate) fn write_slices(
    all: &[WeightsUpdate],
    device: Device,
    write: impl for<'a> FnOnce(
        usize,
        Vec<(usize, &'a str, &'a Tensor)>,
    ) -> Result<usize, yatt_engine::EngineError>,
) -> Result<(), RoleError> {
    let Some(first) = all.first() else {
        return Ok(());
    };
    let world = first.slice.map_or(1, |s| s.world as usize);
    let views = all
        .iter()
        .map(|u| {
            Ok((
                u.slice.map_or(0, |s| s.rank as usize),
                bucket_tensors(u, device)?,
            ))
        })
        .collect::<Result<Vec<_>, RoleError>>()?;
    let named = views
        .iter()
        .flat_map(|(rank, v)| v.iter().map(move |(n, t)| (*rank, n, t)))
        .collect();
    write(world, named).map_err(|e| weights_error(first, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    fn slice(version: u64, rank: u32, world: u32) -> (WeightsUpdate, WeightSlice) {
        let s = WeightSlice { rank, world };
        let u = WeightsUpdate {
            slice: Some(s),
            ..WeightsUpdate::from_buckets(version, Vec::new())
        };
        (u, s)
    }

    fn offer(a: &mut SliceAssembly, version: u64, rank: u32, world: u32) -> Option<Vec<u32>> {
        let (u, s) = slice(version, rank, world);
        a.offer(u, s)
            .unwrap()
            .map(|v| v.iter().map(|u| u.slice.unwrap().rank).collect())
    }

    #[test]
    fn a_version_is_complete_only_with_every_ranks_slice() {
        let mut a = SliceAssembly::default();
        assert_eq!(offer(&mut a, 3, 2, 3), None);
        assert_eq!(offer(&mut a, 3, 0, 3), None);
        assert_eq!(
            offer(&mut a, 3, 0, 3),
            None,
            "a slice sent twice counts once"
        );
        assert_eq!(offer(&mut a, 3, 1, 3), Some(vec![0, 1, 2]));
        // A newer version drops an incomplete older one.
        assert_eq!(offer(&mut a, 4, 0, 3), None);
        assert_eq!(offer(&mut a, 5, 1, 2), None);
        assert_eq!(offer(&mut a, 5, 0, 2), Some(vec![0, 1]));
        assert_eq!(offer(&mut a, 1, 0, 1), Some(vec![0]));
    }

    #[test]
    fn stale_and_impossible_slices_are_refused() {
        let mut a = SliceAssembly::default();
        assert_eq!(offer(&mut a, 7, 0, 2), None);
        let (u, s) = slice(6, 1, 2);
        let e = a.offer(u, s).unwrap_err().to_string();
        assert!(e.contains("older than the v7"), "{e}");
        let (u, s) = slice(7, 2, 2);
        let e = a.offer(u, s).unwrap_err().to_string();
        assert!(e.contains("below the rank count"), "{e}");
        // v7's held slice is still there.
        assert_eq!(offer(&mut a, 7, 1, 2), Some(vec![0, 1]));
    }
}
