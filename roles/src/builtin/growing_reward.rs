//! The reward role of the synthetic `growing` task, whose target response length grows
//! over the run (the live-placement tests and benchmarks use it to shift load).

use crate::data::synthetic::GrowingLength;
use crate::role::{DeviceGroup, ResourceProfile, Role, RoleError};
use crate::sample::Sample;

/// The `growing` task's reward role: pays for a response of the step's target length
/// (the step comes from each sample's id).
pub struct GrowingLengthReward(pub GrowingLength);

impl Role for GrowingLengthReward {
    type Request = Vec<Sample>;
    type Response = Vec<Sample>;

    fn name(&self) -> &str {
        "reward"
    }

    fn profile(&self) -> ResourceProfile {
        ResourceProfile::cpu_only()
    }

    fn start(&mut self, _group: &DeviceGroup) -> Result<(), RoleError> {
        Ok(())
    }

    fn serve(&mut self, mut samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        for s in &mut samples {
            s.reward = Some(self.0.score(s.id.step, s.response_len()));
        }
        Ok(samples)
    }
}
