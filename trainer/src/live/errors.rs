//! The live placement's error helpers: each names the group, node or replica and says
//! where to look.

use crate::config::sections::JobConfig;
use crate::error::JobError;

pub(crate) fn me(job: &JobConfig) -> impl Fn(yatt_engine::EngineError) -> JobError + '_ {
    move |e| JobError::Model {
        source_desc: job.model.source.to_string(),
        reason: e.to_string(),
    }
}

pub(crate) fn placement_err(what: String) -> JobError {
    JobError::Placement {
        what,
        fix: "see the nodes' logs; the run stops rather than train on a broken plan".into(),
    }
}
