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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{Sampler, SamplingParams};
    use std::sync::Mutex;

    /// Allows only even ids, and records what it was told.
    struct Even(Arc<Mutex<Vec<u32>>>);

    impl TokenMask for Even {
        fn mask(&mut self, logits: &mut [f32]) {
            logits
                .iter_mut()
                .skip(1)
                .step_by(2)
                .for_each(|l| *l = f32::NEG_INFINITY);
        }
        fn commit(&mut self, token: u32) {
            self.0.lock().unwrap().push(token);
        }
    }

    struct EvenSource(Arc<Mutex<Vec<u32>>>);

    impl ConstraintSource for EvenSource {
        fn start(&self) -> Box<dyn TokenMask> {
            Box::new(Even(self.0.clone()))
        }
        fn describe(&self) -> &str {
            "even"
        }
    }

    /// The mask applies before the choice, greedy or sampled, and sees every chosen token.
    #[test]
    fn the_sampler_chooses_only_allowed_tokens_and_commits_them() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let c = Constraint::new(Arc::new(EvenSource(seen.clone())));
        assert_eq!(format!("{c:?}"), "Constraint(even)");
        assert_eq!(c, c.clone());
        let logits: Vec<f32> = (0..64)
            .map(|i| if i % 2 == 1 { 5.0 } else { 0.1 * i as f32 })
            .collect();
        let mut greedy = Sampler::new(
            SamplingParams {
                constraint: Some(c.clone()),
                ..SamplingParams::greedy()
            },
            &[],
        );
        assert_eq!(greedy.sample(&mut logits.clone()), 62);
        let mut hot = Sampler::new(
            SamplingParams {
                temperature: 1.5,
                seed: 4,
                constraint: Some(c),
                ..Default::default()
            },
            &[],
        );
        let draws: Vec<u32> = (0..200).map(|_| hot.sample(&mut logits.clone())).collect();
        assert!(draws.iter().all(|t| t % 2 == 0), "{draws:?}");
        assert!(draws.iter().any(|&t| t != 62));
        let seen = seen.lock().unwrap();
        assert_eq!(seen[0], 62);
        assert_eq!(&seen[1..], &draws[..]);
    }
}
