//! A constraint's token mask in the sampler (model/src/constraint.rs): applied before every
//! choice, greedy or sampled, and told each chosen token.

use std::sync::{Arc, Mutex};

use q4moe_model::constraint::{Constraint, ConstraintSource, TokenMask};
use q4moe_model::sampling::{Sampler, SamplingParams};

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
