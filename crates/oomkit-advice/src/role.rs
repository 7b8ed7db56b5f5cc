//! What memory is for, in the user's terms: the roles a snapshot's blocks
//! and a run log's components are told apart by, and how each was known.

use serde::Serialize;

/// What a block of GPU memory holds, in the terms a fix is chosen by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The model's weights.
    Parameters,
    /// The gradients of the trainable weights.
    Gradients,
    /// The optimizer's state (Adam's two moments, momentum buffers).
    OptimizerState,
    /// Tensors made in forward and kept for backward.
    Activations,
    /// Tensors freed within the stage that made them.
    Temporaries,
    /// The batch and the data loader's copies of it.
    Inputs,
    /// Allocator and library buffers: cuBLAS workspaces, NCCL, DDP's buckets, CUDA-graph pools.
    Other,
    /// What the evidence cannot tell.
    Unknown,
}

impl Role {
    /// Every role, in the order reports list them.
    pub const ALL: [Role; 8] = [
        Role::Parameters,
        Role::Gradients,
        Role::OptimizerState,
        Role::Activations,
        Role::Temporaries,
        Role::Inputs,
        Role::Other,
        Role::Unknown,
    ];

    /// The role in words, as the terminal report writes it.
    pub fn words(self) -> &'static str {
        match self {
            Role::Parameters => "parameters",
            Role::Gradients => "gradients",
            Role::OptimizerState => "optimizer state",
            Role::Activations => "activations",
            Role::Temporaries => "temporaries",
            Role::Inputs => "inputs",
            Role::Other => "other",
            Role::Unknown => "unknown",
        }
    }

    /// The role's name in JSON (its serde name: `optimizer_state`).
    pub fn key(self) -> &'static str {
        match self {
            Role::OptimizerState => "optimizer_state",
            other => other.words(),
        }
    }
}

/// How a block's role was told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Evidence {
    /// The frames that allocated it name what it is.
    Frames,
    /// When it was made and freed, against forward and backward.
    Lifetimes,
    /// Its size matches the gradients' (it was allocated before recording).
    Sizes,
}

/// One value per role, the shape of every role object oomkit writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PerRole<T> {
    /// For [`Role::Parameters`].
    pub parameters: T,
    /// For [`Role::Gradients`].
    pub gradients: T,
    /// For [`Role::OptimizerState`].
    pub optimizer_state: T,
    /// For [`Role::Activations`].
    pub activations: T,
    /// For [`Role::Temporaries`].
    pub temporaries: T,
    /// For [`Role::Inputs`].
    pub inputs: T,
    /// For [`Role::Other`].
    pub other: T,
    /// For [`Role::Unknown`].
    pub unknown: T,
}

impl<T> PerRole<T> {
    /// The value for `role`.
    pub fn get(&self, role: Role) -> &T {
        match role {
            Role::Parameters => &self.parameters,
            Role::Gradients => &self.gradients,
            Role::OptimizerState => &self.optimizer_state,
            Role::Activations => &self.activations,
            Role::Temporaries => &self.temporaries,
            Role::Inputs => &self.inputs,
            Role::Other => &self.other,
            Role::Unknown => &self.unknown,
        }
    }

    /// The value for `role`, to change.
    pub fn get_mut(&mut self, role: Role) -> &mut T {
        match role {
            Role::Parameters => &mut self.parameters,
            Role::Gradients => &mut self.gradients,
            Role::OptimizerState => &mut self.optimizer_state,
            Role::Activations => &mut self.activations,
            Role::Temporaries => &mut self.temporaries,
            Role::Inputs => &mut self.inputs,
            Role::Other => &mut self.other,
            Role::Unknown => &mut self.unknown,
        }
    }
}

/// Bytes per role.
pub type RoleBytes = PerRole<u64>;

impl RoleBytes {
    /// All the bytes, whatever their role.
    pub fn total(&self) -> u64 {
        Role::ALL.iter().map(|&r| *self.get(r)).sum()
    }

    /// The role holding the most bytes, leaving unknown aside unless it is all there is.
    pub fn largest(&self) -> Option<Role> {
        Role::ALL
            .iter()
            .copied()
            .filter(|&r| r != Role::Unknown && *self.get(r) > 0)
            .max_by_key(|&r| *self.get(r))
            .or_else(|| (self.unknown > 0).then_some(Role::Unknown))
    }
}

impl RoleBytes {
    /// Each role with bytes in `self` or `other`, paired with its bytes in
    /// both, in the order reports list roles: the rows of a comparison.
    pub fn beside(&self, other: &RoleBytes) -> Vec<(Role, u64, u64)> {
        Role::ALL
            .into_iter()
            .map(|r| (r, *self.get(r), *other.get(r)))
            .filter(|&(_, a, b)| a > 0 || b > 0)
            .collect()
    }
}

/// Bytes of one role by the evidence that told them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Told {
    /// Told by the frames that allocated them.
    pub frames: u64,
    /// Told by when they were made and freed.
    pub lifetimes: u64,
    /// Told by matching their sizes with the gradients'.
    pub sizes: u64,
}

/// For each role, how many of its bytes each kind of evidence told.
pub type RoleEvidence = PerRole<Told>;

/// Roles of the memory live at one moment, with the evidence for each.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RolesAt {
    /// Bytes per role; they add up to the bytes live at that moment.
    pub bytes: RoleBytes,
    /// How each role's bytes were told.
    pub evidence: RoleEvidence,
}

impl RolesAt {
    /// Counts `bytes` of `role`, told by `evidence` (none for unknown).
    pub fn add(&mut self, role: Role, bytes: u64, evidence: Option<Evidence>) {
        *self.bytes.get_mut(role) += bytes;
        let told = self.evidence.get_mut(role);
        match evidence {
            Some(Evidence::Frames) => told.frames += bytes,
            Some(Evidence::Lifetimes) => told.lifetimes += bytes,
            Some(Evidence::Sizes) => told.sizes += bytes,
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_add_up_and_name_the_largest() {
        let mut at = RolesAt::default();
        at.add(Role::Parameters, 100, Some(Evidence::Sizes));
        at.add(Role::Activations, 300, Some(Evidence::Lifetimes));
        at.add(Role::Unknown, 500, None);
        assert_eq!(at.bytes.total(), 900);
        assert_eq!(at.bytes.largest(), Some(Role::Activations));
        assert_eq!(at.evidence.parameters.sizes, 100);
        let v = serde_json::to_value(at.bytes).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        assert_eq!(keys.len(), 8);
        for r in Role::ALL {
            let name = serde_json::to_value(r).unwrap();
            assert!(v.get(name.as_str().unwrap()).is_some(), "{r:?}");
            assert_eq!(name.as_str(), Some(r.key()), "{r:?}");
        }
    }
}
