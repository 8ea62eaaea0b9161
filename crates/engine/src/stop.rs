//! Stop strings over streamed text: text that might be the start of a stop string is held back
//! until it is known not to be, so a client never sees part of a stop string.

pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
    /// The stop string that ended the text, once one has.
    matched: Option<usize>,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            matched: None,
        }
    }

    /// Adds generated text; returns the text safe to emit and whether a stop string was hit
    /// (the stop string and anything after it are dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        if let Some((cut, i)) = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.pending.find(s.as_str()).map(|cut| (cut, i)))
            .min()
        {
            self.matched = Some(i);
            let out = self.pending[..cut].to_string();
            self.pending.clear();
            return (out, true);
        }
        let keep = self.held_suffix_len();
        let split = self.pending.len() - keep;
        let out = self.pending[..split].to_string();
        self.pending.drain(..split);
        (out, false)
    }

    /// The stop string that ended the text (the earliest in it; of two at one place, the first
    /// listed), if one did: Anthropic's `stop_sequence` names it.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// Text held back at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Longest suffix of `pending` that is a proper prefix of some stop string.
    fn held_suffix_len(&self) -> usize {
        let p = &self.pending;
        let mut best = 0;
        for s in &self.stops {
            for (i, _) in p.char_indices() {
                let tail = &p[i..];
                if tail.len() > best && tail.len() < s.len() && s.starts_with(tail) {
                    best = tail.len();
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_partial_stop_and_cuts_at_full_stop() {
        let mut m = StopMatcher::new(&["</end>".to_string()]);
        assert_eq!(m.push("hello </e"), ("hello ".to_string(), false));
        assert_eq!(m.push("x"), ("</ex".to_string(), false));
        assert_eq!(m.push(" tail </en"), (" tail ".to_string(), false));
        assert_eq!(m.push("d> more"), (String::new(), true));
        assert_eq!(m.matched(), Some("</end>"));
    }

    #[test]
    fn the_earliest_stop_in_the_text_is_the_one_matched() {
        let mut m = StopMatcher::new(&["b".to_string(), "a".to_string(), "ab".to_string()]);
        assert_eq!(m.matched(), None);
        assert_eq!(m.push("xab"), ("x".to_string(), true));
        assert_eq!(m.matched(), Some("a"));
    }

    #[test]
    fn no_stops_passes_everything() {
        let mut m = StopMatcher::new(&[]);
        assert_eq!(m.push("abc"), ("abc".to_string(), false));
        assert_eq!(m.finish(), "");
    }
}
