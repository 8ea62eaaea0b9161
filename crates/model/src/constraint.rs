//! Constrained decoding's contract with the sampler: a grammar compiled once (`Constraint`)
//! starts one `TokenMask` per sequence, which the sampler asks for the allowed tokens before
//! every choice and tells the chosen one after. The grammar engine itself lives in the engine
//! crate; the model crate only knows this contract, so every backend's host sampler honours a
//! constraint the same way.

use std::fmt;
use std::sync::Arc;

/// One sequence's constraint state.
pub trait TokenMask: Send {
    /// Sets the logit of every token the constraint does not allow next to -inf. It always
    /// leaves at least one token (an end-of-sequence token once the grammar is complete or
    /// stuck), so a choice is always possible.
    fn mask(&mut self, logits: &mut [f32]);
    /// Advances past the chosen token.
    fn commit(&mut self, token: u32);
    /// Works out what the next `mask` allows ahead of it, from the tokens committed so far: a
    /// backend calls it while its device computes the logits, so the grammar engine's work
    /// overlaps the step instead of following it. Optional: `mask` does it where this was not
    /// called.
    fn prepare(&mut self) {}
    /// What the next `mask` would leave, as bits (bit id % 32 of word id / 32 set where the
    /// token may be chosen) for a device that masks the logits itself; takes the place of
    /// `mask` for that position. False where this constraint cannot say (the host masks).
    fn allowed_bits(&mut self, _words: &mut [u32]) -> bool {
        false
    }
}

/// A compiled constraint: where each sequence's `TokenMask` comes from.
pub trait ConstraintSource: Send + Sync {
    fn start(&self) -> Box<dyn TokenMask>;
    /// A short name for logs and `Debug` ("json_schema", "grammar", ...).
    fn describe(&self) -> &str;
}

/// A shared handle on a compiled constraint; cloning it shares the compilation, and every
/// `Sampler` built from it starts its own state.
#[derive(Clone)]
pub struct Constraint(Arc<dyn ConstraintSource>);

impl Constraint {
    pub fn new(source: Arc<dyn ConstraintSource>) -> Self {
        Constraint(source)
    }

    pub fn start(&self) -> Box<dyn TokenMask> {
        self.0.start()
    }
}

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Constraint({})", self.0.describe())
    }
}

/// Two handles are equal when they share one compilation (a grammar's state cannot be compared).
impl PartialEq for Constraint {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
