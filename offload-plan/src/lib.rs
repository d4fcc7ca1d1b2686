//! Plans as TOML, the cost model and the planner.
//!
//! Design choices:
//!
//! - The [`Plan`] type lives in `offload-core`, beside its resolver; this crate
//!   reads and writes it, so neither crate depends on the other in a cycle.
//! - No device work and no I/O beyond reading a checkpoint's header (the CLI) or
//!   a calibration file.
//! - The planner optimises the bound a ring can reach and proves its choice by
//!   replaying the ring's schedule ([`CostModel::simulate_s`]).
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

pub mod cost;
pub mod host;
pub mod planner;

pub use cost::{BlockCost, CodedCost, CostModel, DEFAULT_STAGING_BUFFERS};
pub use host::{plan_host_tier, HostChoice};
pub use offload_core::{ComponentPlan, PinFallback, Plan, ResidentPolicy, Strategy};
pub use planner::{
    best_bound, depth_within, depth_within_each, plan, plan_heuristic, plan_with_coding, streamed_choice, streamed_depth, streamed_replays,
    Choice, CODING_GAIN, EXHAUSTIVE_MAX,
};

/// Why a plan could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The TOML is malformed or has an unknown key (the message names the line and the key).
    #[error("plan TOML: {0}")]
    Parse(#[from] toml::de::Error),
    /// A value is impossible.
    #[error("plan TOML, line {line}: {key} = {value}: {why}")]
    Value {
        /// 1-based line of the key (0 if not found in the text).
        line: usize,
        /// Dotted key path.
        key: String,
        /// The value given.
        value: String,
        /// Why it cannot work.
        why: String,
    },
    /// The plan could not be written.
    #[error("writing plan TOML: {0}")]
    Write(#[from] toml::ser::Error),
}

fn line_of(text: &str, section: &str, key: &str) -> usize {
    let mut in_section = false;
    for (i, l) in text.lines().enumerate() {
        let t = l.trim();
        if t.starts_with('[') {
            in_section = t.trim_matches(|c| c == '[' || c == ']').trim() == section;
        } else if in_section && t.split('=').next().map(str::trim) == Some(key) {
            return i + 1;
        }
    }
    0
}

/// Read a plan from TOML text. Unknown keys and impossible values are errors
/// that name the line and the key.
pub fn from_toml(text: &str) -> Result<Plan, PlanError> {
    let plan: Plan = toml::from_str(text)?;
    let sections =
        std::iter::once(("default".to_owned(), &plan.default)).chain(plan.components.iter().map(|(n, c)| (format!("components.{n}"), c)));
    for (section, c) in sections {
        let bad = |key: &str, value: String, why: &str| PlanError::Value {
            line: line_of(text, &section, key),
            key: format!("{section}.{key}"),
            value,
            why: why.into(),
        };
        if c.prefetch_depth == 0 {
            return Err(bad("prefetch_depth", "0".into(), "must be at least 1"));
        }
        if c.device_budget_bytes == Some(0) {
            return Err(bad("device_budget_bytes", "0".into(), "a zero budget holds no block"));
        }
        if c.device_budget_bytes.is_some() && c.device_budget_free_minus_bytes.is_some() {
            return Err(bad(
                "device_budget_free_minus_bytes",
                "…".into(),
                "give either device_budget_bytes or device_budget_free_minus_bytes",
            ));
        }
        if c.resident_policy == ResidentPolicy::Explicit
            && c.resident_blocks.is_empty()
            && c.strategy == Strategy::Layerwise
            && c.device_budget_bytes.is_some()
        {
            // Allowed: an explicit empty resident set streams everything.
        }
        for r in &c.resident_blocks {
            if offload_core::BlockId::parse(r).is_none() {
                return Err(bad("resident_blocks", format!("{r:?}"), "a block is named \"<stack>.<index>\""));
            }
        }
    }
    Ok(plan)
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
            ComponentPlan { strategy: Strategy::OnDemand, resident_policy: ResidentPolicy::Leading, ..Default::default() },
        );
        let text = to_toml(&plan).unwrap();
        assert_eq!(from_toml(&text).unwrap(), plan);
    }

    #[test]
    fn bad_values_name_the_line_and_key() {
        let e = from_toml("[default]\nstrategy = \"sideways\"\n").unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("sideways"), "{e}");
        assert!(from_toml("[default]\ncoded = true\n").unwrap().default.coded, "coded blocks from TOML");
        let e = from_toml("[default]\n\n[components.vae]\nstrategy = \"on_demand\"\nprefetch_depth = 0\n").unwrap_err().to_string();
        assert!(e.contains("line 5") && e.contains("components.vae.prefetch_depth"), "{e}");
        let e = from_toml("[components.t]\nresident_blocks = [\"blocks\"]\n").unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("resident_blocks"), "{e}");
        let e = from_toml("[components.t]\ncolour = 3\n").unwrap_err().to_string();
        assert!(e.contains("colour"), "{e}");
    }
}
