//! The execution engine: what turns a scheduled step into sampled tokens. `sampling` picks each
//! request's next token from its logits; `sim` is the roofline timing model behind the `sim`
//! backend, so many simulated GPUs can run on one machine (DESIGN.md section 5).

pub mod sampling;
pub mod sim;
