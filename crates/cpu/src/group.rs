//! A batch's expert slots grouped by expert with a counting sort, so each chosen expert's rows
//! are read once for all the slots that chose it.

/// Slot `i * n_expert_used + k` is token i's k-th choice; `slots[start[e]..start[e + 1]]` are
/// expert e's slots in increasing order. Buffers are reused from batch to batch.
#[derive(Default)]
pub(crate) struct ExpertGroups {
    /// [n_expert + 1] offsets into `slots`
    start: Vec<usize>,
    /// [tokens x n_expert_used] slots, grouped by expert
    slots: Vec<usize>,
}

impl ExpertGroups {
    /// Groups the slots of `chosen` (every token's choices, `nu` per token, concatenated).
    pub(crate) fn build(&mut self, n_expert: usize, chosen: impl Iterator<Item = usize> + Clone) {
        self.start.clear();
        self.start.resize(n_expert + 1, 0);
        for e in chosen.clone() {
            self.start[e + 1] += 1;
        }
        for e in 0..n_expert {
            self.start[e + 1] += self.start[e];
        }
        let total = self.start[n_expert];
        self.slots.clear();
        self.slots.resize(total, 0);
        // `fill[e]` is where expert e's next slot goes (`start` shifted by one).
        let mut fill = std::mem::take(&mut self.start);
        for (slot, e) in chosen.enumerate() {
            self.slots[fill[e]] = slot;
            fill[e] += 1;
        }
        // fill[e] now equals the old start[e + 1]: shift back to restore the offsets.
        fill.rotate_right(1);
        fill[0] = 0;
        self.start = fill;
    }

    /// Every expert with at least one slot: the expert, where its slots start in `slots()`,
    /// and its slots.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (usize, usize, &[usize])> + '_ {
        self.start
            .windows(2)
            .enumerate()
            .filter(|(_, w)| w[1] > w[0])
            .map(|(e, w)| (e, w[0], &self.slots[w[0]..w[1]]))
    }

    /// Every slot, grouped by expert.
    pub(crate) fn slots(&self) -> &[usize] {
        &self.slots
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_every_slot_once_under_its_expert_in_slot_order() {
        let chosen = [3usize, 0, 3, 5, 0, 3, 7, 1];
        let mut g = ExpertGroups::default();
        g.build(8, chosen.iter().copied());
        let got: Vec<(usize, Vec<usize>)> = g.iter().map(|(e, _, s)| (e, s.to_vec())).collect();
        assert_eq!(g.slots(), &[1, 4, 7, 0, 2, 5, 3, 6]);
        assert!(g.iter().all(|(_, at, s)| &g.slots()[at..at + s.len()] == s));
        assert_eq!(
            got,
            vec![
                (0, vec![1, 4]),
                (1, vec![7]),
                (3, vec![0, 2, 5]),
                (5, vec![3]),
                (7, vec![6]),
            ]
        );
        // Reused for a smaller batch: nothing of the first is left.
        g.build(8, [2usize, 2].into_iter());
        let got: Vec<(usize, Vec<usize>)> = g.iter().map(|(e, _, s)| (e, s.to_vec())).collect();
        assert_eq!(got, vec![(2, vec![0, 1])]);
        g.build(8, std::iter::empty());
        assert_eq!(g.iter().count(), 0);
    }
}
