//! The range checks on a [`SimHardware`](crate::SimHardware)'s or
//! [`SimModel`](crate::SimModel)'s fields, and the error that names the first bad one.
//!
//! Why apart: both descriptions check their fields the same way. The checks are advice, not a
//! precondition: the step-cost and capacity formulas never panic on a field they would refuse.

/// A bad [`SimHardware`](crate::SimHardware) or [`SimModel`](crate::SimModel) field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimConfigError {
    /// The field's value is out of its range.
    #[error("simulator field `{field}` is {value}, expected {expected}")]
    Invalid {
        /// The field's name.
        field: &'static str,
        /// The value found.
        value: f64,
        /// The allowed range, in words.
        expected: &'static str,
    },
}

pub(crate) fn positive(field: &'static str, value: f64) -> Result<(), SimConfigError> {
    let ok = value.is_finite() && value > 0.0;
    ok.then_some(()).ok_or(SimConfigError::Invalid { field, value, expected: "a number > 0" })
}

pub(crate) fn non_negative(field: &'static str, value: f64) -> Result<(), SimConfigError> {
    let ok = value.is_finite() && value >= 0.0;
    ok.then_some(()).ok_or(SimConfigError::Invalid { field, value, expected: "a number >= 0" })
}

pub(crate) fn fraction(field: &'static str, value: f64) -> Result<(), SimConfigError> {
    let ok = value > 0.0 && value <= 1.0;
    ok.then_some(()).ok_or(SimConfigError::Invalid { field, value, expected: "a number in (0, 1]" })
}
