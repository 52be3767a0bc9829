//! Small checks of config values that give `JobError::Invalid` with the key, what is
//! accepted, what was found and the fix.

use crate::config::modes::RewardKind;
use crate::error::JobError;

pub(crate) fn invalid(key: &str, expected: &str, found: &str, fix: &str) -> JobError {
    JobError::Invalid {
        key: key.into(),
        expected: expected.into(),
        found: found.into(),
        fix: fix.into(),
    }
}

pub(crate) fn positive(key: &str, v: f64, fix: &str) -> Result<(), JobError> {
    if v > 0.0 && v.is_finite() {
        Ok(())
    } else {
        Err(invalid(key, "a positive number", &v.to_string(), fix))
    }
}

pub(crate) fn non_negative(key: &str, v: f64) -> Result<(), JobError> {
    if v >= 0.0 && v.is_finite() {
        Ok(())
    } else {
        Err(invalid(
            key,
            "a number ≥ 0",
            &v.to_string(),
            "use 0 to turn it off",
        ))
    }
}

/// A reward key that only `kind` reads must be empty unless `reward.kind` includes it.
pub(crate) fn only_with_kind(
    used: bool,
    kind: RewardKind,
    key: &str,
    value: &str,
) -> Result<(), JobError> {
    if used || value.is_empty() {
        return Ok(());
    }
    Err(invalid(
        key,
        &format!("empty unless reward.kind includes \"{kind}\""),
        value,
        &format!(
            "add \"{kind}\" to reward.kind (with a weight in reward.weights), or remove {key}"
        ),
    ))
}
