//! A run log's memory in the roles a snapshot's blocks are told by, so that
//! a run log and a snapshot compare role by role.

use crate::record::Components;
use crate::report::Analysis;
use oomkit_advice::RoleBytes;

impl Components {
    /// The tracker's components as roles: parameters and buffers as
    /// parameters, gradients, optimizer state, and an EMA copy on the
    /// device as other (it is neither the model's weights nor its state).
    pub fn roles(&self) -> RoleBytes {
        let ema_on_device = self
            .ema_device
            .as_deref()
            .is_some_and(|d| d.starts_with("cuda"));
        RoleBytes {
            parameters: self.params_bytes + self.buffers_bytes,
            gradients: self.grads_bytes,
            optimizer_state: self.optimizer_state_bytes,
            other: if ema_on_device { self.ema_bytes } else { 0 },
            ..Default::default()
        }
    }
}

impl Analysis {
    /// The largest step peak by role, as far as the tracker tells: the
    /// latest components, and the rest of the peak as unknown (the tracker
    /// does not tell activations from temporaries or inputs). `None`
    /// without a component count.
    pub fn roles_at_peak(&self) -> Option<RoleBytes> {
        let mut r = self.components.as_ref()?.roles();
        // Counted after a step, the components can exceed a peak measured
        // before them; the roles then keep the components and no unknown.
        r.unknown = self.peak_bytes.unwrap_or(0).saturating_sub(r.total());
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn components_map_onto_roles() {
        let c = Components {
            params_bytes: 100,
            buffers_bytes: 5,
            grads_bytes: 100,
            optimizer_state_bytes: 200,
            ema_bytes: 100,
            ema_device: Some("cuda:0".into()),
            ..Default::default()
        };
        let r = c.roles();
        assert_eq!(
            (r.parameters, r.gradients, r.optimizer_state, r.other),
            (105, 100, 200, 100)
        );
        let on_cpu = Components {
            ema_device: Some("cpu".into()),
            ..c
        };
        assert_eq!(on_cpu.roles().other, 0);
    }
}
