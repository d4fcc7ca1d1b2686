//! Plans as TOML.
//!
//! Design choices:
//!
//! - The [`Plan`] type lives in `offload-core`, beside its resolver; this crate
//!   reads and writes it, so neither crate depends on the other in a cycle.
//! - No I/O beyond reading what it is given and no device work.
//!
//! Not yet here (issue 6): the cost model, the planner that chooses the resident
//! set under a budget, and the `offload-plan` CLI.
//!
//! ```
//! let plan = offload_plan::from_toml(r#"
//!     [default]
//!     prefetch_depth = 2
//!     [components.text_encoder]
//!     strategy = "on_demand"
//! "#).unwrap();
//! assert_eq!(plan.default.prefetch_depth, 2);
//! assert!(offload_plan::from_toml("[default]\nprefetch_dept = 2").unwrap_err().to_string().contains("prefetch_dept"));
//! ```

pub use offload_core::{ComponentPlan, Plan, Strategy};

/// Why a plan could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The TOML is malformed, has an unknown key or an impossible value (the
    /// message names the line and the key).
    #[error("plan TOML: {0}")]
    Parse(#[from] toml::de::Error),
    /// The plan could not be written.
    #[error("writing plan TOML: {0}")]
    Write(#[from] toml::ser::Error),
}

/// Read a plan from TOML text. Unknown keys are errors.
pub fn from_toml(text: &str) -> Result<Plan, PlanError> {
    Ok(toml::from_str(text)?)
}

/// Write a plan as TOML text.
pub fn to_toml(plan: &Plan) -> Result<String, PlanError> {
    Ok(toml::to_string_pretty(plan)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let plan = Plan::layerwise().prefetch_depth(2).device_budget_gib(12.0).component(
            "vae",
            ComponentPlan {
                strategy: Strategy::OnDemand,
                ..Default::default()
            },
        );
        let text = to_toml(&plan).unwrap();
        assert_eq!(from_toml(&text).unwrap(), plan);
    }

    #[test]
    fn bad_values_name_the_line() {
        let e = from_toml("[default]\nstrategy = \"sideways\"\n").unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("sideways"), "{e}");
    }
}
